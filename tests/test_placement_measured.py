"""Placement on measured costs: the real layer and head times peers report (``Measured``),
not the synthetic probe nor a head priced at its bytes.

The figures are the ones measured on this project's box (SmolLM2-135M Q4_1, one pinned
core, fp32 activations): a real layer 0.5-0.6 ms at batch 1 and 1.6-1.9 ms at batch 8,
the head (final norm, lm_head, argmax) 4-9 ms at batch 1 and 14-25 ms at batch 8, the
synthetic probe 0.33-0.7 ms. The manifest prices the head at 16.8 layers by its bytes;
timed, it is about 9.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from meshd.control.placement import (HEAD_SHARE, REBALANCE_MARGIN, Candidate, Costs, measured_candidates, place,
                                     rebalanced, stage_ms)
from protocol.messages import Assignment, Capabilities, Measured, NodeId
from shards.span import Span
from shards.wire import to_wire

MODEL = "smollm2-135m"
GiB = 2**30


def caps(probe: float, measured: Measured = Measured()) -> Capabilities:
    return Capabilities(vram=0, ram=8 * GiB, device="cpu", api_port=1, mem_budget=8 * GiB, layer_ms=probe,
                        measured=measured)


def timed(layer: float, head: float = 0.0, model: str = MODEL) -> Measured:
    return Measured(model, layer / 3, layer, head / 3, head, batch=8)


def manifest(n_layers: int = 30, name: str = MODEL) -> SimpleNamespace:
    """The parts of a Manifest that Costs.of_model reads (SmolLM2's sizes)."""
    return SimpleNamespace(name=name, n_layers=n_layers, embed_bytes=37_161_216,
                           layer_bytes=lambda i: 2_216_448)


def split(plan) -> list[int]:
    return [len(a.span) for a in plan]


def test_measured_layers_replace_the_probe():
    # The supernode's probe read it 2x slower than the other peer; its real layers are not.
    peers = {NodeId("a"): caps(0.7, timed(1.8, 15.0)), NodeId("b"): caps(0.35, timed(1.8))}
    got = {c.node_id: c.layer_ms for c in measured_candidates(peers, MODEL)}
    assert got == {"a": 1.8, "b": 1.8}


def test_an_untimed_peer_is_weighed_on_its_probe_in_the_same_unit():
    # "c" has no weights yet: its probe is scaled by the others' real/probe ratio (median 5).
    peers = {NodeId("a"): caps(0.4, timed(2.0, 15.0)), NodeId("b"): caps(0.3, timed(1.5)),
             NodeId("c"): caps(0.6)}
    got = {c.node_id: c.layer_ms for c in measured_candidates(peers, MODEL)}
    assert got["a"] == 2.0 and got["b"] == 1.5 and abs(got["c"] - 3.0) < 1e-9


def test_timings_of_another_model_are_not_used():
    peers = {NodeId("a"): caps(0.5, timed(2.0, 15.0, model="other")), NodeId("b"): caps(0.5)}
    assert {c.layer_ms for c in measured_candidates(peers, MODEL)} == {0.5}


def test_learned_timings_win_over_the_hello():
    peers = {NodeId("a"): caps(0.5, timed(2.0, 15.0)), NodeId("b"): caps(0.5)}
    got = measured_candidates(peers, MODEL, {NodeId("b"): timed(4.0)})
    assert {c.node_id: c.layer_ms for c in got} == {"a": 2.0, "b": 4.0}


def test_the_measured_head_is_the_supernodes_fixed_cost():
    m = manifest()
    assert Costs.of_model(m, NodeId("a"), 1.8, 0.3, timed(1.8, 15.0)).head_ms == HEAD_SHARE * 15.0
    # Untimed (or timed for another model): priced by bytes, as before.
    guess = Costs.of_model(m, NodeId("a"), 1.8, 0.3, Measured()).head_ms
    assert abs(guess - 1.8 * 37_161_216 / 2_216_448) < 1e-9
    assert Costs.of_model(m, NodeId("a"), 1.8, 0.3, timed(1.8, 15.0, model="other")).head_ms == guess


def test_two_equal_peers_balance_with_the_measured_head():
    # What split the bench's 2 peers 4/26: a head priced at 16.8 layers and a probe that read
    # the supernode slower. Timed, the head is ~9 layers, weighed at HEAD_SHARE (decode pays
    # it every step, prefill once): the supernode takes 11-12 of 30.
    peers = {NodeId("a"): caps(0.7, timed(1.7, 15.5)), NodeId("b"): caps(0.35, timed(1.7))}
    cands = measured_candidates(peers, MODEL)
    costs = Costs.of_model(manifest(), NodeId("a"), 1.7, 0.3, peers[NodeId("a")].measured)
    plan = place(cands, costs)
    assert split(plan)[0] in (11, 12)
    a, b = stage_ms(plan, cands, costs)
    assert abs(a - b) <= 1.7  # within one layer of even
    # The old pricing, for the record: the supernode keeps (nearly) only the head.
    old = place([Candidate(NodeId("a"), 8 * GiB, 0.7), Candidate(NodeId("b"), 8 * GiB, 0.35)],
                Costs.of_model(manifest(), NodeId("a"), 0.7, 0.3))
    assert sum(len(a.span) for a in old if a.node == "a") <= 5


def plan_of(*counts: int) -> tuple[Assignment, ...]:
    out, at = [], 0
    for node, n in zip("ab", counts):
        out.append(Assignment(NodeId(node), Span(at, at + n)))
        at += n
    return tuple(out)


def test_rebalance_only_past_the_margin():
    cands = [Candidate(NodeId("a"), 8 * GiB, 1.0), Candidate(NodeId("b"), 8 * GiB, 1.0)]
    costs = Costs(NodeId("a"), 30, 1, head_ms=10.0)
    # The best plan: 10/20 (20 ms each). 11/19 is 5% off: left as it is (no flapping on noise).
    assert rebalanced(plan_of(11, 19), cands, costs) is None
    # 4/26 (26 ms, 30% off): re-made, and the new plan is the balanced one.
    fresh = rebalanced(plan_of(4, 26), cands, costs)
    assert fresh is not None and split(fresh) == [10, 20]
    assert rebalanced(fresh, cands, costs) is None  # and it stays
    assert REBALANCE_MARGIN >= 0.1


def test_rebalance_leaves_a_plan_with_a_missing_peer_to_the_loss_path():
    cands = [Candidate(NodeId("a"), 8 * GiB, 1.0)]
    assert rebalanced(plan_of(4, 26), cands, Costs(NodeId("a"), 30, 1, head_ms=10.0)) is None


def test_bounded_values_survive_the_wire():
    from protocol.codec import decode, encode
    from protocol.messages import Accept, Hello

    m = timed(1.7, 15.5)
    hello = Hello(2, NodeId("a"), "mesh", "a", caps(0.5, m))
    assert decode(encode(hello)).caps.measured == m
    accept = Accept(3, Span(10, 30), timed(2.0))
    assert decode(encode(accept)) == accept
    assert decode(encode(replace(accept, measured=Measured()))).measured == Measured()


@pytest.mark.parametrize("field,value", [("layer_ms", -1.0), ("head_ms_batch", 1e7), ("layer_ms", float("nan")),
                                         ("batch", 0)])
def test_a_peers_timing_out_of_bounds_is_a_protocol_error(field, value):
    import msgpack

    from meshd.errors import ProtocolError
    from protocol.codec import decode, encode
    from protocol.messages import Accept

    frame = msgpack.unpackb(encode(Accept(3, Span(10, 30), timed(2.0))))
    frame["measured"][field] = value
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(frame))


