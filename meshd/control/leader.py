"""The leader: this peer's one authority on who leads the mesh, under which term
and with which plan. It is the only writer of the view's term, supernode, plan,
history, draining and why-not-serving.

- ``run`` is the election loop: a change of view (settled, so that peers starting
  together make one plan; a loss or a drain at once) elects the supernode and, if
  that is this peer, starts a negotiation under a higher term.
- The negotiation: place -> Plan to every peer -> load this peer's part -> wait for
  Accept/Reject -> re-plan until every span is owned -> Commit, then the plan is
  active and the pipeline serves it.
- A follower asks it to ``admit`` a plan (from the peer this one elects, at a term
  no older than its own) and to ``follow`` it once committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog

from meshd.config import Config
from meshd.control.election import accepts_plan, elect, next_term
from meshd.control.mesh import MeshView, NotServing, plan_json
from meshd.control.placement import Candidate, Costs, place, rebalanced, replan, stage_ms
from meshd.control.runner import StageRunner
from meshd.control.store import ModelStore
from meshd.errors import KNOWN_ERRORS, BadRequest, NoCapacity, PeerLost
from protocol.messages import Accept, Assignment, Commit, Digest, ModelName, NodeId, Plan, Reject, RejectCode
from shards.engine import StageEngine
from shards.manifest import Manifest

log = structlog.get_logger()

NOT_MY_SUPERNODE = "not my supernode"
# A peer whose view has not caught up rejects with NOT_MY_SUPERNODE; wait and ask again.
# (A peer at a higher term names it, and is asked again above it at once.)
# The waits double from VIEW_RETRY_FIRST_S up to settle_s: a closed socket reaches every
# peer within milliseconds, a heartbeat loss within a beat or two (5.5 s in all at 1 s).
VIEW_RETRIES = 8
# A peer that lost every link at once waits this many heartbeats for them before it leads alone.
ISOLATION_WAIT_BEATS = 8
VIEW_RETRY_FIRST_S = 0.1
# Re-plans for timings learned after a plan (a peer that fetched the weights timed its real
# layers only then): each needs new timings and a clear gain (placement.REBALANCE_MARGIN),
# and this bounds them for the life of this peer, so a noisy box cannot keep the mesh re-planning.
MAX_REBALANCES = 2
# The links' round trip (the hop a span off the supernode pays) may move this far from the
# one a plan was weighed on before the plan is weighed again (bounded by MAX_REBALANCES too).
HOP_SLACK_MS = 0.5
HOP_SLACK = 0.5
# A plan is weighed on a link's round trip only once it has this many (pinged this far apart).
RTT_SAMPLES_TO_PLAN = 3
PING_GAP_S = 0.05


class PlanSink(Protocol):
    """The supernode's pipeline, as the leader drives it."""

    @property
    def plan(self) -> object | None: ...  # the plan steps run under now, None while there is none

    async def serve(self, term: int, assignments: Sequence[Assignment], runners: Mapping[NodeId, StageRunner]
                    ) -> None: ...

    async def suspend(self, reason: str, moved: bool = False) -> None: ...


