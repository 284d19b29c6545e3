"""Who is supernode, and whose plan to follow. Pure functions, no I/O.

Every peer computes ``elect`` over the same view (alive, authenticated peers
plus itself) and so agrees without a vote. Views can differ for a moment while
a loss propagates, so authority also carries a term that only grows: a new
supernode plans with ``next_term`` of the highest term it has seen, and a peer
follows a plan only from the peer it holds as supernode at a term no older than
its own (``accepts_plan``).
"""

from __future__ import annotations

from typing import Iterable, Protocol

from protocol.messages import NodeId


class Electable(Protocol):
    """Anything with these read-only fields, e.g. ``placement.Candidate``."""

    @property
    def node_id(self) -> NodeId: ...
    @property
    def vram(self) -> int: ...
    @property
    def ram(self) -> int: ...


def rank(peer: Electable) -> tuple[int, int, str]:
    """Sort key, best first: most VRAM (the head and most layers want it), then
    most RAM, then the smallest node id so that the order is total."""
    return (-peer.vram, -peer.ram, peer.node_id)


def elect(peers: Iterable[Electable]) -> NodeId:
    """The supernode among ``peers``; the caller includes itself."""
    best = min(peers, key=rank, default=None)
    if best is None:
        raise ValueError("elect() needs at least one peer (include this node)")
    return best.node_id


def next_term(current: int) -> int:
    """The term a (new) supernode plans under: above every term it has seen."""
    return current + 1


def accepts_plan(my_supernode: NodeId, my_term: int, sender: NodeId, plan_term: int) -> bool:
    """Whether to follow a Plan from ``sender``. Equal terms are accepted because
    a supernode re-plans within its term after a Reject; an older term is a
    deposed supernode that has not heard yet. On acceptance the peer's term
    becomes ``plan_term``."""
    return sender == my_supernode and plan_term >= my_term
