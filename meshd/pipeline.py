"""Runs one step of a session through the active plan: embed, every span in
order (local call or a Forward over that peer's link), then the head.

The retry loop here is one of the three places errors are caught: a step that
loses a peer waits for the next plan and replays the session's history through
it, so the caller only ever sees the right next-token logits or NoCapacity.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch

from meshd.errors import NoCapacity, PeerLost
from protocol.messages import Assignment, NodeId

log = structlog.get_logger()

# Prompt rows per Forward: bounds frame size and lets other sessions interleave.
PREFILL_CHUNK = 256


class StageRunner(Protocol):
    """What the pipeline needs from a place that runs a span: the local engine or a peer link."""

    async def forward(self, term: int, session: str, start: int, hidden: torch.Tensor) -> torch.Tensor: ...

    async def drop(self, term: int, session: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ActivePlan:
    term: int
    assignments: tuple[Assignment, ...]
    # node id -> how to reach its span; the supernode's own span is a local runner.
    runners: dict[NodeId, StageRunner]


class Pipeline:
    def __init__(self, head_engine_fn: Callable[[], object], wait_s: float = 30.0):
        # A callable, because the supernode's engine is replaced when its own span changes.
        self._head_engine = head_engine_fn
        self._plan: ActivePlan | None = None
        self._changed = asyncio.Condition()
        self._wait_s = wait_s
        self._unavailable = "no plan is active yet"
        self.replays = 0

    @property
    def plan(self) -> ActivePlan | None:
        return self._plan

    async def set_plan(self, plan: ActivePlan | None, reason: str = "") -> None:
        async with self._changed:
            self._plan = plan
            if plan is None:
                self._unavailable = reason or "the mesh has no active plan"
            self._changed.notify_all()

    async def _wait_plan(self, newer_than: int | None) -> ActivePlan:
        """The active plan, waiting (bounded) for one whose term is above ``newer_than``."""
        deadline = time.monotonic() + self._wait_s

        def ready() -> bool:
            return self._plan is not None and (newer_than is None or self._plan.term > newer_than)

        async with self._changed:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoCapacity(self._unavailable)
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    raise NoCapacity(self._unavailable) from None
            assert self._plan is not None
            return self._plan

    async def next_logits(self, session) -> torch.Tensor:
        """Logits [V] for the token after ``session.tokens``; replays the history
        when the plan changed since the stages last saw this session."""
        failed_term: int | None = None
        while True:
            plan = await self._wait_plan(failed_term)
            start = session.cached if session.term == plan.term else 0
            if start == 0 and session.cached:
                self.replays += 1
                log.info("session_replay", term=plan.term, tokens=len(session.tokens))
            try:
                logits = await self._run(plan, session.id, start, session.tokens[start:])
            except PeerLost as exc:
                log.warning("step_peer_lost", term=plan.term, reason=str(exc))
                failed_term = plan.term
                session.term = None
                continue
            session.cached, session.term = len(session.tokens), plan.term
            return logits

    async def _run(self, plan: ActivePlan, session: str, start: int, tokens: list[int]) -> torch.Tensor:
        engine = self._head_engine()
        hidden_out = None
        for offset in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[offset: offset + PREFILL_CHUNK]
            hidden = await engine.embed(chunk)
            for a in plan.assignments:
                runner = plan.runners.get(a.node)
                if runner is None:
                    raise PeerLost(f"no link to {a.node}")
                hidden = await runner.forward(plan.term, session, start + offset, hidden)
            hidden_out = hidden
        assert hidden_out is not None, "a step needs at least one token"
        logits = await engine.head(hidden_out[-1:])
        return logits[-1]

    async def release(self, session) -> None:
        """Free the session's KV caches on every stage of the plan it ran under."""
        plan = self._plan
        if plan is None:
            return
        for runner in plan.runners.values():
            try:
                await runner.drop(plan.term, session.id)
            except PeerLost:
                pass  # its caches went with it
