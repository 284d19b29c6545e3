"""Placement, re-planning and plan validation, as pure functions."""

from __future__ import annotations

import itertools
import random

import pytest

from meshd.errors import NoCapacity, ProtocolError
from meshd.control.placement import Candidate, bottleneck, place, replan, validate
from protocol.messages import Assignment, NodeId
from shards.span import Span

MB = 2**20
LAYER = 14 * MB  # one SmolLM2-135M fp32 layer, about
HEAD = 113 * MB
N = 30


def cand(node: str, ms: float = 1.0, budget: int = 10**12) -> Candidate:
    return Candidate(NodeId(node), mem_budget=budget, layer_ms=ms)


def counts(plan) -> dict[str, int]:
    return {a.node: len(a.span) for a in plan}


def plan_of(*spans: tuple[str, int, int]) -> tuple[Assignment, ...]:
    return tuple(Assignment(NodeId(n), Span(a, b)) for n, a, b in spans)


def placed(peers, sn="a", **kw):
    kw = {"n_layers": N, "layer_bytes": LAYER, "head_bytes": HEAD, **kw}
    plan = place(peers, supernode=NodeId(sn), **kw)
    validate(plan, kw["n_layers"])
    return plan


# -- place ------------------------------------------------------------------------


def test_single_peer_takes_everything():
    assert placed([cand("a")]) == plan_of(("a", 0, N))


def test_equal_peers_share_evenly():
    plan = placed([cand(n) for n in "abcd"], hop_ms=0.2)
    assert sorted(counts(plan).values()) == [7, 7, 8, 8]
    assert plan[0].node == "a" and plan[0].span.start == 0  # the supernode's span first


def test_result_does_not_depend_on_discovery_order():
    peers = [cand(n, ms) for n, ms in zip("abcde", [1.0, 1.0, 2.0, 3.0, 1.5])]
    plans = {placed(random.Random(s).sample(peers, 5)) for s in range(10)}
    assert len(plans) == 1


def test_three_times_slower_peer_gets_about_a_third():
    c = counts(placed([cand("a", 1.0), cand("b", 3.0)]))
    assert c["a"] + c["b"] == N
    assert abs(c["b"] / c["a"] - 1 / 3) < 0.05


def test_heterogeneous_bottleneck_is_optimal():
    # Brute force over every split of 12 layers across three peers.
    peers = [cand("a", 1.0), cand("b", 2.0), cand("c", 0.5)]
    hop = 0.7
    plan = placed(peers, n_layers=12, hop_ms=hop)
    got = bottleneck(plan, candidates=peers, supernode=NodeId("a"), hop_ms=hop)
    best = min(
        max(ka * 1.0, kb and kb * 2.0 + hop, kc and kc * 0.5 + hop)
        for ka, kb in itertools.product(range(13), repeat=2)
        if (kc := 12 - ka - kb) >= 0
    )
    assert got == pytest.approx(best)


def test_too_slow_peer_gets_no_span():
    plan = placed([cand("a", 1.0), cand("b", 1.0), cand("slow", 40.0)], hop_ms=0.5)
    assert "slow" not in counts(plan)
    assert sum(counts(plan).values()) == N


def test_hop_cost_can_make_a_peer_not_worth_it():
    # Alone: 4 layers x 1 ms. A 5 ms hop is slower than that before its first layer.
    plan = placed([cand("a"), cand("b")], n_layers=4, hop_ms=5.0)
    assert plan == plan_of(("a", 0, 4))


def test_head_cost_on_the_supernode_moves_layers_off_it():
    plain = counts(placed([cand("a"), cand("b")]))
    loaded = counts(placed([cand("a"), cand("b")], head_ms=8.0))
    assert loaded["a"] < plain["a"]


