"""Choosing the next token: logit processors (logit_bias, repetition / presence /
frequency penalties, a grammar's token mask), then greedy at temperature 0, else
temperature, top-k, min-p and nucleus sampling from a seeded generator, so the same
seed gives the same tokens. The log-probabilities a client may ask for are those of
the processed distribution before temperature and truncation. Plus stop-string search."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from shards.errors import InvalidParams

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in what was generated
    repetition_penalty: float = 1.0  # CTRL/transformers': logits of tokens in prompt or output divided (> 0) or multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    grammar: str | None = None  # an llguidance grammar (shards.grammar) every token must keep to
    # vLLM's extensions: the end tokens masked (and stop strings not looked for) until this
    # many tokens are generated; end tokens taken as any other token (max_tokens ends it)
    min_tokens: int = 0
    ignore_eos: bool = False
    # vLLM's: the log-probability of every prompt token after the first, and the k most
    # likely at each prompt position (None: not computed; the head then runs on one row)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise InvalidParams(f"temperature {self.temperature} must be within [0, 100]", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParams(f"top_p {self.top_p} must be within (0, 1]", param="top_p")
        if self.max_tokens < 0:
            raise InvalidParams(f"max_tokens {self.max_tokens} must not be negative", param="max_tokens")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParams("stop strings must be non-empty strings", param="stop")
        if self.top_k < 0:
            raise InvalidParams(f"top_k {self.top_k} must not be negative", param="top_k")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidParams(f"min_p {self.min_p} must be within [0, 1]", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise InvalidParams(f"{name} must be within [-2, 2]", param=name)
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise InvalidParams("repetition_penalty must be within (0, 10]", param="repetition_penalty")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidParams("logit_bias values must be within [-100, 100]", param="logit_bias")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParams(f"top logprobs must be within [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParams(f"prompt logprobs must be within [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParams(f"min_tokens {self.min_tokens} must be within [0, max_tokens = {self.max_tokens}]",
                                param="min_tokens")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability and the ``k`` most likely tokens' at that step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenMask(Protocol):
    """What a grammar constraint offers the sampler (``shards.grammar.Constraint``)."""

    def allowed(self, vocab: int) -> Tensor: ...  # bool [vocab]

    def accept(self, token: int) -> None: ...

    def allows(self, tokens: Sequence[int]) -> int: ...  # how many of them it would take in turn


class Sampler:
    """Draws are keyed by (seed, step), not by a running generator: a generation
    resumed at step k elsewhere (after a supernode loss) draws what the lost one
    would have drawn."""

    def __init__(self, params: SamplingParams, mask: TokenMask | None = None, eos: frozenset[int] = frozenset()):
        self.params = params
        self.mask = mask
        self.eos = eos
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device="cpu")
        self._step = 0
        self.last: TokenLogprobs | None = None  # of the latest draw, when params.logprobs is set
        p = params
        # Greedy with nothing to apply first: the argmax of the logits as they are, without
        # seeding the generator or copying the row (a decode step pays this per session).
        self._argmax_only = (p.temperature == 0.0 and mask is None and not p.logit_bias and not p.penalized
                             and p.logprobs is None and not (p.min_tokens and eos))
        self._eos_ids = torch.tensor(sorted(eos), dtype=torch.long)

    def process(self, logits: Tensor, history: Sequence[int] = (), prompt_len: int = 0, step: int = 0) -> Tensor:
        """The logits after bias, penalties and the grammar's mask, and the end tokens masked
        while ``step`` (tokens generated so far) is below min_tokens (a new float32 CPU tensor)."""
        x = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1).clone()
        p = self.params
        if step < p.min_tokens and self.eos:
            x[self._eos_ids[self._eos_ids < x.numel()]] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < x.numel()], dtype=torch.long)
            x.index_add_(0, ids, torch.tensor([b for t, b in p.logit_bias if t < x.numel()]))
        if p.repetition_penalty != 1.0 and history:
            seen = torch.unique(torch.tensor(list(history), dtype=torch.long))
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        generated = history[prompt_len:]
        if (p.presence_penalty or p.frequency_penalty) and generated:
            counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=x.numel())[: x.numel()]
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if self.mask is not None:
            x.masked_fill_(~self.mask.allowed(x.numel()), float("-inf"))
        return x

    def next(self, logits: Tensor, step: int | None = None, history: Sequence[int] = (), prompt_len: int = 0) -> int:
        """One token id from logits [V]; ``step`` is the index of the token being drawn,
        ``history`` the prompt and the tokens generated so far (for the penalties)."""
        step = self._step if step is None else step
        self._step = step + 1
        if self._argmax_only and logits.device.type == "cpu" and logits.dtype == torch.float32:
            return int(torch.argmax(logits.reshape(-1)))  # what process and _draw give here, without the copy
        self.generator.manual_seed((self.seed * 1_000_003 + step) % 2**63)
        x = self.process(logits, history, prompt_len, step)
        token = self._draw(x)
        if self.params.logprobs is not None:
            logp = torch.log_softmax(x, dim=-1)
            k = self.params.logprobs
            top = torch.topk(logp, k) if k else None
            self.last = TokenLogprobs(token, float(logp[token]), tuple(
                (int(i), float(v)) for v, i in zip(top.values, top.indices)) if top is not None else ())
        if self.mask is not None and token not in self.eos:
            self.mask.accept(token)
        return token

    def _draw(self, x: Tensor) -> int:
        p = self.params
        if p.temperature == 0.0:
            # torch.argmax returns the first maximal index: ties go to the lowest id.
            return int(torch.argmax(x))
        x = x / p.temperature
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True, stable=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            sorted_probs[before >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def prompt_scores(logits: Tensor, targets: Sequence[int], tops: Sequence[int]) -> list[TokenLogprobs]:
    """Prompt rows' scores: per row of ``logits`` [N, V] (the model's raw distribution, as
    vLLM's prompt logprobs are), the log-probability of the prompt's next token
    ``targets[i]`` and the ``tops[i]`` most likely tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, torch.tensor(list(targets), dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    k = max(tops, default=0)
    values: list = []
    indices: list = []
    if k:
        top = torch.topk(logp, k)
        values, indices = top.values.tolist(), top.indices.tolist()
    return [TokenLogprobs(t, v, tuple(zip(indices[i][:tops[i]], values[i][:tops[i]])) if tops[i] else ())
            for i, (t, v) in enumerate(zip(targets, picked))]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string in ``text`` begins, or None."""
    found = [i for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string,
    and so must not be sent yet."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold
