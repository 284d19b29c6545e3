"""A peer's side of a plan, in process: the follower with this peer's real leader (who
may be followed, and the term held), its real model store on the tiny model, and the
supernode a stand-in link that records what the follower answers.

A plan from the peer it elects is loaded, accepted and, on Commit, followed; the span
then answers ForwardBatch frames exactly as the engine run directly does. A plan from
another peer, of an older term, or that cannot load is rejected with the code the
supernode acts on; frames of another term get Fail; a step on an engine a newer plan
closed is a Fail or a retry, never an error that ends the node.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from meshd.control.follower import Follower
from meshd.control.leader import Leader
from meshd.control.runner import LocalRunner
from meshd.control.store import STAGE_KV_SHARE
from meshd.errors import ModelError, NoCapacity, PeerLost
from protocol.messages import (
    Accept,
    Assignment,
    Commit,
    Fail,
    FailCode,
    ForwardBatch,
    NodeId,
    Plan,
    Reject,
    RejectCode,
    ResultBatch,
    Segment,
    SessionId,
)
from shards.engine import StageEngine
from shards.layers import KVCache
from shards.manifest import Manifest
from shards.span import Span
from shards.wire import from_wire, to_wire
from tests.inproc import FakeLink, GiB, Tasks, caps, config, store_for, view_with

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def peer(tiny_model_dir, tmp_path):
    """Peer "b" following supernode "a" (more VRAM), with "c" (less) also linked."""
    sup = FakeLink("a", caps(vram=8 * GiB))
    other = FakeLink("c", caps(vram=1 * GiB))
    view = view_with("b", caps(vram=4 * GiB, mem_budget=3 * GiB), sup, other)
    cfg = config(tmp_path, tiny_model_dir)
    store = store_for(cfg, view, tiny_model_dir)
    tasks = Tasks()
    leader = Leader(cfg, view, store, pipeline=None, spawn=tasks.spawn, local_runner=None,
                    use_model=None, busy=lambda: False)
    follower = Follower(cfg, view, store, leader, tasks.spawn)
    yield SimpleNamespace(follower=follower, view=view, store=store, sup=sup, other=other,
                          manifest=Manifest.load(tiny_model_dir))
    await tasks.close()
    store.close()


def plan(m: Manifest, term: int, sender: str = "a", split: int = 2) -> Plan:
    n = m.n_layers
    return Plan(term, NodeId(sender), m.name, m.digest,
                (Assignment(NodeId(sender), Span(0, split)), Assignment(NodeId("b"), Span(split, n))))


async def test_a_plan_from_its_supernode_is_loaded_accepted_and_followed_on_commit(peer):
    m, n = peer.manifest, peer.manifest.n_layers
    p = plan(m, term=3)
    await peer.follower.on_plan(peer.sup, p)
    [accept] = peer.sup.of(Accept)
    assert (accept.term, accept.span) == (3, Span(2, n))
    # Its Hello timed no model (it had none): it times its real layer once loaded, for the
    # supernode to weigh the plan on.
    assert accept.measured.has_layers(m.name) and not accept.measured.has_head(m.name)
    assert peer.view.term == 3 and peer.view.supernode == "a"
    assert peer.view.plan is None and peer.store.engine is None, "active before Commit"

    peer.follower.on_commit(peer.sup, Commit(3))
    assert peer.view.plan == p and peer.store.engine.span == Span(2, n)
    assert [t.term for t in peer.view.history] == [3]

    # Its span answers what the engine run directly answers.
    hidden = torch.randn(5, m.config.hidden_size)
    await peer.follower.serve_forward(peer.sup, ForwardBatch(3, 7, (Segment(SessionId("s"), 0, 5),), to_wire(hidden)))
    (reply,) = peer.sup.of(ResultBatch)
    direct = await asyncio.to_thread(StageEngine.load, peer.store.model_dir,
                                     Span(2, n), False, False, "cpu", "float32")
    try:
        want = await direct.forward_batch([("s", 0, 5)], hidden)
    finally:
        direct.close()
    assert reply.req == 7 and torch.equal(from_wire(reply.hidden), want)


async def test_plans_it_must_not_follow_are_rejected_with_the_code_to_act_on(peer):
    m = peer.manifest
    # From a peer it does not elect: its view lags (or the sender's does).
    await peer.follower.on_plan(peer.other, plan(m, term=9, sender="c"))
    (r,) = peer.other.of(Reject)
    assert r.code is RejectCode.NOT_MY_SUPERNODE and "not my supernode" in r.reason and r.term == 9
    assert peer.view.term == 0
    # From its supernode, but older than the term it holds: it names its term.
    await peer.follower.on_plan(peer.sup, plan(m, term=5))
    await peer.follower.on_plan(peer.sup, plan(m, term=4))
    (stale,) = peer.sup.of(Reject)
    assert stale.code is RejectCode.STALE_TERM and stale.held_term == 5 and stale.term == 4
    assert peer.view.term == 5
    # A model this peer has not, and no peer offers: it cannot load its span.
    missing = Plan(6, NodeId("a"), "no-such-model", "0" * 64, plan(m, 6).assignments)
    await peer.follower.on_plan(peer.sup, missing)
    cannot = peer.sup.of(Reject)[-1]
    assert cannot.code is RejectCode.CANNOT_LOAD and cannot.capacity == 3 * GiB, cannot


async def test_a_commit_read_before_its_plan_is_followed_once_the_plan_is_prepared(peer):
    """A peer the plan gives no span gets Plan and Commit at once; the read loop settles the
    Commit inline while the Plan waits for its task, so the Commit can come first. The plan
    is followed all the same (it used to be ignored, and the peer never served)."""
    m = peer.manifest
    p = Plan(3, NodeId("a"), m.name, m.digest, (Assignment(NodeId("a"), Span(0, m.n_layers)),))
    peer.follower.on_commit(peer.sup, Commit(3))
    peer.follower.on_commit(peer.other, Commit(3))  # not from its supernode: never followed
    assert peer.view.plan is None
    await peer.follower.on_plan(peer.sup, p)
    assert peer.view.plan == p and peer.view.supernode == "a" and peer.store.engine is None
    assert not peer.sup.of(Accept)  # no span, nothing to accept


async def test_a_commit_or_a_frame_of_another_term_changes_nothing(peer):
    m = peer.manifest
    await peer.follower.on_plan(peer.sup, plan(m, term=3))
    peer.follower.on_commit(peer.sup, Commit(2))  # not the plan it prepared
    peer.follower.on_commit(peer.other, Commit(3))  # not from its supernode
    assert peer.view.plan is None
    peer.follower.on_commit(peer.sup, Commit(3))
    hidden = torch.randn(1, m.config.hidden_size)
    for term in (2, 4):
        await peer.follower.serve_forward(peer.sup, ForwardBatch(term, term, (Segment(SessionId("s"), 0, 1),),
                                                                 to_wire(hidden)))
    assert [(f.term, f.req) for f in peer.sup.of(Fail)] == [(2, 2), (4, 4)]
    assert not peer.sup.of(ResultBatch) and peer.store.engine.sessions == 0


async def test_a_step_on_a_replaced_engine_is_retried_not_fatal(tiny_model_dir):
    """A re-plan closes the old engine while a step may still be on its way to it (after a
    debug delay, or queued behind the event loop). That call is an error meshd catches,
    never a bare RuntimeError that would end the node's TaskGroup: on the supernode's own
    span it is PeerLost (the pipeline retries under the new plan), on a stage it is a Fail."""
    n = Manifest.load(tiny_model_dir).n_layers
    engine = await asyncio.to_thread(StageEngine.load, tiny_model_dir, Span(0, n), False, False, "cpu", "float32")
    hidden = torch.randn(2, engine.config.hidden_size)
    segments = [Segment(SessionId("s"), 0, 2)]
    runner = LocalRunner(engine)
    assert tuple((await runner.forward_batch(1, segments, hidden)).shape) == (2, engine.config.hidden_size)
    engine.close()
    assert engine.closed
    with pytest.raises(ModelError, match="closed"):
        await engine.forward_batch([("s", 0, 2)], hidden)
    with pytest.raises(PeerLost, match="replaced"):
        await runner.forward_batch(1, segments, hidden)

    sent = []
    link = SimpleNamespace(peer_id="sup", send=lambda msg: asyncio.sleep(0, sent.append(msg)))
    p = Plan(1, NodeId("sup"), "m", "0" * 64, (Assignment(NodeId("me"), Span(0, n)),))
    follower = Follower(SimpleNamespace(debug_layer_delay_ms=0.0), SimpleNamespace(plan=p),
                        SimpleNamespace(engine=engine), authority=None, spawn=None)
    await follower.serve_forward(link, ForwardBatch(1, 7, tuple(segments), to_wire(hidden)))
    assert len(sent) == 1 and isinstance(sent[0], Fail) and "closed" in sent[0].reason, sent


async def test_a_stage_refuses_a_step_past_its_own_kv_limit_and_changes_no_cache(peer):
    """A stage holds its KV caches to its own share of its memory, whatever the supernode
    admits: a step that would grow them past it is a Fail the supernode reads as KV_FULL
    (its sessions end; no new plan), refused before any cache changes; room made by a drop
    takes the step."""
    m = peer.manifest
    await peer.follower.on_plan(peer.sup, plan(m, term=3))
    peer.follower.on_commit(peer.sup, Commit(3))
    engine = peer.store.engine
    per_position = (m.n_layers - 2) * 2 * m.config.n_kv_heads * m.config.head_dim * 4  # its 4 layers, fp32
    assert engine.kv_limit == int(3 * GiB * STAGE_KV_SHARE) // per_position // KVCache.CHUNK * KVCache.CHUNK
    engine.kv_limit = 2 * KVCache.CHUNK  # a peer with room for two chunks of one session

    def forward(session: str, start: int, rows: int, req: int):
        hidden = torch.randn(rows, m.config.hidden_size)
        return peer.follower.serve_forward(peer.sup, ForwardBatch(3, req, (Segment(SessionId(session), start, rows),),
                                                                  to_wire(hidden)))

    await forward("a", 0, 300, 1)  # two chunks: all there is
    await forward("b", 0, 1, 2)
    await forward("a", 300, 1, 3)  # within what it holds: no growth
    results, fails = peer.sup.of(ResultBatch), peer.sup.of(Fail)
    assert [r.req for r in results] == [1, 3]
    assert [(f.req, f.code) for f in fails] == [(2, FailCode.KV_FULL)] and "limit of 512" in fails[0].reason
    assert engine.cached_length("b") == 0 and engine.cached_length("a") == 301 and engine.held_positions() == 512
    peer.follower.drop("a")
    await forward("b", 0, 1, 4)
    assert peer.sup.of(ResultBatch)[-1].req == 4 and engine.held_positions() == KVCache.CHUNK


async def test_the_supernodes_own_span_past_its_kv_limit_ends_the_step_as_no_capacity(tiny_model_dir):
    """On the supernode's own span the same refusal is NoCapacity (the step's sessions end
    with a 503), not a StageFailed that would ask for a new plan."""
    n = Manifest.load(tiny_model_dir).n_layers
    engine = await asyncio.to_thread(StageEngine.load, tiny_model_dir, Span(0, n), False, False, "cpu", "float32")
    try:
        engine.kv_limit = KVCache.CHUNK
        runner = LocalRunner(engine)
        hidden = torch.randn(2, engine.config.hidden_size)
        await runner.forward_batch(1, [Segment(SessionId("a"), 0, 2)], hidden)
        with pytest.raises(NoCapacity, match="no room"):
            await runner.forward_batch(1, [Segment(SessionId("b"), 0, 2)], hidden)
    finally:
        engine.close()
