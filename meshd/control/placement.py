"""Where each transformer layer runs. Pure functions over a view of peers.

The supernode keeps the embedding, final norm and head; the layers are cut into
contiguous half-open spans, at most one per peer. Requests pipeline through the
stages, so what limits the mesh is its slowest stage:

    stage_ms(peer) = count * layer_ms (+ hop_ms off the supernode, + head_ms on it)

``place`` minimises the largest stage_ms subject to each peer's memory. Because
every layer costs the same on a given peer, each peer offers an increasing
sequence of "finish times" (hop + 1*ms, hop + 2*ms, ... up to what its memory
holds), and the best plan takes the n smallest of all of them: the n-th is the
bottleneck, and no other choice of n can beat it. That one rule also gives the
behaviour we want at the edges: equal peers take turns, so the layers spread
evenly; a peer 3x slower offers a third as many values under any bottleneck, so
it gets about a third of the layers; a peer whose very first layer would
already be the slowest stage offers nothing below the bottleneck and gets no
span. (Petals' block_selection and exo's planner are the models for keeping
this small.)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from meshd.errors import NoCapacity, ProtocolError
from protocol.messages import Assignment, Capabilities, Measured, NodeId
from shards.manifest import Manifest
from shards.span import Span

_EPS = 1e-9  # float slack when comparing bottlenecks


@dataclass(frozen=True, slots=True)
class Candidate:
    """A peer as placement sees it."""

    node_id: NodeId
    mem_budget: int  # bytes usable for layers (and the head, on the supernode)
    layer_ms: float  # measured decode ms of one layer; <= 0 means not measured yet
    vram: int = 0
    ram: int = 0

    @classmethod
    def from_caps(cls, node_id: NodeId, caps: Capabilities) -> Candidate:
        return cls(node_id, caps.mem_budget, caps.layer_ms, caps.vram, caps.ram)


def measured_candidates(peers: Mapping[NodeId, Capabilities], model: str,
                        learned: Mapping[NodeId, Measured] | None = None) -> list[Candidate]:
    """Candidates whose ``layer_ms`` is what one real layer of ``model`` costs them per
    decode step at the measured batch, where they timed it (``caps.measured``).

    The synthetic probe (a dense fp32 layer) is no guide to a quantized model's real
    layers, and reads differently from box to box (measured here: 0.34 ms probe against
    0.5-0.6 ms for a real Q4_1 layer at batch 1), so it is used only for a peer that has
    not timed the model (it has no weights yet), scaled by the median real/probe ratio of
    the peers that have both, so that every figure is in the same unit. ``learned``: timings
    a peer sent since its Hello (in its Accept, once it had loaded the weights)."""
    learned = learned or {}
    timed = {}
    for n, c in peers.items():
        m = next((m for m in (learned.get(n), c.measured) if m is not None and m.has_layers(model)), None)
        if m is not None:
            timed[n] = m
    ratios = sorted(timed[n].layer_ms_batch / c.layer_ms for n, c in peers.items() if n in timed and c.layer_ms > 0)
    scale = ratios[len(ratios) // 2] if ratios else 1.0
    out = []
    for n, c in peers.items():
        ms = timed[n].layer_ms_batch if n in timed else c.layer_ms * scale
        out.append(Candidate(n, c.mem_budget, ms, c.vram, c.ram))
    return out


# One split serves both phases, and they want different ones: a decode step pays the head
# (on SmolLM2-135M Q4_1, one core, batch 8: ~15 ms, ~9-10 layers' worth) at every step, a
# prefill pays it once per prompt (1 row of ~1000: nothing). Two equal peers, by the per-part
# timings: the decode optimum is about 10-11/19-20 (a long prompt's wavefront is then bound
# by 19-20 of 30 layers: TTFT ~0.68x one peer, issue 13 wants <= 0.65x), the prefill optimum
# 15/15 (aggregate ~1.6x, it wants >= 1.7x). Measured in vivo (CPU seconds per thread of two
# pinned daemons, 16 streams x 48 tokens, the split 14/16 that a share of 0.5 gave): the
# supernode's engine thread 4.9 s, the other's 4.1 s, one peer alone 8.0 s, so that split
# caps the aggregate at ~1.6x; fitting those, the balance point is about 12/18. Three quarters of the
# head gives 12-13/17-18: both targets in reach, neither with much to spare.
# Splits forced side by side (bench/bench_splits.py, 2026-12-03, all in one run, medians of 3;
# 2 peers / 1: aggregate, decode, long-prompt TTFT): 10/20 1.22x 0.74x 0.84x, 11/19 1.26x 0.77x
# 0.73x, 12/18 1.26x 0.82x 0.69x, 13/17 1.12x 0.74x 0.70x, 14/16 1.11x 0.78x 0.65x (earlier runs of
# three splits at a time agree: 12/18 1.48x / 0.70x, 14/16 1.29x / 0.66x). 12/18 is the best
# compromise, which is where three quarters of the head aims: kept.
HEAD_SHARE = 0.75


@dataclass(frozen=True, slots=True)
class Costs:
    """What a plan is weighed by: the model's sizes and the costs outside the layers.
    ``place`` and ``replan`` take one; ``of_model`` builds it the leader's way."""

    supernode: NodeId
    n_layers: int
    layer_bytes: int | Sequence[int]
    head_bytes: int = 0
    hop_ms: float = 0.0  # a round trip off the supernode
    head_ms: float = 0.0  # embedding and head, on the supernode

    @classmethod
    def of_model(cls, manifest: Manifest, supernode: NodeId, layer_ms: float, hop_ms: float,
                 measured: Measured | None = None) -> Costs:
        """``measured``: the supernode's own timing of this model's parts; its head (final
        norm, lm_head, sampling at the decode batch, weighed by HEAD_SHARE) is then what the
        supernode's stage pays beside its layers. Without one, the head costs what its bytes cost in layers
        (decode reads every weight once a step), a guess that can be far off: a Q4_1
        model's head is unpacked to the activations' dtype, its layers are not."""
        if measured is not None and measured.has_head(manifest.name):
            head_ms = HEAD_SHARE * measured.head_ms_batch
        else:
            head_ms = layer_ms * manifest.embed_bytes / max(1, manifest.layer_bytes(0))
        return cls(supernode, manifest.n_layers, [manifest.layer_bytes(i) for i in range(manifest.n_layers)],
                   manifest.embed_bytes, hop_ms, head_ms)


