"""Election and the term rule, as pure functions."""

from __future__ import annotations

import random

import pytest

from meshd.control.election import accepts_plan, elect, next_term
from meshd.control.placement import Candidate
from protocol.messages import NodeId

GiB = 2**30


def peer(node: str, vram: int = 0, ram: int = 16 * GiB) -> Candidate:
    return Candidate(NodeId(node), mem_budget=GiB, layer_ms=1.0, vram=vram, ram=ram)


def test_most_vram_wins():
    assert elect([peer("a", 0), peer("b", 8 * GiB), peer("c", 4 * GiB)]) == "b"


def test_vram_tie_goes_to_more_ram():
    assert elect([peer("a", 8 * GiB, 16 * GiB), peer("b", 8 * GiB, 64 * GiB)]) == "b"


def test_full_tie_goes_to_smallest_node_id():
    assert elect([peer("node-c"), peer("node-a"), peer("node-b")]) == "node-a"


def test_every_view_order_agrees():
    peers = [peer(f"n{i}", vram=(i % 3) * GiB, ram=(i % 2) * GiB) for i in range(9)]
    winners = {elect(random.Random(seed).sample(peers, len(peers))) for seed in range(20)}
    assert winners == {"n5"}  # vram 2 GiB, ram 1 GiB, then the smallest id


def test_cpu_only_mesh_elects_by_ram():
    assert elect([peer("a", ram=8 * GiB), peer("b", ram=32 * GiB)]) == "b"


def test_elect_needs_a_peer():
    with pytest.raises(ValueError):
        elect([])


def test_terms_only_grow():
    assert next_term(0) == 1
    assert next_term(41) == 42


@pytest.mark.parametrize(
    "my_sn, my_term, sender, plan_term, ok",
    [
        ("a", 3, "a", 3, True),  # a re-plan within the term
        ("a", 3, "a", 4, True),
        ("a", 3, "a", 2, False),  # stale plan from before
        ("a", 3, "b", 5, False),  # not the supernode we hold, whatever its term
        ("b", 3, "b", 4, True),  # after a takeover the new supernode's higher term
    ],
)
def test_plan_accepted_only_from_our_supernode_at_our_term_or_later(my_sn, my_term, sender, plan_term, ok):
    assert accepts_plan(NodeId(my_sn), my_term, NodeId(sender), plan_term) is ok