def test_memory_bound_peer_gets_what_fits_and_the_head_counts():
    # The supernode can hold the head and 3 layers; the fast peer would want more.
    peers = [cand("a", 0.5, budget=HEAD + 3 * LAYER + LAYER // 2), cand("b", 1.0)]
    assert counts(placed(peers)) == {"a": 3, "b": 27}


def test_memory_bound_slow_peer_is_still_used_when_needed():
    peers = [cand("a", 1.0, budget=HEAD + 10 * LAYER), cand("b", 1.0, budget=10 * LAYER), cand("c", 50.0)]
    assert counts(placed(peers)) == {"a": 10, "b": 10, "c": 10}


def test_per_layer_sizes_use_the_largest_layer():
    sizes = [LAYER] * (N - 1) + [2 * LAYER]
    peers = [cand("a", budget=HEAD + 10 * 2 * LAYER), cand("b", budget=20 * 2 * LAYER)]
    plan = placed(peers, layer_bytes=sizes)
    for a in plan:
        room = next(p.mem_budget for p in peers if p.node_id == a.node) - (HEAD if a.node == "a" else 0)
        assert sum(sizes[i] for i in a.span) <= room


def test_no_capacity_says_how_much_is_missing():
    peers = [cand("a", budget=HEAD + 10 * LAYER), cand("b", budget=15 * LAYER)]
    with pytest.raises(NoCapacity, match=f"room for 25 of 30 layers: {5 * LAYER} bytes short"):
        placed(peers)


def test_no_capacity_when_the_supernode_cannot_hold_the_head():
    with pytest.raises(NoCapacity, match="short of the head"):
        placed([cand("a", budget=HEAD - 1), cand("b")])


def test_unmeasured_peer_waits_for_its_measurement():
    assert counts(placed([cand("a"), cand("b", ms=0.0)])) == {"a": N}


def test_supernode_must_be_a_candidate():
    with pytest.raises(ValueError):
        placed([cand("b")], sn="a")


# -- replan -----------------------------------------------------------------------


ARGS = dict(supernode=NodeId("a"), n_layers=N, layer_bytes=LAYER, head_bytes=HEAD, hop_ms=0.2)


def test_replan_after_a_loss_covers_every_layer_with_survivors():
    peers = [cand(n) for n in "abcd"]
    before = place(peers, **ARGS)
    after = replan(before, {"a", "b", "d"}, peers, **ARGS)
    validate(after, N)
    assert set(counts(after)) == {"a", "b", "d"}
    assert sorted(counts(after).values()) == [10, 10, 10]


def test_replan_after_a_loss_keeps_the_layout_order():
    peers = [cand(n) for n in "abcd"]
    before = place(peers, **ARGS)
    after = replan(before, {"a", "b", "d"}, peers, **ARGS)
    assert [a.node for a in after] == [a.node for a in before if a.node != "c"]


def test_losing_an_idle_peer_changes_nothing():
    peers = [cand("a"), cand("b"), cand("slow", 40.0)]
    before = place(peers, **ARGS)
    assert replan(before, {"a", "b"}, peers, **ARGS) == before


def test_an_idle_spare_takes_a_lost_span_whole():
    # e, an equal spare, joined after the plan was made: it takes c's span and
    # nobody else moves.
    current = place([cand(n) for n in "abcd"], **ARGS)
    peers = [cand(n) for n in "abcde"]
    after = replan(current, {"a", "b", "d", "e"}, peers, **ARGS)
    lost = next(a.span for a in current if a.node == "c")
    assert after == tuple(Assignment(NodeId("e"), lost) if a.node == "c" else a for a in current)


def test_replan_places_afresh_when_patching_would_be_slower():
    # A slow spare could take c's span whole, but spreading it is faster.
    current = place([cand(n) for n in "abcd"], **ARGS)
    peers = [cand(n) for n in "abcd"] + [cand("e", 3.0)]
    after = replan(current, {"a", "b", "d", "e"}, peers, **ARGS)
    validate(after, N)
    cost = dict(candidates=peers, supernode=NodeId("a"), hop_ms=0.2)
    assert bottleneck(after, **cost) == pytest.approx(
        bottleneck(place([p for p in peers if p.node_id != "c"], **ARGS), **cost)
    )


def test_replan_raises_no_capacity_when_survivors_cannot_hold_the_model():
    peers = [cand("a", budget=HEAD + 15 * LAYER), cand("b", budget=15 * LAYER)]
    before = place(peers, **ARGS)
    with pytest.raises(NoCapacity):
        replan(before, {"a"}, peers, **ARGS)


# -- validate ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "plan, match",
    [
        (plan_of(("a", 0, 10), ("b", 12, 30)), "leaves layers 10:12 unowned"),
        (plan_of(("a", 0, 12), ("b", 10, 30)), "runs layers 10:12 twice"),
        (plan_of(("a", 0, 10), ("b", 10, 20)), "covers layers 0:20"),
        (plan_of(("a", 0, 10), ("b", 10, 31)), "covers layers 0:31"),
        (plan_of(("b", 5, 30), ("a", 0, 5)), "leaves layers 0:5"),
        (plan_of(("a", 0, 10), ("b", 10, 20), ("a", 20, 30)), "more than one span"),
        ((), "covers layers 0:0"),
    ],
)
def test_validate_catches_bad_plans(plan, match):
    with pytest.raises(ProtocolError, match=match):
        validate(plan, N)


def test_validate_accepts_a_good_plan():
    validate(plan_of(("a", 0, 1), ("b", 1, 29), ("c", 29, 30)), N)
