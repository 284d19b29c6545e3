"""Two peers with the real model split it by what its parts cost them, timed.

Each daemon times the model's real layer and head at start (Capabilities.measured) and
the supernode places on those timings: the head (final norm, lm_head, sampling) is about
nine layers' worth of work on SmolLM2-135M in a decode step (weighed at HEAD_SHARE: a
prefill pays it once per prompt), so the supernode keeps 11-13 of the 30 layers rather than
the 4 that a head priced at its bytes gave. Nothing here names a
split: the plan must be the balanced one for whatever the peers measured on this box.
"""

from __future__ import annotations

import time

import pytest

from meshd.control.placement import HEAD_SHARE, REBALANCE_MARGIN
from shards.manifest import Manifest
from tests.meshlab import complete, greedy_reference


@pytest.mark.netns
@pytest.mark.real_model
def test_two_peers_split_the_real_model_on_measured_stage_times(meshlab, real_model_dir):
    prompt, n = "The lighthouse keeper climbed the stairs and", 16
    hosts = [meshlab.lab.add_host() for _ in range(2)]
    daemons = [meshlab.start(h, model=str(real_model_dir), vram=(2 - i) * 10**9, extra=("--threads", "1"))
               for i, h in enumerate(hosts)]
    view = meshlab.wait_converged(daemons, n_stages=2, timeout=180)
    sup = next(d for d in daemons if d.node_id == view["supernode"])

    def weighed():
        """The plan, the timings and the two stages' ms as the supernode weighs them now."""
        status = sup.status()
        timing = {p["id"]: p["measured"] for p in status["peers"]}
        assert all(t is not None and t["layer_ms_batch"] > 0 for t in timing.values()), timing
        head = HEAD_SHARE * timing[sup.node_id]["head_ms_batch"]
        assert head > 0
        plan = {a["node"]: a["stop"] - a["start"] for a in status["plan"]}
        assert set(plan) == set(timing), status["plan"]
        other = next(p for p in plan if p != sup.node_id)
        hop = next(p["rtt_floor_ms"] or 0.0 for p in status["peers"] if p["id"] == other)
        mine = head + plan[sup.node_id] * timing[sup.node_id]["layer_ms_batch"]
        theirs = hop + plan[other] * timing[other]["layer_ms_batch"]
        return plan, timing, other, hop, head, mine, theirs

    # Balanced as the supernode promises it (placement.REBALANCE_MARGIN): the slower stage is
    # within the margin of the best split a brute force finds on the same timings, give or take
    # a layer and the hop (the plan was weighed on the round trips of its moment, which a loaded
    # box moves). The first plan may be weighed on the other peer's probe before its Accept
    # brings its real timings: the supernode then re-plans once, within seconds.
    n_layers = Manifest.load(real_model_dir).n_layers
    deadline = time.monotonic() + 60
    while True:
        plan, timing, other, hop, head, mine, theirs = weighed()
        assert sum(plan.values()) == n_layers, plan
        one_layer = max(t["layer_ms_batch"] for t in timing.values())
        best = min(max(head + k * timing[sup.node_id]["layer_ms_batch"],
                       hop + (n_layers - k) * timing[other]["layer_ms_batch"]) for k in range(1, n_layers))
        # The timings read now are not those the plan was weighed on: under a loaded suite they
        # moved by up to half (41.5 ms against a best of 28.6 in one CI run). A plan that is
        # not balanced at all (one stage with every layer) is still far outside this.
        slack = best * max(REBALANCE_MARGIN, 0.5) + one_layer + hop + 1e-6
        if max(mine, theirs) <= best + slack or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert max(mine, theirs) <= best + slack, (plan, timing, mine, theirs, best)
    # And the split model answers what one node answers.
    got, _ = complete(daemons[1].url, prompt, n)
    assert got == greedy_reference(real_model_dir, prompt, n), meshlab.fail_report()
