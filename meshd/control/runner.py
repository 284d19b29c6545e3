"""Where a span runs, as the supernode's pipeline sees it: a peer's link, or this
peer's own engine behind the same interface."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import torch

from meshd.control.timing import SAMPLE, STEP_TIMES
from meshd.errors import KVFull, ModelError, NoCapacity, PeerLost, StageFailed
from protocol.messages import Segment
from shards.engine import Score, StageEngine
from shards.errors import CacheMissing

Forwarded = Callable[[int, float], None]  # (rows, seconds) of one call through this peer's span


class StageRunner(Protocol):
    """What the pipeline needs from a place that runs a span: ``LocalRunner`` or a ``Link``."""

    async def forward_batch(self, term: int, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor: ...

    async def drop(self, term: int, session: str) -> None: ...


async def run_span(engine: StageEngine, segments: list[Segment], hidden: torch.Tensor, *,
                   delay_ms: float = 0.0, forwarded: Forwarded | None = None
                   ) -> tuple[torch.Tensor, float, float]:
    """``hidden`` through this peer's span; ``delay_ms`` per layer simulates a slow box.
    Returns the output, the seconds of the forward (a simulated delay counts: it stands
    for compute) and the seconds the call waited for the engine (other calls before it)."""
    slept = 0.0
    if delay_ms and engine.span is not None:
        slept = delay_ms * len(engine.span) / 1000.0
        await asyncio.sleep(slept)
    began = time.monotonic()
    out, seconds = await engine.forward_timed([(g.session, g.start, g.rows) for g in segments], hidden)
    if forwarded is not None:  # the forward's own time: not the queue, nor urgent calls run inside it
        forwarded(hidden.shape[0], seconds)
    return out, seconds + slept, max(0.0, time.monotonic() - began - seconds)


class LocalRunner:
    """The supernode's own span, behind the same interface as a peer link."""

    def __init__(self, engine: StageEngine, *, delay_ms: float = 0.0, forwarded: Forwarded | None = None,
                 node: str = ""):
        self.engine = engine
        self.delay_ms = delay_ms
        self.forwarded = forwarded
        self.node = node  # this peer's id, for the step's times

    @contextlib.contextmanager
    def _of_term(self, term: int):
        """A call on the span of plan ``term``: the engine closed under it, or kept for a
        newer plan (which clears its caches: ``drop_all``) while the call waited or ran, is
        a PeerLost, so the step replays under the new plan. (Seen in the soak: a decode
        step queued behind another when a re-plan kept every span found its session's cache
        gone, and its request failed with a 500.)"""
        epoch = self.engine.epoch
        try:
            yield
        except ModelError as exc:
            if self.engine.closed or self.engine.epoch != epoch:  # a new plan: retry under it
                raise PeerLost(f"the supernode's span of term {term} was replaced by a newer plan") from None
            if isinstance(exc, CacheMissing):  # as a peer's stage answers it (Fail): a new plan, then a replay
                raise StageFailed(f"{self.node or 'this peer'} failed the step: {exc}") from None
            if isinstance(exc, KVFull):  # as a peer's stage answers it (Fail, KV_FULL): the step's sessions end
                raise NoCapacity(f"{self.node or 'this peer'} has no room for the step: {exc}") from None
            raise

    async def forward_batch(self, term: int, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
        began = time.monotonic()
        with self._of_term(term):
            out, seconds, _ = await run_span(self.engine, segments, hidden, delay_ms=self.delay_ms,
                                             forwarded=self.forwarded)
        if (times := STEP_TIMES.get()) is not None:
            times.forward(self.node, time.monotonic() - began, seconds, local=True)
        return out

    def chains(self, engine: StageEngine) -> bool:
        """Whether the pipeline may embed into this span, and take the head after it, in
        the same engine call (``step``): it is ``engine``'s own span, with no simulated delay."""
        return self.engine is engine and not self.delay_ms

    async def step(self, term: int, segments: list[Segment], tokens: list[int] | None = None,
                   hidden: torch.Tensor | None = None, rows: list[int] | None = None,
                   fn: Callable[[torch.Tensor], object] | None = None, score: Score | None = None):
        """``StageEngine.step`` through this span: embed ``tokens`` (or take ``hidden``), the
        span, then the head on ``rows`` and ``fn`` of their logits where given (``score``'s
        rows first)."""
        began = time.monotonic()
        with self._of_term(term):
            out, seconds = await self.engine.step([(g.session, g.start, g.rows) for g in segments], tokens, hidden,
                                                  rows, fn, score)
        if self.forwarded is not None:
            self.forwarded(sum(g.rows for g in segments), seconds)
        if (times := STEP_TIMES.get()) is not None:
            # The rest of the call is the embedding or head in it, and its wait for the engine.
            elapsed = time.monotonic() - began
            times.forward(self.node, seconds, seconds, local=True)
            times.add(SAMPLE, self.node, elapsed - min(seconds, elapsed))
        return out

    async def drop(self, term: int, session: str) -> None:
        self.engine.drop(session)