class Leader:
    def __init__(self, config: Config, view: MeshView, store: ModelStore, pipeline: PlanSink, *,
                 spawn: Callable[[Coroutine], asyncio.Task], local_runner: Callable[[StageEngine], StageRunner],
                 use_model: Callable[[Path, Manifest], str], busy: Callable[[], bool],
                 isolated_since: Callable[[], float | None] = lambda: None):
        self.config = config
        self.view = view
        self.store = store
        self.pipeline = pipeline
        self.spawn = spawn
        self.local_runner = local_runner  # this peer's span behind the pipeline's interface
        self.use_model = use_model  # the supernode's parts that do not split (tokenizer, KV budget): its chat template
        self.busy = busy  # whether streams are in flight on this peer
        self.isolated_since = isolated_since  # when every link was lost at once (monotonic), or None
        self._isolation_check: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._urgent = False  # a loss or a drain waits on the next plan: no settling
        self._reason = "start"
        self._lead_task: asyncio.Task | None = None
        self._replies: dict[NodeId, asyncio.Future] = {}  # Accept/Reject per assigned peer
        self._replies_term = 0  # the term of the plan those replies answer
        self._learned = False  # a peer sent new timings since the last rebalance check
        self.rebalances = 0
        self._weighed_on: tuple[Manifest, float] | None = None  # the active plan's model and hop_ms
        self._members_lost: set[NodeId] = set()  # peers of the active plan lost and not back yet
        self._member_back = False  # one of them came back: the next re-plan is not deferred

    # -- the election loop ---------------------------------------------------------------

    def view_changed(self, reason: str, urgent: bool = False) -> None:
        """Something the plan depends on changed; ``urgent`` skips the settling
        (a loss or a drain: requests are waiting on the re-plan)."""
        self._reason = reason
        self._urgent = self._urgent or urgent
        self._changed.set()
        if urgent:
            self.view.changes.pulse()  # a join deferred for the streams in flight waits no longer

    async def run(self) -> None:
        while True:
            await self._changed.wait()
            # Settle: peers that start together should produce one plan, not one
            # each. A loss skips it: requests in flight are waiting on the re-plan.
            while not self._urgent:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), self.config.settle_s)
                except TimeoutError:
                    break
            urgent, self._urgent = self._urgent, False
            # An urgent change skips the settling loop, which is what clears the
            # event: left set, it made a second re-plan (and replay) 1 s later.
            self._changed.clear()
            if not urgent:
                await self._defer_join()
                if self._urgent:  # a loss came while waiting: this re-plan covers it too
                    self._urgent = False
                    self._changed.clear()
            self._member_back = False
            self._reelect()

    async def _defer_join(self) -> None:
        """A join re-plans only once the streams in flight are done (within
        ``join_defer_s``), so a peer that comes back disturbs none of them; the
        supernode stays the same, or a loss arrives meanwhile, or time runs out. Not
        when a peer of the active plan came back (``peer_joined``), nor while no plan is
        active here (a supernode just elected, its streams handed on to it): those streams
        cannot go on until the re-plan."""
        if not self.view.is_supernode or self.view.elected() != self.view.node_id:
            return
        if self.pipeline.plan is None:  # nothing runs to be disturbed: the streams wait for a plan
            return
        await self.view.changes.wait_for(lambda: not self.busy() or self._urgent or self._member_back,
                                         self.config.join_defer_s)

    def _isolated_wait(self) -> float:
        """Seconds left to wait before leading alone: a peer that lost every link at once is
        most likely the one cut off (its cable, its stall); it waits for them to answer
        again rather than split the mesh, and leads alone only if none does in time."""
        since = self.isolated_since()
        if since is None or self.view.links:
            return 0.0
        return max(0.0, since + ISOLATION_WAIT_BEATS * self.config.heartbeat_s - time.monotonic())

    def _reelect(self) -> None:
        winner = self.view.elected()
        if winner == self.view.node_id and (wait := self._isolated_wait()) > 0:
            log.warning("isolated_waits", seconds=round(wait, 1), supernode=self.view.supernode)
            if self._isolation_check is None or self._isolation_check.done():
                self._isolation_check = self.spawn(self._recheck_after(wait))
            self.view.set_unavailable(NotServing.WAITING_FOR_PLAN, "cut off from every peer: waiting for them")
            return
        self._stop_negotiating()
        if winner == self.view.node_id:
            if not self.view.is_supernode:  # the reason a 503 gives is this peer's, not the old supernode's
                self.view.set_unavailable(NotServing.PLANNING, "this peer took over as supernode and is planning")
            self.view.set_supernode(winner)
            self._lead_task = self.spawn(self._lead(self._reason))
        else:
            if self.view.is_supernode:
                self._yield_to(winner)
            self.view.set_supernode(winner)
            self.view.set_unavailable(NotServing.WAITING_FOR_PLAN, f"waiting for a plan from {winner}")

    def _stop_negotiating(self) -> None:
        if (task := self._lead_task) is not None and not task.done():
            task.cancel()

    def _yield_to(self, winner: NodeId) -> None:
        """This supernode gives the lead to ``winner``: a negotiation of its own still
        running stops (it would put its plan back), and the sessions running here go on at
        the new supernode at once (the entry peers resubmit theirs, the API hands on its
        own), not after a timeout."""
        self._stop_negotiating()
        log.info("supernode_yields", to=winner)
        self.spawn(self.pipeline.suspend(f"supernode moved to {winner}", moved=True))

    async def _recheck_after(self, wait: float) -> None:
        await asyncio.sleep(wait + 0.05)
        self.view_changed("no peer answered while cut off", urgent=True)

    def negotiating(self) -> bool:
        return self._lead_task is not None and not self._lead_task.done()

    # -- peers coming and going ----------------------------------------------------------

    def peer_joined(self, peer: NodeId) -> None:
        self.view.draining.discard(peer)  # a peer that comes back is no longer drained
        if peer in self._members_lost and self.view.in_plan(peer):
            # Lost while in the active plan, and back before any plan without it (this
            # supernode was the one cut off, and waited: _isolated_wait). That plan does
            # not serve as it stands: the streams in flight wait on the next one, so the
            # join is not deferred for them (it held them, and every follower, 30 s).
            self._member_back = True
            self.view.changes.pulse()
        self._members_lost.discard(peer)
        self.view_changed(f"peer {peer} joined")

    def peer_leaving(self, peer: NodeId) -> None:
        """A peer said it is stopping (``Leaving``): it is no candidate any more. Where it
        leads, the election moves on now, while it is still linked to hand its sessions
        on, not a heartbeat bound after it is gone. A stage hands its own span away (a
        drain it asks for), so only the plan's next change leaves it out."""
        if peer == self.view.supernode:
            self.view_changed(f"supernode {peer} is stopping", urgent=True)

    def step_down(self) -> None:
        """This peer is stopping (it sent Leaving): where it leads, the election moves on
        without it."""
        self.view.leaving = True
        if self.view.is_supernode and self.view.elected() != self.view.node_id:  # else it leads on, alone
            self.view_changed("this supernode is stopping", urgent=True)

    def others_can_lead(self) -> bool:
        """Whether the peers left once this one stops could hold its model, led by the one
        they would elect. Where they cannot, a stopping supernode leads on while it drains
        (the mesh cannot serve without it anyway): its streams finish rather than move to a
        supernode that has no plan to run them."""
        manifest, view = self.store.manifest, self.view
        if manifest is None:
            return False
        out = view.draining | view.leaving_peers() | {view.node_id}
        peers = [c for c in view.candidates_for(manifest.name) if c.node_id not in out]
        if not peers:
            return False
        try:
            place(peers, Costs.of_model(manifest, elect(peers), 1.0, view.hop_ms()))
        except NoCapacity:
            return False
        return True

    def peer_lost(self, peer: NodeId, reason: str) -> None:
        if self.view.in_plan(peer):
            self._members_lost.add(peer)
        # A peer with no span (idle, or drained before it stopped) that is not the
        # supernode leaves the plan and the election as they are: re-planning would
        # only bump the term and replay every stream. Unless a negotiation waits on it.
        if (self.view.plan is not None and not self.negotiating() and peer != self.view.supernode
                and not self.view.in_plan(peer)):
            return
        self.view_changed(f"peer {peer} lost: {reason}", urgent=True)

    # -- the supernode's negotiation -------------------------------------------------------

    async def _cannot_serve(self, why: NotServing, detail: str) -> None:
        self.view.set_unavailable(why, detail)
        await self.pipeline.suspend(detail)

    async def _lead(self, reason: str = "") -> None:
        t0 = time.monotonic()
        view, store = self.view, self.store
        try:
            manifest, model_dir = await store.prepare(store.model_name, sources=store.sources())
        except KNOWN_ERRORS as exc:
            log.error("supernode_no_model", error=str(exc))
            await self._cannot_serve(NotServing.NO_MODEL, f"the supernode has no model: {exc}")
            return
        try:
            chat_template = self.use_model(model_dir, manifest)
        except KNOWN_ERRORS as exc:  # its tokenizer does not load: no plan can serve
            log.error("supernode_no_model", error=str(exc))
            await self._cannot_serve(NotServing.NO_MODEL, f"the supernode cannot use the model: {exc}")
            return
        await self._sample_round_trips()
        excluded: dict[NodeId, str] = {}
        view_retries = 0
        while True:
            term = next_term(view.term)
            view.hold_term(term)
            candidates, costs = self._weighed(manifest, excluded)
            alive = {c.node_id for c in candidates}
            try:
                if view.plan is not None:
                    assignments = replan(view.plan.assignments, alive, candidates, costs)
                else:
                    assignments = place(candidates, costs)
            except NoCapacity as exc:
                log.error("plan_impossible", term=term, reason=str(exc))
                await self._cannot_serve(NotServing.NO_ROOM, str(exc))
                return
            log.info("planning", term=term, reason=reason)
            plan = Plan(term, view.node_id, ModelName(manifest.name), Digest(manifest.digest), assignments,
                        sources=store.sources(), chat_template=chat_template)
            log.info("plan_proposed", term=term, plan=" ".join(f"{a.node}={a.span}" for a in assignments),
                     stage_ms=" ".join(f"{ms:.2f}" for ms in stage_ms(assignments, candidates, costs)),
                     head_ms=round(costs.head_ms, 2), hop_ms=round(costs.hop_ms, 2))
            self._replies_term = term  # replies are matched by it
            self._replies = {a.node: asyncio.get_running_loop().create_future()
                             for a in assignments if a.node != view.node_id}
            for link in list(view.links.values()):
                with contextlib.suppress(PeerLost):
                    await link.send(plan)
            mine = next((a.span for a in assignments if a.node == view.node_id), None)
            try:
                engine = await store.load(manifest, model_dir, mine, embed=True, head=True, sources=plan.sources)
            except KNOWN_ERRORS as exc:
                log.error("supernode_load_failed", error=str(exc))
                await self._cannot_serve(NotServing.LOAD_FAILED, f"the supernode cannot load its part: {exc}")
                return
            replies = await self._collect(self.config.accept_timeout_s)
            rejects = {n: r for n, r in replies.items() if not isinstance(r, Accept)}
            if not rejects:
                break
            store.discard(engine)
            for n, r in rejects.items():
                log.warning("plan_rejected", term=term, peer=n, reason=r.reason)
            # A stale term (this supernode restarted, its term began again at 0) is
            # retried too, above the term the peer named: excluding the peer would
            # leave the restarted supernode planning alone.
            behind = [r for r in rejects.values() if r.code is RejectCode.NOT_MY_SUPERNODE]
            stale = [r for r in rejects.values() if r.code is RejectCode.STALE_TERM]
            if len(behind) + len(stale) == len(rejects) and view_retries < VIEW_RETRIES:
                view_retries += 1
                if behind:
                    await asyncio.sleep(min(self.config.settle_s, VIEW_RETRY_FIRST_S * 2 ** (view_retries - 1)))
            else:
                excluded.update({n: r.reason for n, r in rejects.items()})

        if view.is_supernode:
            for link in list(view.links.values()):
                with contextlib.suppress(PeerLost):
                    await link.send(Commit(term))
        if not view.is_supernode:
            # While this plan loaded (or its Commits went out), this peer accepted the plan
            # of the peer it now elects (it led alone while cut off, and rejoined; or that
            # peer joined): activating this one would put it on a term of its own,
            # refusing the mesh's frames for good.
            log.info("plan_abandoned", term=term, supernode=view.supernode)
            store.discard(engine)
            return
        store.use(engine)
        runners = {a.node: (self.local_runner(engine) if a.node == view.node_id else view.links[a.node])
                   for a in assignments}
        await self.pipeline.serve(term, assignments, runners)
        view.activate(plan, reason)  # after the pipeline serves it: a drain waiting on it may stop the peer
        view.clear_unavailable()
        self.spawn(store.replicate())
        log.info("plan_active", term=term, seconds=round(time.monotonic() - t0, 2),
                 plan=" ".join(f"{a.node}={a.span}" for a in assignments))
        self._weighed_on = (manifest, costs.hop_ms)
        self._check_balance(manifest, assignments)

    async def _sample_round_trips(self) -> None:
        """Ping a link with few round trips yet (a peer that has just joined) a few times
        before planning: its first Pong may have waited behind the peer's start, and a plan
        weighed on that one figure can leave the peer without a span."""
        for _ in range(RTT_SAMPLES_TO_PLAN):
            fresh = [link for link in self.view.live_links().values() if link.rtt_samples < RTT_SAMPLES_TO_PLAN]
            if not fresh:
                return
            for link in fresh:
                with contextlib.suppress(PeerLost):
                    await link.call_ping()
            await asyncio.sleep(PING_GAP_S)

    def beat(self) -> None:
        """Each heartbeat: weigh the active plan again when a peer has no span and the links'
        round trips settled far from the one the plan was made on. A peer that has just started
        answers its first pings late (its loop is busy loading): a plan weighed on that hop can
        leave it idle for good. (Peers that all hold spans keep them: a re-plan costs a load
        and a replay, and the timings learned from the Accepts rebalance those.)"""
        view = self.view
        if self._weighed_on is None or view.plan is None or not view.is_supernode or self.negotiating():
            return
        if all(view.in_plan(pid) or pid in view.draining for pid in view.live_links()):
            return
        manifest, hop = self._weighed_on
        now = view.hop_ms()
        if abs(now - hop) <= max(HOP_SLACK_MS, HOP_SLACK * hop):
            return
        log.info("hop_settled", planned_ms=round(hop, 3), now_ms=round(now, 3))
        self._weighed_on = (manifest, now)
        self._rebalance(manifest, view.plan.assignments)

    def _weighed(self, manifest: Manifest, excluded: Mapping[NodeId, str] | None = None
                 ) -> tuple[list[Candidate], Costs]:
        """The peers a plan may use (not excluded, not draining, not stopping), weighed on what
        this model's real parts cost them where they timed them, and the supernode's costs."""
        view = self.view
        out = set(excluded or {}) | view.draining | view.leaving_peers()
        candidates = [c for c in view.candidates_for(manifest.name) if c.node_id not in out]
        me = next(c for c in candidates if c.node_id == view.node_id)
        return candidates, Costs.of_model(manifest, view.node_id, me.layer_ms, view.hop_ms(), view.caps.measured)

    def _check_balance(self, manifest: Manifest, assignments: Sequence[Assignment]) -> None:
        """Re-plan once more when timings the peers sent with their Accepts show that a fresh
        plan's slowest stage beats this one's by a clear margin (see MAX_REBALANCES)."""
        if not self._learned:
            return
        self._learned = False
        self._rebalance(manifest, assignments)

    def _rebalance(self, manifest: Manifest, assignments: Sequence[Assignment]) -> None:
        """Re-plan when a fresh plan's slowest stage, on the timings known now, beats this
        one's by a clear margin, at most MAX_REBALANCES times."""
        if self.rebalances >= MAX_REBALANCES:
            return
        candidates, costs = self._weighed(manifest)
        fresh = rebalanced(assignments, candidates, costs)
        if fresh is None:
            return
        self.rebalances += 1
        before = " ".join(f"{ms:.2f}" for ms in stage_ms(assignments, candidates, costs))
        after = " ".join(f"{ms:.2f}" for ms in stage_ms(fresh, candidates, costs))
        log.info("plan_rebalance", stage_ms=before, fresh_stage_ms=after, rebalances=self.rebalances)
        self.view_changed(f"rebalance on measured stage times ({before} -> {after} ms)")

    async def _collect(self, timeout: float) -> dict[NodeId, Accept | Reject]:
        """Each assigned peer's Accept or Reject; a peer that says nothing in time, or
        whose link drops, counts as a Reject."""
        futures = self._replies
        if futures:
            await asyncio.wait(futures.values(), timeout=timeout)
        out: dict[NodeId, Accept | Reject] = {}
        for peer, future in futures.items():
            link = self.view.links.get(peer)
            if future.done():
                out[peer] = future.result()
            elif link is None or not link.alive:
                out[peer] = Reject(self._replies_term, "link lost during negotiation")
            else:
                out[peer] = Reject(self._replies_term, f"no answer in {timeout:.0f} s")
        self._replies = {}
        return out

    def on_reply(self, sender: NodeId, msg: Accept | Reject) -> None:
        future = self._replies.get(sender)
        if future is None or future.done() or msg.term != self._replies_term:
            log.debug("reply_ignored", peer=sender, term=msg.term)
            return  # only a peer asked in this negotiation moves the term (the codec bounds it)
        if isinstance(msg, Reject) and msg.code is RejectCode.STALE_TERM:
            self.view.hold_term(msg.held_term)  # the next plan goes above it
        if isinstance(msg, Accept) and msg.measured.model and self.view.measured.get(sender) != msg.measured:
            self.view.measured[sender] = msg.measured  # bounded by the codec: finite, 0..MAX_LAYER_MS
            self._learned = True
        future.set_result(msg)

    # -- for a follower --------------------------------------------------------------------

    def admit(self, sender: NodeId, plan: Plan) -> Reject | None:
        """Whether to follow ``plan`` from ``sender``: None, and its term is held, when
        it comes from the peer this one elects at a term no older than its own."""
        expected = self.view.elected()
        if plan.supernode != sender or not accepts_plan(expected, plan.term, sender, plan.term):
            return Reject(plan.term, f"{NOT_MY_SUPERNODE} (this peer holds {expected})",
                          code=RejectCode.NOT_MY_SUPERNODE)
        if not accepts_plan(expected, self.view.term, sender, plan.term):
            return Reject(plan.term, f"stale term: this peer is at term {self.view.term}",
                          code=RejectCode.STALE_TERM, held_term=self.view.term)
        self.view.hold_term(plan.term)
        if self.view.is_supernode and sender != self.view.node_id:
            # The plan of the peer it elects can come before this peer's own re-election
            # (a join settles first): its steps would wait on a plan of its own that never comes.
            self._yield_to(sender)
        self.view.set_supernode(sender)
        return None

    def follow(self, plan: Plan, engine: StageEngine | None, reason: str) -> None:
        self.store.use(engine)
        self.view.activate(plan, reason)

    # -- drain -----------------------------------------------------------------------------

    async def drain(self, peer: NodeId) -> dict:
        """Supernode: move ``peer``'s span to the others, and return once a plan
        without it is active (a planned shutdown then loses no time)."""
        view = self.view
        if peer == view.node_id:
            raise BadRequest("the supernode cannot be drained: stop it and the next peer takes over", 409)
        if peer not in view.links:
            raise BadRequest(f"no peer {peer} in this mesh", 404, param="node")
        view.draining.add(peer)
        self.view_changed(f"drain {peer}", urgent=True)

        def moved() -> bool:
            return view.plan is not None and not view.in_plan(peer)

        def no_room() -> bool:
            return view.unavailable is not None and view.unavailable.why is NotServing.NO_ROOM

        await view.changes.wait_for(lambda: moved() or no_room(), self.config.drain_timeout_s)
        if moved() and (plan := view.plan) is not None:  # (moved: there is a plan)
            return {"node": peer, "drained": True, "term": plan.term, "plan": plan_json(plan.assignments)}
        view.draining.discard(peer)
        self.view_changed(f"drain of {peer} undone")
        raise NoCapacity(f"could not move {peer}'s span away: {view.unavailable or 'timed out'}")
