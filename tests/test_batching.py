"""Continuous batching gives every session the tokens it would get alone.

Sessions join and leave the running batch at every step (staggered starts,
different lengths), on one node and across a namespaced 3-peer mesh; the
scheduler's step count shows the steps really were shared.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import aiohttp
import pytest

from tests.fixtures.daemon import running_node
from tests.meshlab import complete

PROMPTS = ["alpha beta", "the cat sat", "one two three four", "x", "hello there friend", "zz top"]
LENGTHS = [24, 8, 16, 30, 5, 20]
STAGGER_S = 0.06


async def _complete(http: aiohttp.ClientSession, url: str, prompt: str, n: int, delay: float = 0.0) -> list[int]:
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data["choices"][0]["token_ids"]


async def test_batched_equals_alone_with_sessions_joining_and_leaving(tiny_model_dir, tmp_path):
    # A small per-layer delay makes generations overlap, so sessions really share steps.
    async with running_node(tiny_model_dir, tmp_path / "state", debug_layer_delay_ms=2.0) as served:
        async with aiohttp.ClientSession() as http:
            alone = [await _complete(http, served.url, p, n) for p, n in zip(PROMPTS, LENGTHS)]
            steps_before = sum(lane.steps for lane in served.node.scheduler.lanes)
            together = await asyncio.gather(*(
                _complete(http, served.url, p, n, delay=i * STAGGER_S)
                for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))
            ))
            steps = sum(lane.steps for lane in served.node.scheduler.lanes) - steps_before
    for prompt, a, b in zip(PROMPTS, alone, together):
        assert b == a, f"{prompt!r}: batched {b} != alone {a}"
    generated = sum(len(t) for t in together)
    # Alone, every token is a step of its own; shared steps mean real batching.
    assert steps < generated * 0.75, f"{steps} steps for {generated} tokens: the sessions were not batched"


@pytest.mark.netns
def test_batched_across_a_namespaced_mesh(meshlab, tiny_model_dir):
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    daemons = [
        # No drafts: they shorten sessions by steps that a box's load decides (auto), and this
        # counts steps shared; speculation's exactness is tests/test_speculative.py's.
        meshlab.start(h, model=str(tiny_model_dir) if i == 0 else tiny_model_dir.name,
                      vram=(3 - i) * 10**9, layer_delay_ms=2.0, extra=("--speculate", "off"))
        for i, h in enumerate(hosts)
    ]
    view = meshlab.wait_converged(daemons, n_stages=2)
    supernode = view["supernode"]
    entry = next(d for d in daemons if d.node_id != supernode)
    alone = [complete(entry.url, p, n)[0] for p, n in zip(PROMPTS, LENGTHS)]
    shared_before = scheduler_stats(daemons, supernode)["shared_steps"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        def run(i: int) -> list[int]:
            time.sleep(i * STAGGER_S)
            return complete(entry.url, PROMPTS[i], LENGTHS[i])[0]

        together = list(pool.map(run, range(len(PROMPTS))))
    stats = scheduler_stats(daemons, supernode)
    for prompt, a, b in zip(PROMPTS, alone, together):
        assert b == a, f"{prompt!r}: batched {b} != alone {a}" + meshlab.fail_report()
    # Sessions are spread over one lane per stage, so count steps that carried
    # several sessions at once: those are the batches.
    shared = stats["shared_steps"] - shared_before
    assert stats["max_batch"] >= 2 and shared >= 5, f"{shared} shared steps, {stats}: not batched"


def scheduler_stats(daemons, supernode: str) -> dict:
    """The supernode's scheduler figures from its /status."""
    sn = next(d for d in daemons if d.node_id == supernode)
    return sn.status()["node"]["scheduler"]
