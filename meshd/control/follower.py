"""A peer's side of the mesh: follow the supernode's plans (load, and if need be
fetch, the span a plan gives this peer; answer Accept or Reject; activate it on
Commit) and run the supernode's ForwardBatch frames through that span.

Whether a plan may be followed at all, and the term and plan this peer holds,
are the leader's to decide and to write (``Authority``); the files and engines
are the model store's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Protocol

import aiohttp
import structlog

from meshd.config import Config
from meshd.control.mesh import MeshView
from meshd.control.peers import Link
from meshd.control.placement import validate
from meshd.control.runner import Forwarded, LocalRunner, run_span
from meshd.control.store import ModelStore
from meshd.errors import KNOWN_ERRORS, KVFull, PeerLost
from protocol.messages import (Accept, Commit, Fail, FailCode, ForwardBatch, Measured, Message, NodeId, Plan, Reject, RejectCode,
                               ResultBatch)
from shards.engine import DECODE_BATCH, URGENT, StageEngine, measure_layer_ms
from shards.wire import from_wire, to_wire

log = structlog.get_logger()

Spawn = Callable[[Coroutine], object]


class Authority(Protocol):
    """What a follower asks of this peer's leader, the one writer of term and plan."""

    def admit(self, sender: NodeId, plan: Plan) -> Reject | None:
        """None when ``plan`` may be followed (and its term is now held), else the Reject to send."""

    def follow(self, plan: Plan, engine: StageEngine | None, reason: str) -> None:
        """Make a committed plan this peer's active plan, with ``engine`` for its part."""


async def _reply(link: Link, msg: Message) -> None:
    with contextlib.suppress(PeerLost):
        await link.send(msg)


class Follower:
    def __init__(self, config: Config, view: MeshView, store: ModelStore, authority: Authority, spawn: Spawn,
                 forwarded: Forwarded | None = None):
        self.config = config
        self.view = view
        self.store = store
        self.authority = authority
        self.spawn = spawn
        self.forwarded = forwarded
        self.pending: Plan | None = None  # the latest plan received, while it loads
        self.prepared: tuple[Plan, StageEngine | None] | None = None  # loaded, awaiting Commit
        self._timed: Measured | None = None  # its real layer, timed after a load (see _timing)
        # Commits read before their Plan's task ran (a peer with no span gets both at once, and
        # the read loop settles a Commit inline while a Plan waits for its task): the latest
        # term each linked peer committed.
        self._early_commits: dict[NodeId, int] = {}

    def runner(self, engine: StageEngine) -> LocalRunner:
        """This peer's span for its own supernode's pipeline."""
        return LocalRunner(engine, delay_ms=self.config.debug_layer_delay_ms, forwarded=self.forwarded,
                           node=self.view.node_id)

    # -- plans ---------------------------------------------------------------------------

    async def on_plan(self, link: Link, plan: Plan) -> None:
        if (refusal := self.authority.admit(link.peer_id, plan)) is not None:
            await _reply(link, refusal)
            return
        self.pending = plan
        mine = next((a.span for a in plan.assignments if a.node == self.view.node_id), None)
        log.info("plan_received", term=plan.term, supernode=link.peer_id, span=str(mine) if mine else None)
        engine = None
        if mine is not None:
            try:
                manifest, model_dir = await self.store.prepare(plan.model, plan.sources, plan.manifest_digest)
                validate(plan.assignments, manifest.n_layers)
                engine = await self.store.load(manifest, model_dir, mine, embed=False, head=False,
                                               sources=plan.sources)
            except (*KNOWN_ERRORS, OSError, aiohttp.ClientError) as exc:
                log.warning("plan_load_failed", term=plan.term, error=str(exc))
                await _reply(link, Reject(plan.term, f"cannot load {mine}: {exc}", self.view.caps.mem_budget,
                                          code=RejectCode.CANNOT_LOAD))
                return
        if self.pending is not plan:
            return  # a newer plan came while this one loaded
        self.prepared = (plan, engine)
        if self._early_commits.get(link.peer_id) == plan.term:
            self.on_commit(link, Commit(plan.term))
        if mine is not None:
            await _reply(link, Accept(plan.term, mine, await self._timing(plan.model, engine)))

    async def _timing(self, model: str, engine: StageEngine | None) -> Measured:
        """Its span's real layer timed, once per model, where its Hello carried no timing of
        ``model`` (it had no weights then): the supernode may rebalance on it."""
        if engine is None or engine.span is None or self.view.caps.measured.has_layers(model):
            return Measured()
        if self._timed is None or self._timed.model != model:
            layer, batch = await asyncio.to_thread(
                lambda: (measure_layer_ms(engine, budget_s=0.15),
                         measure_layer_ms(engine, budget_s=0.15, batch=DECODE_BATCH)))
            delay = self.config.debug_layer_delay_ms
            self._timed = Measured(model, round(layer + delay, 4), round(batch + delay, 4), batch=DECODE_BATCH)
            log.info("span_measured", model=model, layer_ms=self._timed.layer_ms,
                     layer_ms_batch=self._timed.layer_ms_batch, batch=DECODE_BATCH)
        return self._timed

    def on_commit(self, link: Link, commit: Commit) -> None:
        prepared = self.prepared
        if prepared is None or prepared[0].term != commit.term or prepared[0].supernode != link.peer_id:
            if prepared is None or prepared[0].term < commit.term:
                # Its plan may not have been read yet: it is followed once prepared (on_plan).
                self._early_commits[link.peer_id] = commit.term
                log.info("commit_before_plan", term=commit.term, peer=link.peer_id)
            else:
                log.warning("commit_ignored", term=commit.term, peer=link.peer_id)
            return
        self.prepared = None
        self._early_commits.clear()
        plan, engine = prepared
        self.authority.follow(plan, engine, reason=f"plan of supernode {link.peer_id}")
        log.info("plan_active", term=commit.term, supernode=link.peer_id)
        self.spawn(self.store.replicate())

    # -- forwarding ----------------------------------------------------------------------

    async def serve_forward(self, link: Link, msg: ForwardBatch) -> None:
        """Run a ForwardBatch through this peer's span; answer ResultBatch, or Fail."""
        plan, engine = self.view.plan, self.store.engine
        if plan is None or msg.term != plan.term or link.peer_id != plan.supernode or engine is None:
            log.warning("stale_frame_dropped", peer=link.peer_id, term=msg.term, mine=plan.term if plan else None)
            await _reply(link, Fail(msg.term, msg.req, f"stale or unknown term {msg.term}"))
            return
        URGENT.set(bool(msg.urgent))  # this task's own context: its engine call goes first if urgent
        try:
            out, seconds, queued = await run_span(engine, list(msg.segments), from_wire(msg.hidden),
                                                  delay_ms=self.config.debug_layer_delay_ms, forwarded=self.forwarded)
        except KNOWN_ERRORS as exc:
            log.warning("forward_failed", sessions=len(msg.segments), error=str(exc))
            code = FailCode.KV_FULL if isinstance(exc, KVFull) else FailCode.OTHER
            await _reply(link, Fail(msg.term, msg.req, str(exc), code))
            return
        # Its share of the step's time goes back with it: the supernode's traces and live figures.
        await _reply(link, ResultBatch(msg.term, msg.req, to_wire(out), seconds=seconds, queued=queued))

    def drop(self, session: str) -> None:
        if self.store.engine is not None:
            self.store.engine.drop(session)
