"""GET /metrics on two real nodes linked over loopback, parsed as Prometheus parses it."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.daemon import running_node

pytestmark = pytest.mark.asyncio(loop_scope="module")
GiB = 1 << 30


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tiny_model_dir, tmp_path_factory):
    """A supernode (more VRAM advertised) and a second peer that dials it, one mesh secret."""
    secret = tmp_path_factory.mktemp("secret") / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    async with running_node(tiny_model_dir, tmp_path_factory.mktemp("sup"), name="sup",
                            advertise_vram=8 * GiB, secret_file=secret) as sup:
        port = sup.url.rsplit(":", 1)[1]
        async with running_node(tiny_model_dir, tmp_path_factory.mktemp("peer"), name="peer",
                                advertise_vram=4 * GiB, peer=(f"127.0.0.1:{port}",), secret_file=secret) as peer:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # both linked, one plan, pings measured
                links = [sup.node.view.links.get(peer.node.node_id), peer.node.view.links.get(sup.node.node_id)]
                if all(link is not None and link.rtt_ms is not None for link in links) and peer.node.uplink.serves():
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the two nodes did not link and serve")
            yield sup, peer


async def scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
            ctype = resp.headers["Content-Type"]
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return ctype, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def post(url: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.read()


async def test_metrics_count_what_happened(pair):
    sup, peer = pair
    _, before = await scrape(sup.url)
    tokens_before = before.get(("meshd_tokens_generated_total", ()), 0.0)

    status, body = await post(sup.url, {"prompt": "Metrics", "max_tokens": 8, "temperature": 0, "stop": []})
    assert status == 200
    n1 = json.loads(body)["usage"]["completion_tokens"]
    status, raw = await post(peer.url, {"prompt": "Metrics, streamed", "max_tokens": 6, "temperature": 0,
                                        "stream": True, "stop": []})  # through the other peer: proxied
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    n2 = sum(len(c["token_ids"]) for line in raw.decode().split("\n\n") if line.startswith("data: {")
             for c in json.loads(line[6:])["choices"])
    bad, _ = await post(sup.url, {"prompt": "x", "max_tokens": -1})
    assert bad == 400

    ctype, m = await scrape(sup.url)
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    assert value(m, "meshd_tokens_generated_total") - tokens_before == n1 + n2 > 0
    assert value(m, "meshd_requests_total", route="/v1/completions", status="200") >= 1
    # the proxied one reached the supernode as the entry peer's typed request
    assert value(m, "meshd_requests_total", route="/mesh/generate", status="200") >= 1
    assert value(m, "meshd_requests_total", route="/v1/completions", status="400") >= 1
    assert value(m, "meshd_time_to_first_token_seconds_count") >= 2
    assert value(m, "meshd_time_to_first_token_seconds_sum") > 0
    assert value(m, "meshd_token_latency_seconds_count") >= n1 + n2 - 2
    assert value(m, "meshd_plan_term") >= 1
    assert value(m, "meshd_is_supernode") == 1 and value(m, "meshd_serving") == 1
    assert value(m, "meshd_peers", state="ready") == 2 and value(m, "meshd_peers", state="lost") == 0
    pid = peer.node.node_id
    assert 0 < value(m, "meshd_link_rtt_seconds", peer=pid) < 1
    assert value(m, "meshd_link_sent_bytes_total", peer=pid) > 0
    assert value(m, "meshd_link_received_bytes_total", peer=pid) > 0
    assert value(m, "meshd_memory_bytes", kind="rss") > 10 << 20
    assert value(m, "meshd_memory_total_bytes", kind="ram") > 0

    # The stages: every layer ran somewhere, and each peer counts only its own span.
    _, p = await scrape(peer.url)
    spans = {a.node: len(a.span) for a in sup.node.view.plan.assignments}
    forwarded = value(m, "meshd_stage_forward_tokens_total") + value(p, "meshd_stage_forward_tokens_total")
    assert forwarded > 0
    for node, samples in ((sup.node, m), (peer.node, p)):
        calls = value(samples, "meshd_stage_forward_seconds_count")
        assert (calls > 0) == (node.node_id in spans), (node.node_id, spans, calls)
        assert value(samples, "meshd_span_layers") == spans.get(node.node_id, 0)
    # One registry per node: the peer generated nothing itself.
    assert value(p, "meshd_tokens_generated_total") == 0
    assert value(p, "meshd_is_supernode") == 0


async def test_status_shows_memory_and_rates(pair):
    sup, _ = pair
    await post(sup.url, {"prompt": "Rate", "max_tokens": 8, "temperature": 0})
    async with aiohttp.ClientSession() as http:
        async with http.get(sup.url + "/status") as resp:
            me = (await resp.json())["node"]
    assert me["memory"]["rss"] > 10 << 20
    assert me["memory"]["vram_used"] is None  # a CPU peer
    assert me["tokens_per_s"] > 0


async def test_a_chats_next_turn_shows_as_a_prefix_cache_hit(pair):
    sup, peer = pair
    _, before = await scrape(sup.url)
    prompt = "A chat whose first turn is long enough to be worth keeping"
    status, body = await post(peer.url, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert status == 200
    turn2 = prompt + json.loads(body)["choices"][0]["text"] + " and then?"
    status, _ = await post(peer.url, {"prompt": turn2, "max_tokens": 4, "temperature": 0})
    assert status == 200
    _, m = await scrape(sup.url)
    hits = value(m, "meshd_prefix_cache_hits_total") - before.get(("meshd_prefix_cache_hits_total", ()), 0.0)
    saved = (value(m, "meshd_prefix_cache_tokens_saved_total")
             - before.get(("meshd_prefix_cache_tokens_saved_total", ()), 0.0))
    assert hits == 1 and saved >= 16, (hits, saved)
    assert value(m, "meshd_prefix_cache_entries") >= 1 and value(m, "meshd_prefix_cache_tokens") > 0
    async with aiohttp.ClientSession() as http:
        async with http.get(sup.url + "/status") as resp:
            shown = (await resp.json())["node"]["scheduler"]["prefix_cache"]
    assert shown["hits"] == value(m, "meshd_prefix_cache_hits_total") and shown["tokens_saved"] >= saved