def _costs(costs: Costs | None, fields: dict[str, Any]) -> Costs:
    """A ``Costs``, given whole or as its fields by keyword."""
    if (costs is None) == (not fields):
        raise TypeError("give a Costs or its fields by keyword, not both")
    return costs if costs is not None else Costs(**fields)


def place(
    candidates: Iterable[Candidate],
    costs: Costs | None = None,
    *,
    order: Sequence[NodeId] = (),
    **fields: Any,
) -> tuple[Assignment, ...]:
    """Spans covering ``[0, n_layers)`` exactly once, in layer order, the
    supernode's first (from layer 0) when it has one.

    ``order`` lays the other peers' spans out in that order (then by node id),
    so that a re-plan moves boundaries rather than whole spans.
    Raises ``NoCapacity`` when the candidates cannot hold the model.
    """
    c = _costs(costs, fields)
    peers = _usable(candidates, c.supernode, c.head_bytes)
    per_layer = _per_layer_bytes(c.layer_bytes, c.n_layers)
    caps = {p.node_id: _room(p, c.supernode, c.head_bytes) // per_layer for p in peers}
    held = sum(caps.values())
    if held < c.n_layers:
        short = (c.n_layers - held) * per_layer
        raise NoCapacity(
            f"peers have room for {held} of {c.n_layers} layers: {short} bytes short "
            f"({c.n_layers - held} x {per_layer}-byte layers)"
        )

    # Each peer's next finish time, smallest first; ties go to the earlier peer
    # in layout order, so equal peers alternate.
    layout = _layout(peers, c.supernode, order)
    counts = dict.fromkeys(layout, 0)
    ms = {p.node_id: p.layer_ms for p in peers}
    heap = [(_fixed_ms(n, c.supernode, c.hop_ms, c.head_ms) + ms[n], i, n) for i, n in enumerate(layout) if caps[n]]
    heapq.heapify(heap)
    for _ in range(c.n_layers):
        finish, i, node = heapq.heappop(heap)
        counts[node] += 1
        if counts[node] < caps[node]:
            heapq.heappush(heap, (finish + ms[node], i, node))

    plan, start = [], 0
    for node in layout:
        if counts[node]:
            plan.append(Assignment(node, Span(start, start + counts[node])))
            start += counts[node]
    return tuple(plan)


def replan(
    current: Sequence[Assignment],
    alive: set[NodeId],
    candidates: Iterable[Candidate],
    costs: Costs | None = None,
    **fields: Any,
) -> tuple[Assignment, ...]:
    """A plan for the ``alive`` peers that disturbs ``current`` as little as is free.

    Every load costs seconds (and a fetch, if the peer lacks the files), so:
    if keeping every survivor's span and handing each lost span whole to an
    idle peer is as fast as a fresh placement, do that; otherwise place afresh,
    with the survivors laid out in their current order so boundaries shift
    rather than spans jumping across the model.
    """
    c = _costs(costs, fields)
    pool = [p for p in candidates if p.node_id in alive]
    survivors = [a.node for a in sorted(current, key=lambda a: a.span.start) if a.node in alive]
    fresh = place(pool, c, order=survivors)
    patched = _patch(current, pool, c)
    if patched is None:
        return fresh

    def cost(plan: Sequence[Assignment]) -> float:
        return bottleneck(plan, candidates=pool, supernode=c.supernode, hop_ms=c.hop_ms, head_ms=c.head_ms)

    return patched if cost(patched) <= cost(fresh) + _EPS else fresh


# A plan is re-made for better timings only when its slowest stage is this much slower than
# a fresh plan's: timings of the same box differ by a few percent from run to run, and a
# re-plan costs a load (and a replay of the streams in flight).
REBALANCE_MARGIN = 0.15


def rebalanced(current: Sequence[Assignment], candidates: Iterable[Candidate], costs: Costs,
               margin: float = REBALANCE_MARGIN) -> tuple[Assignment, ...] | None:
    """A fresh plan when ``current``'s slowest stage is more than ``margin`` slower than the
    fresh one's under these (newer) timings, else None. A plan that names a peer not among
    ``candidates`` is for the loss path, not this one."""
    pool = list(candidates)
    ids = {c.node_id for c in pool}
    if not current or any(a.node not in ids for a in current):
        return None
    order = [a.node for a in sorted(current, key=lambda a: a.span.start) if a.node != costs.supernode]
    try:
        fresh = place(pool, costs, order=order)
    except NoCapacity:
        return None
    now = max(stage_ms(current, pool, costs))
    best = max(stage_ms(fresh, pool, costs))
    return fresh if now > best * (1.0 + margin) + _EPS else None


def validate(assignments: Sequence[Assignment], n_layers: int) -> None:
    """Raise ``ProtocolError`` unless the spans cover ``[0, n_layers)`` exactly
    once, contiguously, in layer order, one span per node. A peer runs this on
    every Plan it receives before loading anything."""
    nodes = [a.node for a in assignments]
    if len(set(nodes)) != len(nodes):
        raise ProtocolError(f"plan gives some node more than one span: {nodes}")
    at = 0
    for a in assignments:
        if a.span.start > at:
            raise ProtocolError(f"plan leaves layers {at}:{a.span.start} unowned")
        if a.span.start < at:
            raise ProtocolError(f"plan runs layers {a.span.start}:{at} twice (at {a.node})")
        at = a.span.stop
    if at != n_layers:
        raise ProtocolError(f"plan covers layers 0:{at}, the model has {n_layers}")


def stage_ms(assignments: Sequence[Assignment], candidates: Iterable[Candidate], costs: Costs) -> list[float]:
    """Each stage's ms per decode step under ``costs``, in plan order (for logs and tests)."""
    return _stages(assignments, candidates, costs.supernode, costs.hop_ms, costs.head_ms)


def bottleneck(
    assignments: Sequence[Assignment],
    *,
    candidates: Iterable[Candidate],
    supernode: NodeId,
    hop_ms: float = 0.0,
    head_ms: float = 0.0,
) -> float:
    """The slowest stage of a plan, in ms per decode step."""
    return max(_stages(assignments, candidates, supernode, hop_ms, head_ms), default=0.0)


def _stages(assignments: Sequence[Assignment], candidates: Iterable[Candidate], supernode: NodeId,
            hop_ms: float, head_ms: float) -> list[float]:
    ms = {c.node_id: c.layer_ms for c in candidates}
    return [_fixed_ms(a.node, supernode, hop_ms, head_ms) + len(a.span) * ms[a.node] for a in assignments]


# -- helpers ----------------------------------------------------------------------


def _usable(candidates: Iterable[Candidate], supernode: NodeId, head_bytes: int) -> list[Candidate]:
    """The candidates that can take layers. An unmeasured speed (<= 0) is not
    "infinitely fast": such a peer waits for its measurement. The supernode is
    always kept, since it holds the head whatever else it does."""
    peers = {c.node_id: c for c in candidates}
    sn = peers.get(supernode)
    if sn is None:
        raise ValueError(f"supernode {supernode} is not among the candidates")
    if sn.mem_budget < head_bytes:
        raise NoCapacity(f"supernode {supernode} is {head_bytes - sn.mem_budget} bytes short of the head")
    return [c for c in peers.values() if c.node_id == supernode or _measured(c)]


def _measured(c: Candidate) -> bool:
    return math.isfinite(c.layer_ms) and c.layer_ms > 0


def _room(c: Candidate, supernode: NodeId, head_bytes: int) -> int:
    if not _measured(c):
        return 0
    return max(0, c.mem_budget - (head_bytes if c.node_id == supernode else 0))


def _per_layer_bytes(layer_bytes: int | Sequence[int], n_layers: int) -> int:
    """One size for every layer: Llama layers are all the same size, and taking
    the largest makes a count that fits fit wherever its span lands."""
    if n_layers <= 0:
        raise ValueError(f"n_layers must be positive, got {n_layers}")
    if isinstance(layer_bytes, int):
        sizes = [layer_bytes]
    else:
        sizes = list(layer_bytes)
        if len(sizes) != n_layers:
            raise ValueError(f"{len(sizes)} layer sizes for {n_layers} layers")
    return max(1, max(sizes))


def _fixed_ms(node: NodeId, supernode: NodeId, hop_ms: float, head_ms: float) -> float:
    """What a stage costs before its layers: the supernode embeds and projects,
    every other stage is a network round trip away."""
    return head_ms if node == supernode else hop_ms


def _layout(peers: list[Candidate], supernode: NodeId, order: Sequence[NodeId]) -> list[NodeId]:
    """Supernode first (its layers need no hop, and embed feeds them directly),
    then ``order``, then the rest by node id, so the result never depends on the
    order peers were discovered in."""
    rest = sorted(p.node_id for p in peers if p.node_id != supernode)
    rank = {n: i for i, n in enumerate(order)}
    rest.sort(key=lambda n: rank.get(n, len(rank)))
    return [supernode, *rest]


def _patch(current: Sequence[Assignment], pool: list[Candidate], costs: Costs) -> tuple[Assignment, ...] | None:
    """``current`` with each lost span given whole to the fastest idle peer that
    can hold it, or None when that is not possible."""
    supernode, head_bytes = costs.supernode, costs.head_bytes
    by_id = {c.node_id: c for c in pool}
    per_layer = _per_layer_bytes(costs.layer_bytes, costs.n_layers)
    try:
        validate(sorted(current, key=lambda a: a.span.start), costs.n_layers)
    except ProtocolError:
        return None
    idle = sorted(
        (c for c in pool if _measured(c) and all(a.node != c.node_id for a in current)),
        key=lambda c: (c.layer_ms, c.node_id),
    )
    plan = []
    for a in sorted(current, key=lambda a: a.span.start):
        owner = by_id.get(a.node)
        if owner is None:
            owner = next((c for c in idle if _room(c, supernode, head_bytes) >= len(a.span) * per_layer), None)
            if owner is None:
                return None
            idle.remove(owner)
        elif _room(owner, supernode, head_bytes) < len(a.span) * per_layer:
            return None  # its budget shrank (or it became supernode and holds the head now)
        plan.append(Assignment(owner.node_id, a.span))
    # Keep the rule that the supernode's span, if any, comes first.
    if any(a.node == supernode for a in plan[1:]):
        return None
    return tuple(plan)
