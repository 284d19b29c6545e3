"""Choosing the next token: greedy at temperature 0, else temperature and nucleus sampling
from a seeded generator, so the same seed gives the same tokens. Plus stop-string search."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from shards.errors import InvalidParams


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise InvalidParams(f"temperature {self.temperature} must be within [0, 100]", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParams(f"top_p {self.top_p} must be within (0, 1]", param="top_p")
        if self.max_tokens < 0:
            raise InvalidParams(f"max_tokens {self.max_tokens} must not be negative", param="max_tokens")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParams("stop strings must be non-empty strings", param="stop")


class Sampler:
    """Draws are keyed by (seed, step), not by a running generator: a generation
    resumed at step k elsewhere (after a supernode loss) draws what the lost one
    would have drawn."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device="cpu")
        self._step = 0

    def next(self, logits: Tensor, step: int | None = None) -> int:
        """One token id from logits [V]; ``step`` is the index of the token being drawn."""
        step = self._step if step is None else step
        self._step = step + 1
        self.generator.manual_seed((self.seed * 1_000_003 + step) % 2**63)
        logits = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        p = self.params
        if p.temperature == 0.0:
            # torch.argmax returns the first maximal index: ties go to the lowest id.
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True, stable=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            sorted_probs[before >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


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
