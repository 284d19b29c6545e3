"""The supernode's scheduler: continuous batching through the pipeline.

Running sessions are spread over *lanes*. Each lane loops: one batched step
through the plan for all its sessions (a decode row each, or a prefill chunk
for a new one), sample, repeat; sessions join and leave at every step. With one
lane per stage, while stage B works on lane 1's batch stage A works on lane 2's
(micro-batches in flight), so no stage idles.

A session's token history (prompt + generated so far) lives here, not on the
stages, so after a peer is lost the pipeline replays it through the new owners
and decoding goes on with the same tokens (see ``Pipeline.step``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import structlog
import torch

from meshd.errors import KNOWN_ERRORS, NoCapacity
from meshd.serving.pipeline import Pipeline
from shards.grammar import Constraint
from shards.sampling import Sampler, SamplingParams, TokenLogprobs, find_stop, stop_holdback
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()

MAX_LANES = 4
MAX_BATCH = 64  # sessions per lane step


def new_session_id() -> str:
    return secrets.token_hex(8)


@dataclass(eq=False)
class Session:
    """One generation's state on the supernode."""

    id: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    # How many leading tokens of ``tokens`` the stages hold in their KV caches,
    # and under which plan term (another term means the caches may be gone).
    cached: int = 0
    term: int | None = None
    reserved: int = 0  # KV positions admitted for it
    sampler: Sampler | None = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None (or an exception)
    finished: bool = False
    # In a step now: its caches are freed only after the step, or a Drop could
    # reach a stage before that step's rows do.
    in_step: bool = False
    released: bool = False
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by position in ``generated``
    streamed: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What a client is sent: new text, the token ids behind it, and a finish reason at the end."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when asked for


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Lane:
    def __init__(self, index: int):
        self.index = index
        self.sessions: list[Session] = []
        self.wake = asyncio.Event()
        self.steps = 0


