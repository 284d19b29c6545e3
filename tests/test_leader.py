"""The leader, in process: the election loop and the supernode's negotiation, with its
real model store on the tiny model (it loads its own part), a pipeline that records
the plans it is given, and its peers as stand-in links that answer each Plan the way a
peer would: Accept, or Reject with a code.

What is asserted is what the mesh would show: the plan that becomes active covers every
layer; a peer whose view lags is asked again, a peer at a higher term makes the next plan
go above it, a peer that cannot load is left out; losing an idle peer changes nothing,
losing a stage re-plans at once; a drain ends with a plan without the peer; a mesh too
small for the model says why it cannot serve.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest

from meshd.control.leader import Leader
from meshd.control.mesh import NotServing
from meshd.control.placement import validate
from meshd.control.runner import LocalRunner
from meshd.errors import BadRequest
from protocol.messages import Accept, Commit, Measured, NodeId, Plan, Reject, RejectCode
from shards.manifest import Manifest
from tests.inproc import FakeLink, GiB, Tasks, caps, config, store_for, until, view_with

pytestmark = pytest.mark.timeout(60)


class Pipeline:
    """Records what the leader has it serve."""

    def __init__(self) -> None:
        self.plan = None
        self.served: list[tuple[int, tuple]] = []
        self.suspended: list[str] = []

    async def serve(self, term, assignments, runners) -> None:
        self.plan = SimpleNamespace(term=term, assignments=tuple(assignments), runners=dict(runners))
        self.served.append((term, tuple(assignments)))

    async def suspend(self, reason: str, moved: bool = False) -> None:
        self.plan = None
        self.suspended.append(reason)


class Peer(FakeLink):
    """Answers each Plan with the next scripted reply (then Accept), as a peer would."""

    def __init__(self, peer_id: str, vram: int, *replies: Reject, layer_ms: float = 1.0,
                 measured: Measured = Measured(), mem_budget: int | None = None):
        budget = {} if mem_budget is None else {"mem_budget": mem_budget}
        super().__init__(peer_id, caps(vram=vram, layer_ms=layer_ms, **budget), answer=self._answer)
        self.replies = deque(replies)
        self.measured = measured  # what its Accepts carry: its real layer, timed once loaded
        self.leader: Leader | None = None

    def _answer(self, msg) -> None:
        if isinstance(msg, Plan):
            mine = next((a.span for a in msg.assignments if a.node == self.peer_id), None)
            if mine is None:
                return
            reply = self.replies.popleft() if self.replies else Accept(msg.term, mine, self.measured)
            if isinstance(reply, Reject):
                reply = Reject(msg.term, reply.reason, code=reply.code, held_term=reply.held_term)
            self.leader.on_reply(self.peer_id, reply)


@pytest.fixture
async def mesh(tiny_model_dir, tmp_path):
    tasks = Tasks()
    made = []

    def make(*peers: Peer, my_budget: int = 100 * GiB, my_timing: Measured = Measured(),
             busy=lambda: False, isolated_since=lambda: None, **flags) -> SimpleNamespace:
        # "a" leads (most VRAM) and is slow, so placement gives the peers layers.
        my_caps = replace(caps(vram=64 * GiB, layer_ms=20.0, mem_budget=my_budget), measured=my_timing)
        view = view_with("a", my_caps, *peers)
        cfg = config(tmp_path, tiny_model_dir, replicate=False, drain_timeout_s=5.0, **flags)
        store = store_for(cfg, view, tiny_model_dir)
        pipeline = Pipeline()
        leader = Leader(cfg, view, store, pipeline, spawn=tasks.spawn, local_runner=LocalRunner,
                        use_model=lambda model_dir, manifest: "model", busy=busy, isolated_since=isolated_since)
        for p in peers:
            p.leader = leader
        tasks.spawn(leader.run())
        made.append(store)
        return SimpleNamespace(leader=leader, view=view, pipeline=pipeline, peers={p.peer_id: p for p in peers},
                               n=Manifest.load(tiny_model_dir).n_layers)

    yield make
    await tasks.close()
    for store in made:
        store.close()


async def active(m, term_above: int = 0):
    """The next plan that becomes active above ``term_above``."""
    await until(lambda: m.view.plan is not None and m.view.plan.term > term_above)
    return m.view.plan


def nodes(plan) -> set[str]:
    return {a.node for a in plan.assignments}


async def test_a_plan_covering_every_layer_becomes_active_and_is_committed(mesh):
    m = mesh(Peer("b", 8 * GiB), Peer("c", 4 * GiB))
    m.leader.view_changed("start")
    plan = await active(m)
    validate(plan.assignments, m.n)
    assert nodes(plan) >= {"b", "c"} and plan.term == m.view.term == 1
    assert m.pipeline.served == [(1, plan.assignments)]
    assert set(m.pipeline.plan.runners) == nodes(plan)
    for p in m.peers.values():
        assert p.of(Commit) == [Commit(1)] and p.of(Plan)[-1] == plan
    assert m.view.unavailable is None and [t.term for t in m.view.history] == [1]


async def test_a_lagging_view_is_asked_again_a_higher_term_is_gone_above(mesh):
    lagging = Reject(0, "not my supernode (this peer holds c)", code=RejectCode.NOT_MY_SUPERNODE)
    ahead = Reject(0, "stale term: this peer is at term 7", code=RejectCode.STALE_TERM, held_term=7)
    m = mesh(Peer("b", 8 * GiB, lagging), Peer("c", 4 * GiB, ahead))
    m.leader.view_changed("start")
    plan = await active(m)
    # Neither was left out; the plan that took is above the term "c" named.
    assert nodes(plan) >= {"b", "c"} and plan.term == 8 == m.view.term


async def test_a_peer_that_cannot_load_is_left_out(mesh):
    broken = Reject(0, "cannot load 2:4: disk full", code=RejectCode.CANNOT_LOAD)
    m = mesh(Peer("b", 8 * GiB, broken), Peer("c", 4 * GiB))
    m.leader.view_changed("start")
    plan = await active(m)
    validate(plan.assignments, m.n)
    assert "b" not in nodes(plan) and "c" in nodes(plan) and plan.term == 2


async def test_losing_an_idle_peer_replans_nothing_losing_a_stage_replans_at_once(mesh):
    # "d" is too slow to be worth a span: it stays idle.
    m = mesh(Peer("b", 8 * GiB), Peer("c", 4 * GiB), Peer("d", 1 * GiB, layer_ms=1e6))
    m.leader.view_changed("start")
    plan = await active(m)
    assert "d" not in nodes(plan)
    m.leader.peer_lost(NodeId("d"), "socket closed")
    await m.view.changes.wait_for(lambda: False, 0.3)  # time enough for a (wrong) re-plan
    assert m.view.plan is plan and m.view.term == 1
    lost = m.peers.pop("b")
    del m.view.links["b"]  # as the link keeper does, before it tells the leader
    m.leader.peer_lost(lost.peer_id, "socket closed")
    after = await active(m, term_above=1)
    validate(after.assignments, m.n)
    assert "b" not in nodes(after) and after.term == 2


async def test_a_cut_off_supernode_replans_when_its_peers_are_back_without_deferring_for_its_streams(mesh):
    """Streams are in flight. A new peer's join waits for them (``join_defer_s``, 30 s) so
    that it disturbs none. But when this supernode lost every link at once (its cable) it
    waited instead of re-planning alone, so its plan still names peers it lost: when they
    are back, that plan cannot serve, and every stream (and every follower) waits on the
    next. It comes at once, not after the 30 s the streams would have held it."""
    cut_since: list[float] = []
    # A long heartbeat: the cut-off wait (8 beats) does not end inside the test either.
    m = mesh(Peer("b", 8 * GiB), Peer("c", 4 * GiB), busy=lambda: True,
             isolated_since=lambda: cut_since[0] if cut_since else None, heartbeat_s=10.0)
    assert m.leader.config.join_defer_s >= 30
    m.leader.view_changed("start")
    plan = await active(m)
    assert nodes(plan) >= {"b", "c"}
    # A new peer (no span yet) joins while streams are in flight: deferred.
    newcomer = Peer("e", 1 * GiB, layer_ms=1e6)
    newcomer.leader = m.leader
    m.view.add_link(newcomer)
    m.leader.peer_joined(newcomer.peer_id)
    await m.view.changes.wait_for(lambda: False, 1.0)  # past the settling: a re-plan would be under way
    assert m.view.plan is plan and m.view.term == 1 and not m.leader.negotiating()
    # The cable: every link lost at once. The leader waits for them (no plan alone).
    cut_since.append(time.monotonic())
    for pid in ("b", "c", "e"):
        link = m.view.links[pid]
        m.view.remove_link(link)
        m.leader.peer_lost(NodeId(pid), "missed 3 heartbeats")
    await m.view.changes.wait_for(lambda: False, 0.5)
    assert m.view.plan is plan and m.view.term == 1
    # The cable is back: the plan's peers link again. Re-planned at once, busy or not.
    cut_since.clear()
    for pid in ("b", "c"):
        m.view.add_link(m.peers[pid])
        m.leader.peer_joined(NodeId(pid))
    after = await active(m, term_above=1)  # until()'s 10 s, well inside the 30 s deferral
    validate(after.assignments, m.n)
    assert nodes(after) >= {"b", "c"}


async def test_a_supernode_that_stops_hands_the_lead_on_at_once_alone_it_leads_on(mesh):
    """``step_down`` (the node's stop, after it sent Leaving): the next peer by the election
    rule leads, and the sessions here are suspended to go on there, at once. A supernode
    with no peer left to lead keeps its plan (no new term, no replay) while it drains."""
    alone = mesh()
    alone.leader.view_changed("start")
    plan = await active(alone)
    alone.leader.step_down()
    await alone.view.changes.wait_for(lambda: False, 0.3)  # time enough for a (wrong) re-plan
    assert alone.view.plan is plan and alone.view.is_supernode and not alone.pipeline.suspended

    small = mesh(Peer("b", 8 * GiB, mem_budget=1), my_budget=100 * GiB)
    small.leader.view_changed("start")
    await active(small)
    assert not small.leader.others_can_lead()  # b alone cannot hold the model: the supernode drains leading

    m = mesh(Peer("b", 8 * GiB), Peer("c", 4 * GiB))
    m.leader.view_changed("start")
    await active(m)
    assert m.leader.others_can_lead()
    m.leader.step_down()
    await until(lambda: m.pipeline.suspended)
    assert m.view.supernode == "b" and m.view.elected() == "b" and not m.view.is_supernode
    assert m.pipeline.suspended == ["supernode moved to b"]


async def test_a_peer_that_says_it_is_leaving_is_no_candidate_nor_given_a_span(mesh):
    m = mesh(Peer("b", 8 * GiB), Peer("c", 4 * GiB), Peer("z", 128 * GiB))
    assert m.view.elected() == "z"
    m.view.links["z"].leaving = True  # as its link's read loop marks it
    m.leader.peer_leaving(NodeId("z"))
    assert m.view.elected() == "a"
    m.leader.view_changed("start")
    plan = await active(m)
    assert "z" not in nodes(plan) and {"b", "c"} <= nodes(plan)


async def test_a_drain_returns_once_a_plan_without_the_peer_is_active(mesh):
    m = mesh(Peer("b", 8 * GiB), Peer("c", 4 * GiB))
    m.leader.view_changed("start")
    await active(m)
    answer = await m.leader.drain(NodeId("c"))
    assert answer["drained"] and answer["node"] == "c" and answer["term"] == m.view.plan.term == 2
    assert "c" not in nodes(m.view.plan) and "c" not in {a["node"] for a in answer["plan"]}
    with pytest.raises(BadRequest) as own:
        await m.leader.drain(NodeId("a"))
    assert own.value.status == 409
    with pytest.raises(BadRequest) as unknown:
        await m.leader.drain(NodeId("zz"))
    assert unknown.value.status == 404


async def test_a_mesh_too_small_for_the_model_says_why(mesh):
    m = mesh(Peer("b", 8 * GiB), my_budget=1)
    m.leader.view_changed("start")
    await until(lambda: m.view.unavailable is not None and m.view.unavailable.why is NotServing.NO_ROOM)
    assert m.view.plan is None and m.pipeline.suspended and "short of the head" in str(m.view.unavailable)


async def test_timings_learned_from_the_accepts_rebalance_the_plan_once(mesh, tiny_model_dir):
    """The supernode timed its real layers and head at start; "b" had no weights, so the
    first plan weighs it on its probe (as fast as "a"). Its Accept carries its real layer,
    4x slower: the leader re-plans once, onto a plan balanced on those timings, and no more
    (the same timings again change nothing)."""
    name = Manifest.load(tiny_model_dir).name
    m = mesh(Peer("b", 8 * GiB, layer_ms=20.0, measured=Measured(name, 4.0, 4.0, batch=8)),
             my_timing=Measured(name, 1.0, 1.0, 2.0, 2.0, batch=8))
    m.leader.view_changed("start")
    first = await active(m)
    later = await active(m, term_above=first.term)
    layers = {a.node: len(a.span) for a in later.assignments}
    assert layers["a"] > {a.node: len(a.span) for a in first.assignments}["a"]
    assert layers["a"] > layers.get("b", 0), later.assignments
    assert m.leader.rebalances == 1
    await m.view.changes.wait_for(lambda: False, 0.5)  # time enough for a (wrong) third plan
    assert m.view.plan is later and len(m.pipeline.served) == 2


async def test_a_hop_that_settles_lower_gives_the_idle_peer_layers(mesh):
    """A peer that has just started answers its first ping late (its loop is loading): the
    plan weighed on that hop leaves it idle. Once its round trips settle, a heartbeat weighs
    the plan again and the peer gets a span, which is what two equal peers should share."""
    b = Peer("b", 8 * GiB, layer_ms=20.0)
    b.rtt_ms = 1000.0  # more than the whole model costs "a"
    m = mesh(b)
    m.leader.view_changed("start")
    first = await active(m)
    assert nodes(first) == {"a"}
    m.leader.beat()  # nothing moved: no plan
    b.rtt_ms = 0.3
    m.leader.beat()
    later = await active(m, term_above=first.term)
    assert nodes(later) == {"a", "b"} and m.leader.rebalances == 1
    m.leader.beat()  # settled: no third plan
    await m.view.changes.wait_for(lambda: False, 0.5)
    assert m.view.plan is later
