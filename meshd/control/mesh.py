"""What this peer knows of the mesh: one object, read by status, metrics, the
links and the HTTP side, each field with one writer.

- ``links``, ``lost``: the link keeper (``control/links.py``), as links come and go.
- ``term``, ``supernode``, ``plan``, ``history``, ``draining``, ``measured``, ``unavailable``:
  the leader (``control/leader.py``), the one authority on who leads, under which
  term and with which plan; a follower that accepts a plan asks it to.

Every change pulses ``changes``, so a task that waits for a state (a plan without
a drained peer, a new supernode serving) waits on that, not on a sleep loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum

from meshd.control.election import elect
from meshd.control.peers import Link
from meshd.control.placement import Candidate, measured_candidates
from protocol.messages import Assignment, Capabilities, Hello, Measured, NodeId, Plan

DEFAULT_HOP_MS = 0.3  # a LAN round trip of one decode frame, before any is measured
TERMS_KEPT = 20  # term history shown by /status


class PeerState(StrEnum):
    """A peer as /status shows it."""

    JOINING = "joining"  # no plan is active yet
    READY = "ready"
    DRAINING = "draining"  # being moved off the plan
    DRAINED = "drained"  # moved off, still linked
    LOST = "lost"


class Role(StrEnum):
    SUPERNODE = "supernode"
    STAGE = "stage"
    IDLE = "idle"


class NotServing(Enum):
    """Why this peer cannot serve; the detail text says the rest."""

    STARTING = "starting"
    WAITING_FOR_PLAN = "waiting for a plan"
    PLANNING = "the supernode is planning"
    NO_MODEL = "the supernode has no model"
    NO_ROOM = "the peers cannot hold the model"
    LOAD_FAILED = "the supernode cannot load its part"


@dataclass(frozen=True, slots=True)
class Unavailable:
    why: NotServing
    detail: str = ""

    def __str__(self) -> str:
        return self.detail or self.why.value


@dataclass(slots=True)
class LostPeer:
    hello: Hello
    addr: str
    since: float
    reason: str


@dataclass(frozen=True, slots=True)
class TermRecord:
    """A term as it became active on this peer."""

    term: int
    at: float
    reason: str
    assignments: tuple[Assignment, ...]

    def to_json(self) -> dict:
        return {"term": self.term, "at": round(self.at, 3), "reason": self.reason,
                "plan": plan_json(self.assignments)}


def plan_json(assignments: Iterable[Assignment]) -> list[dict]:
    """A plan as /status, drain answers and the term history show it."""
    return [{"node": a.node, "start": a.span.start, "stop": a.span.stop} for a in assignments]


class Changes:
    """A pulse: every change wakes every waiter, and each checks its own condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def pulse(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Until ``ready()`` holds (True) or ``timeout`` seconds pass (False; None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            event = self._event  # taken right after the check, nothing in between: no pulse is missed
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                return ready()
        return True


class MeshView:
    def __init__(self, node_id: NodeId, caps: Capabilities, changes: Changes | None = None):
        self.node_id = node_id
        self.caps = caps
        self.changes = changes or Changes()
        # Written by the link keeper.
        self.links: dict[NodeId, Link] = {}
        self.lost: dict[NodeId, LostPeer] = {}
        # Written by the leader.
        self._term = 0
        self.supernode: NodeId | None = None
        self.plan: Plan | None = None  # the active plan as this peer knows it
        self.history: list[TermRecord] = []  # newest last
        self.draining: set[NodeId] = set()  # supernode: peers being moved off the plan
        # Written by the node: this peer is stopping (it sent Leaving on every link).
        self.leaving = False
        self.measured: dict[NodeId, Measured] = {}  # supernode: timings peers sent since their Hello
        self.unavailable: Unavailable | None = Unavailable(NotServing.STARTING)  # None once a plan serves

    # -- reading -----------------------------------------------------------------------

    @property
    def term(self) -> int:
        """The highest term this peer holds: of a plan it led or accepted, or one a peer named."""
        return self._term

    @property
    def is_supernode(self) -> bool:
        return self.supernode == self.node_id

    def live_links(self) -> dict[NodeId, Link]:
        return {pid: link for pid, link in self.links.items() if link.alive}

    def candidates(self) -> list[Candidate]:
        """This peer's view: itself plus every live, authenticated link, less the peers that
        said they are stopping (``Leaving``). A peer stopping with no one else to elect keeps
        itself: a mesh always elects someone."""
        others = [Candidate.from_caps(pid, link.caps) for pid, link in self.live_links().items()
                  if not link.leaving]
        if self.leaving and others:
            return others
        return [Candidate.from_caps(self.node_id, self.caps), *others]

    def leaving_peers(self) -> set[NodeId]:
        """Linked peers that said they are stopping: no plan gives them a span."""
        return {pid for pid, link in self.live_links().items() if link.leaving}

    def candidates_for(self, model: str) -> list[Candidate]:
        """``candidates`` as placement weighs them for ``model``: by what its real layers cost
        each peer where it timed them (see ``placement.measured_candidates``)."""
        peers = {self.node_id: self.caps} | {pid: link.caps for pid, link in self.live_links().items()}
        return measured_candidates(peers, model, self.measured)

    def elected(self) -> NodeId:
        return elect(self.candidates())

    def successor(self) -> NodeId | None:
        """The peer that would lead were this one gone (the supernode, when this peer is
        not it); None alone. Where a batch job's replica goes (``serving/batch.py``)."""
        others = [c for c in self.candidates() if c.node_id != self.node_id]
        return elect(others) if others else None

    def hop_ms(self) -> float:
        """The median of the links' RTT floors, the cost of sending a span off the supernode."""
        rtts = sorted(f for link in self.live_links().values() if (f := link.rtt_floor_ms) is not None)
        return rtts[len(rtts) // 2] if rtts else DEFAULT_HOP_MS

    def span_of(self, peer: NodeId) -> list[int] | None:
        plan = self.plan
        if plan is None:
            return None
        return next((a.span.to_list() for a in plan.assignments if a.node == peer), None)

    def in_plan(self, peer: NodeId) -> bool:
        return self.plan is not None and any(a.node == peer for a in self.plan.assignments)

    def role(self, peer: NodeId) -> Role:
        if peer == self.supernode:
            return Role.SUPERNODE
        return Role.STAGE if self.span_of(peer) is not None else Role.IDLE

    def state(self, peer: NodeId) -> PeerState:
        if peer in self.draining:
            return PeerState.DRAINING if self.span_of(peer) is not None else PeerState.DRAINED
        return PeerState.JOINING if self.plan is None else PeerState.READY

    def shown_term(self) -> int:
        """The term /status and /metrics show: the active plan's, else the one held."""
        return self.plan.term if self.plan is not None else self._term

    # -- writing (each by its one owner; see the module docstring) ------------------------

    def hold_term(self, term: int) -> None:
        """Leader only: terms only grow."""
        if term > self._term:
            self._term = term
            self.changes.pulse()

    def activate(self, plan: Plan, reason: str) -> None:
        """Leader only: ``plan`` is this peer's active plan from now on."""
        self.plan = plan
        self.supernode = plan.supernode
        self.history.append(TermRecord(plan.term, time.time(), reason, plan.assignments))
        del self.history[:-TERMS_KEPT]
        self.changes.pulse()

    def set_supernode(self, peer: NodeId) -> None:
        """Leader only."""
        self.supernode = peer
        self.changes.pulse()

    def set_unavailable(self, why: NotServing, detail: str = "") -> None:
        """Leader only."""
        self.unavailable = Unavailable(why, detail)
        self.changes.pulse()

    def clear_unavailable(self) -> None:
        """Leader only: a plan serves."""
        self.unavailable = None
        self.changes.pulse()

    def add_link(self, link: Link) -> Link | None:
        """Link keeper only: the link it replaces, if any."""
        old = self.links.get(link.peer_id)
        self.links[link.peer_id] = link
        self.lost.pop(link.peer_id, None)
        self.changes.pulse()
        return old

    def remove_link(self, link: Link) -> bool:
        """Link keeper only: False when ``link`` was already replaced."""
        if self.links.get(link.peer_id) is not link:
            return False
        del self.links[link.peer_id]
        self.lost[link.peer_id] = LostPeer(link.hello, link.addr, time.time(), link.close_reason)
        self.changes.pulse()
        return True

    def forget_lost(self, older_than_s: float) -> None:
        """Link keeper only: lost peers are shown for a while, then forgotten."""
        now = time.time()
        for pid in [p for p, lost in self.lost.items() if now - lost.since > older_than_s]:
            del self.lost[pid]