class Scheduler:
    def __init__(self, pipeline: Pipeline, tokenizer: MeshTokenizer | None, kv_budget_tokens: int | None = None,
                 on_finished: Callable[[], None] | None = None):
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.kv_budget_tokens = kv_budget_tokens
        self.on_finished = on_finished  # after each generation ends (a drain waits for none to be left)
        self.active: dict[str, Session] = {}
        self.lanes = [Lane(i) for i in range(MAX_LANES)]
        self.reserved_tokens = 0
        self.tokens_generated = 0
        self.shared_steps = 0  # steps that carried more than one session
        self.max_batch = 0

    # -- the loops (owned by the node's TaskGroup) ------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for lane in self.lanes:
                tg.create_task(self._lane_loop(lane))

    async def _lane_loop(self, lane: Lane) -> None:
        while True:
            if not lane.sessions:
                lane.wake.clear()
                await lane.wake.wait()
                continue
            batch = lane.sessions[:MAX_BATCH]
            for s in batch:
                s.in_step = True
            try:
                results = await self.pipeline.step(batch, _pick)
            except KNOWN_ERRORS as exc:  # NoCapacity: no plan came back in time
                results = {}
                for s in batch:
                    self._finish(s, exc)
            finally:
                for s in batch:
                    s.in_step = False
                for s in batch:
                    if s.finished:
                        await self._release(s)
            lane.steps += 1
            if len(batch) > 1:
                self.shared_steps += 1
            self.max_batch = max(self.max_batch, len(batch))
            for s in batch:
                token = results.get(s.id)
                if token is None or s.finished:
                    continue
                if token in s.eos:
                    self._finish(s, None)
                    continue
                s.tokens.append(token)
                self.tokens_generated += 1
                s.out.put_nowait(token)
                if len(s.generated) >= s.params.max_tokens:
                    self._finish(s, None)

    def _lanes_in_use(self) -> int:
        """One lane per stage keeps every stage busy; one is enough for one stage."""
        plan = self.pipeline.plan
        stages = len(plan.assignments) if plan is not None else 1
        return max(1, min(MAX_LANES, stages))

    def _admit(self, session: Session) -> None:
        need = session.prompt_len + session.params.max_tokens
        if self.kv_budget_tokens is not None and self.reserved_tokens + need > self.kv_budget_tokens:
            raise NoCapacity(
                f"KV cache budget full: {self.reserved_tokens} of {self.kv_budget_tokens} positions in use, "
                f"this request needs {need}; retry shortly"
            )
        session.reserved = need
        self.reserved_tokens += need
        self.active[session.id] = session
        lane = min(self.lanes[: self._lanes_in_use()], key=lambda ln: len(ln.sessions))
        lane.sessions.append(session)
        lane.wake.set()

    async def _release(self, session: Session) -> None:
        if not session.released and not session.in_step:
            session.released = True
            await self.pipeline.release(session)

    def _finish(self, session: Session, error: BaseException | None) -> None:
        """Take the session out of its lane; its generator sees the end (or the error)."""
        if session.finished:
            return
        session.finished = True
        for lane in self.lanes:
            if session in lane.sessions:
                lane.sessions.remove(session)
        session.out.put_nowait(error)

    # -- one client's generation --------------------------------------------------------

    def open(self, prompt_ids: list[int], params: SamplingParams, history: list[int] | None = None) -> Session:
        """Admit one generation (NoCapacity when the KV budget is full, before any answer
        went out); ``history`` resumes one whose first tokens were already produced (a
        resubmission after a supernode loss). Stream it with ``stream``, or ``close`` it."""
        assert self.tokenizer is not None, "the scheduler serves only once a model is loaded"
        mask = None
        if params.grammar is not None:
            mask = Constraint(self.tokenizer, params.grammar)
            mask.replay(history or ())
        session = Session(new_session_id(), list(prompt_ids) + list(history or ()), len(prompt_ids), params,
                          self.tokenizer.eos_ids, sampler=Sampler(params, mask, self.tokenizer.eos_ids))
        self._admit(session)
        return session

    async def close(self, session: Session) -> None:
        """Give back a session that was opened but never streamed."""
        if not session.streamed:
            self._finish(session, None)
            self._forget(session)
            await self._release(session)

    def _forget(self, session: Session) -> None:
        if self.active.pop(session.id, None) is not None:
            self.reserved_tokens -= session.reserved
            if self.on_finished is not None:
                self.on_finished()

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        usage: Usage | None = None,
        history: list[int] | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream chunks for one choice (``open`` then ``stream``)."""
        session = self.open(prompt_ids, params, history)
        async for chunk in self.stream(session, usage):
            yield chunk

    async def stream(self, session: Session, usage: Usage | None = None) -> AsyncIterator[Chunk]:
        """The chunks of an opened session; it is given back when this ends, however it ends."""
        assert self.tokenizer is not None
        session.streamed = True
        params = session.params
        prompt_len = session.prompt_len
        decoder = self.tokenizer.stream_decoder()
        for tok in session.generated:
            decoder.push(tok)
        structlog.contextvars.bind_contextvars(session=session.id)
        log.info("session_started", prompt_tokens=prompt_len, max_tokens=params.max_tokens,
                 resumed=len(session.generated))
        t0 = time.monotonic()
        pending, pending_ids, pending_lp, finish = "", [], [], "length"
        delivered = len(session.generated)
        try:
            if len(session.generated) >= params.max_tokens:
                self._finish(session, None)
            while True:
                item = await session.out.get()
                if item is None:
                    # The lane ended it: EOS, or max_tokens reached.
                    finish = "stop" if delivered < params.max_tokens else "length"
                    break
                if isinstance(item, BaseException):
                    raise item
                if delivered in session.logprobs:
                    pending_lp.append(session.logprobs.pop(delivered))
                delivered += 1
                pending_ids.append(item)
                pending += decoder.push(item)
                cut = find_stop(pending, params.stop)
                if cut is not None:
                    pending, finish = pending[:cut], "stop"
                    break
                hold = stop_holdback(pending, params.stop)
                ready, pending = pending[: len(pending) - hold], pending[len(pending) - hold:]
                if ready or pending_ids:
                    yield Chunk(ready, tuple(pending_ids), None, tuple(pending_lp))
                    pending_ids, pending_lp = [], []
            if finish == "length":
                pending += decoder.flush()
            yield Chunk(pending, tuple(pending_ids), finish, tuple(pending_lp))
        finally:
            self._finish(session, None)
            self._forget(session)
            if usage is not None:
                usage.prompt_tokens += prompt_len
                usage.completion_tokens += delivered
            await self._release(session)
            log.info("session_finished", tokens=delivered, finish=finish,
                     seconds=round(time.monotonic() - t0, 3))
            structlog.contextvars.unbind_contextvars("session")


def _pick(session: Session, logits: torch.Tensor) -> int:
    """The session's next token from its logits (on the engine's thread): bias, penalties
    and grammar mask applied, its log-probabilities kept where asked for."""
    sampler, at = session.sampler, len(session.generated)
    token = sampler.next(logits, at, session.tokens, session.prompt_len)
    if sampler.last is not None:
        session.logprobs[at] = sampler.last
    return token


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV cache bytes one position costs across every layer of the model."""
    return config.n_layers * 2 * config.n_kv_heads * config.head_dim * torch.empty(0, dtype=dtype).element_size()