def test_the_urgent_flag_travels_and_an_older_frame_reads_as_not_urgent():
    import msgpack
    import torch

    from protocol.codec import decode, encode
    from protocol.messages import ForwardBatch, Segment

    fb = ForwardBatch(1, 7, (Segment("s", 0, 2),), to_wire(torch.zeros(2, 4)), urgent=1)
    assert decode(encode(fb)).urgent == 1
    frame = msgpack.unpackb(encode(fb))
    del frame["urgent"]
    assert decode(msgpack.packb(frame)).urgent == 0


def test_measure_parts_times_a_real_layer_and_the_head(tiny_model_dir):
    """The measurement runs, gives a positive finite figure for each part at both batch
    sizes, and is what placement weighs the peer and the head by. How the figures compare
    (a batch of 4 against one row) is the box's business, not the test's: it is a bench's."""
    import math

    from shards.engine import measure_parts
    from shards.manifest import Manifest

    t = measure_parts(tiny_model_dir, "cpu", "float32", batch=4, budget_s=0.05)
    assert t.batch == 4
    assert all(math.isfinite(v) and v > 0 for v in (t.layer_ms, t.layer_ms_batch, t.head_ms, t.head_ms_batch)), t
    # Placement reads it as a peer sends it (node.py's Measured): this peer is weighed by its
    # measured layer at the batch, not by its probe, and a supernode holding the head is
    # charged its share of the timed head.
    name = Manifest.load(tiny_model_dir).name
    sent = Measured(name, t.layer_ms, t.layer_ms_batch, t.head_ms, t.head_ms_batch, t.batch)
    assert sent.has_layers(name) and sent.has_head(name)
    (cand,) = measured_candidates({NodeId("a"): caps(123.0, sent)}, name)
    assert cand.layer_ms == t.layer_ms_batch
    m = manifest(name=name)
    assert Costs.of_model(m, NodeId("a"), cand.layer_ms, 0.3, sent).head_ms == HEAD_SHARE * t.head_ms_batch


def test_measure_parts_times_the_forward_the_stage_serves_with(tiny_model_dir, monkeypatch):
    """Start-up timing runs a layer as the stage will (the fused C block on a CPU with
    float32 activations): timing the torch forward instead misjudged a layer against the
    head, and placement gave the supernode too many layers."""
    from shards import rowops
    from shards.engine import measure_parts

    if rowops.library_for(torch.device("cpu"), torch.float32) is None:
        pytest.skip("no C compiler: the stage runs the torch forward, and so does the timing")
    calls = []
    real = rowops.block
    monkeypatch.setattr(rowops, "block", lambda *a, **k: calls.append(1) or real(*a, **k))
    measure_parts(tiny_model_dir, "cpu", "float32", batch=2, budget_s=0.02)
    assert calls, "the layer was timed on the torch forward"
