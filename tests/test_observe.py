"""Live figures and request timelines on two real in-process nodes linked over loopback
(no root needed): the supernode's timeline of a request an entry peer proxied, read at
the entry peer; the W3C trace context going through; /live relayed by the member.

The three-peer namespaced mesh, the browser and ``meshctl trace`` are in test_dashboard.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.daemon import linked_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tiny_model_dir, tmp_path_factory):
    """A supernode and an entry peer; a debug delay on both so each holds layers."""
    async with linked_pair(tiny_model_dir, tmp_path_factory.mktemp("observe"), debug_layer_delay_ms=5.0) as pair:
        sup, entry = pair
        deadline = time.monotonic() + 30
        while len(sup.node.view.plan.assignments) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(sup.node.view.plan.assignments) == 2, "both peers hold layers"
        yield pair


async def get_json(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as resp:
            return resp.status, await resp.json()


async def stream(url: str, prompt: str, max_tokens: int, headers: dict) -> tuple[float, dict, int]:
    """A streamed completion; (the client's wall time, the answer's headers, tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            raw = await resp.read()
            wall = time.monotonic() - began
            answer_headers = resp.headers.copy()
    tokens = sum(len(c["token_ids"]) for block in raw.decode().split("\n\n") if block.startswith("data: {")
                 for c in json.loads(block[6:])["choices"])
    return wall, answer_headers, tokens


async def test_a_proxied_requests_timeline_adds_up_across_both_peers(pair):
    sup, entry = pair
    rid = "obs-trace-1"
    wall, headers, tokens = await stream(entry.url, "A timeline of a mesh", 12, {
        "X-Request-Id": rid, "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert tokens == 12
    # The client's own trace id comes back, with the entry peer's span.
    m = TRACEPARENT.fullmatch(headers["traceparent"])
    assert m and m.group(1) == CLIENT_TRACE and m.group(2) != CLIENT_SPAN, headers["traceparent"]

    status, trace = await get_json(f"{entry.url}/traces/{rid}")
    assert status == 200, trace
    assert trace["trace_id"] == CLIENT_TRACE and trace["request_id"] == rid
    assert trace["supernode"] == sup.node.node_id and trace["entry"] == entry.node.node_id
    assert trace["parent_id"] == m.group(2)  # the supernode's span hangs under the entry peer's
    assert trace["completion_tokens"] == 12 and trace["status"] == 200
    kinds = {(p["kind"], p["peer"]) for p in trace["phases"]}
    for node in (sup.node.node_id, entry.node.node_id):
        assert ("stage", node) in kinds, kinds
    assert ("hop", entry.node.node_id) in kinds and ("proxy", entry.node.node_id) in kinds
    assert {"admit", "queue", "sample", "stream"} <= {k for k, _ in kinds}
    assert all(p["ms"] > 0 for p in trace["phases"]), trace["phases"]
    total = sum(p["ms"] for p in trace["phases"])
    assert abs(total - trace["wall_ms"]) <= 0.01 * trace["wall_ms"] + 0.01, (total, trace["wall_ms"])
    assert trace["wall_ms"] <= wall * 1000 and abs(trace["wall_ms"] - wall * 1000) <= 0.1 * wall * 1000, \
        (trace["wall_ms"], wall)
    # The stages' layers, in plan order.
    stages = [p for p in trace["phases"] if p["kind"] == "stage"]
    assert [p["peer"] for p in stages] == [a.node for a in sup.node.view.plan.assignments]
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] > stages[0]["layers"][1]
    assert trace["ttft_ms"] is not None and 0 < trace["ttft_ms"] < trace["wall_ms"]
    # By trace id too, and listed among the recent requests.
    status, same = await get_json(f"{sup.url}/traces/{CLIENT_TRACE}")
    assert status == 200 and same["request_id"] == rid
    status, listed = await get_json(f"{entry.url}/traces")
    assert status == 200 and rid in [r["request_id"] for r in listed["requests"]]


async def test_a_bad_traceparent_starts_a_new_trace(pair):
    sup, entry = pair
    for bad in ("00-" + "0" * 32 + "-" + CLIENT_SPAN + "-01", "ff-" + CLIENT_TRACE + "-" + CLIENT_SPAN + "-01",
                "00-" + CLIENT_TRACE.upper() + "-" + CLIENT_SPAN + "-01", "garbage"):
        _, headers, _ = await stream(sup.url, "Hi", 2, {"traceparent": bad})
        m = TRACEPARENT.fullmatch(headers["traceparent"])
        assert m and m.group(1) not in (CLIENT_TRACE, "0" * 32), (bad, headers["traceparent"])
        status, trace = await get_json(f"{sup.url}/traces/{headers['X-Request-Id']}")
        assert status == 200 and trace["trace_id"] == m.group(1) and trace["parent_id"] is None


async def test_unknown_and_malformed_trace_ids_are_4xx(pair):
    sup, entry = pair
    status, body = await get_json(f"{entry.url}/traces/no-such-request")
    assert status == 404 and body["error"]["param"] == "id"
    status, body = await get_json(f"{entry.url}/traces/bad%20id")
    assert status == 400 and "error" in body
    status, body = await get_json(f"{entry.url}/live?since=-1")
    assert status == 400 and "error" in body


async def test_live_at_the_entry_peer_is_the_supernodes(pair):
    sup, entry = pair
    await asyncio.gather(*(stream(entry.url, f"Live figures {i}", 16, {}) for i in range(3)))
    await asyncio.sleep(1.2)  # a sample after them
    status, live = await get_json(entry.url + "/live")
    assert status == 200
    assert live["source"] == sup.node.node_id and live["node"] == entry.node.node_id
    assert live["window_s"] == 900 and live["samples"]
    assert any(s["tokens_per_s"] > 0 for s in live["samples"]), live["samples"][-5:]
    peers = {}
    for s in live["samples"]:
        for pid, fig in s["peers"].items():
            if fig["stage_ms"] is not None:
                peers[pid] = fig
    assert set(peers) == {sup.node.node_id, entry.node.node_id}, live["samples"][-3:]
    assert peers[entry.node.node_id]["hop_ms"] > 0 and peers[sup.node.node_id]["hop_ms"] is None
    assert live["recent"] and live["recent"][0]["wall_ms"] > 0
    # Since a sequence number: only what came after it.
    last = live["seq"]
    await asyncio.sleep(1.1)
    status, later = await get_json(f"{entry.url}/live?since={last}")
    assert status == 200 and later["samples"] and all(s["seq"] > last for s in later["samples"])


async def test_metrics_show_the_pipeline_per_peer(pair):
    sup, entry = pair
    await stream(entry.url, "Metrics per peer", 4, {})  # its own traffic: a worker may run this test first
    async with aiohttp.ClientSession() as http:
        async with http.get(sup.url + "/metrics") as resp:
            text = await resp.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    peer = entry.node.node_id
    assert samples[("meshd_pipeline_seconds_total", (("part", "hop"), ("peer", peer)))] > 0
    assert samples[("meshd_pipeline_calls_total", (("peer", peer),))] > 0
    assert samples[("meshd_request_duration_seconds_count", ())] >= 1
    assert ("meshd_requests_running", ()) in samples and ("meshd_kv_budget_tokens", ()) in samples
    status, groups = await get_json(entry.url + "/metrics/targets")
    assert status == 200
    assert {g["labels"]["meshd_node"] for g in groups} == {sup.node.node_id, entry.node.node_id}
    assert all(len(g["targets"]) == 1 and ":" in g["targets"][0] for g in groups)
