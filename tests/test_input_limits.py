"""A client's inputs and resource use, as the review attacked them, against real daemons:

- 1,100 idle connections (half of them stopped mid-headers) to a ``meshd run`` started
  with the common soft limit of 1024 open files: /healthz answers throughout (within a
  health probe's 5 s: a daemon that ran out of files or accepts would not answer at all),
  the oldest idle connections are closed for new ones, and no traceback is logged;
- deeply nested JSON and a 5000-digit integer: 400 with OpenAI's error shape, not 500;
- one client cannot hold the whole KV budget: its second request waits (503) while
  another client's is admitted; through an entry peer too (the client it serves for
  travels over the sealed tunnel), and a request that names a client in X-Meshd-Client
  without coming through the tunnel is counted as itself;
- a prompt longer than the context could hold is refused before tokenizing, and long
  prompts being tokenized leave /healthz answering within 1 s (on the real model).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import time
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from structlog.testing import capture_logs

from meshd.control.store import STAGE_KV_SHARE
from meshd.control.tunnel import CLIENT_HEADER, TUNNEL_HEADER
from meshd.serving.served import KV_SHARE
from meshd.serving.scheduler import kv_bytes_per_token
from protocol.messages import Assignment, NodeId
from shards.layers import KVCache
from shards.manifest import Manifest
from shards.span import Span
from tests.fixtures.api import assert_error_body
from tests.fixtures.daemon import http_get, linked_pair, running_daemon, running_node

IDLE = 1100
PROBE_S = 5.0  # a health probe's timeout; a loaded CI box took 1.007 s once, a hang never ends


def healthz_seconds(url: str) -> float:
    t0 = time.monotonic()
    status, _ = http_get(url + "/healthz", timeout=PROBE_S)
    took = time.monotonic() - t0
    assert status == 200 and took < PROBE_S, (status, took)
    return took


@contextlib.contextmanager
def nofile_soft(limit: int):
    """This process's soft open-files limit at ``limit`` (children inherit it), then back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_leave_healthz_answering(tiny_model_dir, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < IDLE + 200:
        pytest.skip(f"the hard open-files limit {hard} is below {IDLE + 200}")
    with nofile_soft(1024):  # what the daemon starts with; it raises its own
        ctx = running_daemon(tiny_model_dir, tmp_path / "state", tmp_path / "meshd.log", "--max-connections", "512")
        served = ctx.__enter__()
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks: list[socket.socket] = []
    try:
        port = int(served.url.rsplit(":", 1)[1])
        worst = 0.0
        for i in range(IDLE):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:  # a slowloris: headers begun, never finished
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(s)
            if i % 100 == 99:
                worst = max(worst, healthz_seconds(served.url))
        for _ in range(5):
            worst = max(worst, healthz_seconds(served.url))
        # The oldest idle ones were closed to make room (the server hung up on them).
        closed = 0
        for s in socks[:200]:
            s.settimeout(0.2)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                closed += s.recv(64) == b""
        assert closed >= 100, f"only {closed} of the oldest 200 idle connections were closed"
        assert served.proc.poll() is None
        text = served.log_path.read_text(errors="replace")
        assert "Traceback" not in text and "Too many open files" not in text, text[-3000:]
        assert "connections_evicted" in text
        nofile = int(open(f"/proc/{served.proc.pid}/limits").read().split("Max open files")[1].split()[0])
        assert nofile > 1024, "the daemon should raise its soft limit toward the hard one"
    finally:
        for s in socks:
            s.close()
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("raw, what", [
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "digit"),
    (b'{"prompt": "x", "a": ' + b"[" * 65 + b"]" * 65 + b"}", "nested"),
], ids=["deep-array", "long-number", "nested-field"])  # an id of the body itself (200 KB) went into
# PYTEST_CURRENT_TEST and past the kernel's limit on one environment string: the daemon could not start
def test_malformed_bodies_are_400_with_the_error_shape(tiny_daemon, raw, what):
    import json
    import urllib.request

    req = urllib.request.Request(tiny_daemon.url + "/v1/completions", raw, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("a malformed body was served")
    except urllib.error.HTTPError as exc:
        status, data = exc.code, json.loads(exc.read())
    assert status == 400, (status, data)
    assert_error_body(data)
    assert what in data["error"]["message"], data
    assert http_get(tiny_daemon.url + "/healthz")[0] == 200


@pytest.mark.asyncio(loop_scope="function")
async def test_one_client_cannot_hold_the_whole_kv_budget(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    # Three cache chunks: a request of up to 256 positions holds one (kvbudget.charge).
    async with running_node(tiny_model_dir, tmp_path / "state", kv_budget_tokens=3 * KVCache.CHUNK, api_key_file=keys,
                            debug_layer_delay_ms=5.0) as served, aiohttp.ClientSession() as http:
        def body(n: int, stream: bool = False) -> dict:
            return {"prompt": "A mesh of small machines", "max_tokens": n, "temperature": 0, "stream": stream}

        a = {"Authorization": "Bearer key-a"}
        async with http.post(served.url + "/v1/completions", json=body(150, True), headers=a) as first:
            assert first.status == 200
            await first.content.readline()  # its session is admitted and running
            assert served.node.scheduler.reserved_tokens > 150
            # Client A again: two chunks of three would fit the budget, not half of it.
            async with http.post(served.url + "/v1/completions", json=body(50), headers=a) as second:
                data = await second.json()
                assert second.status == 503, data
                assert_error_body(data)
                assert "this client holds" in data["error"]["message"]
            # Client B still gets in.
            async with http.post(served.url + "/v1/completions", json=body(4),
                                 headers={"Authorization": "Bearer key-b"}) as other:
                data = await other.json()
                assert other.status == 200, data
                assert len(data["choices"][0]["token_ids"]) > 0
        # The client hung up on its stream: what it held is free again.
        deadline = time.monotonic() + 10
        while served.node.scheduler.reserved_by and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert served.node.scheduler.reserved_by == {} and served.node.scheduler.reserved_tokens == 0


def from_address(ip: str) -> aiohttp.ClientSession:
    """A client whose connections come from ``ip`` (any of 127.0.0.0/8 is this host)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(ip, 0)))


@pytest.mark.asyncio(loop_scope="function")
async def test_fairness_counts_the_client_an_entry_peer_serves_and_no_claimed_one(tiny_model_dir, tmp_path):
    """Client A (127.0.0.2) streams through the entry peer and holds its share of the
    supernode's KV budget. The supernode counts it as A, not as the tunnel's loopback
    caller: A's next request through the entry waits (503) while B (127.0.0.3) through
    the same entry gets in. Straight to the supernode, X-Meshd-Client (with no tunnel
    token, or a wrong one) is not believed: A calling itself someone else still waits,
    and B calling itself A still gets in."""
    a_id, b_id = "addr:127.0.0.2", "addr:127.0.0.3"
    async with linked_pair(tiny_model_dir, tmp_path, kv_budget_tokens=3 * KVCache.CHUNK,
                           debug_layer_delay_ms=5.0) as (sup, entry), \
            from_address("127.0.0.2") as a, from_address("127.0.0.3") as b:
        reserved = sup.node.scheduler.reserved_by

        def body(n: int, stream: bool = False) -> dict:
            return {"prompt": "A mesh of small machines", "max_tokens": n, "temperature": 0, "stream": stream}

        async def refused(http: aiohttp.ClientSession, url: str, headers: dict | None = None) -> None:
            async with http.post(url + "/v1/completions", json=body(50), headers=headers) as resp:
                data = await resp.json()
                assert resp.status == 503, (headers, data)
                assert_error_body(data)
                assert "this client holds" in data["error"]["message"], data

        async def admitted(http: aiohttp.ClientSession, url: str, headers: dict | None = None) -> None:
            async with http.post(url + "/v1/completions", json=body(4), headers=headers) as resp:
                data = await resp.json()
                assert resp.status == 200, (headers, data)
                assert len(data["choices"][0]["token_ids"]) > 0

        async with a.post(entry.url + "/v1/completions", json=body(150, True)) as first:
            assert first.status == 200
            await first.content.readline()  # admitted and running on the supernode
            assert reserved.get(a_id, 0) > 150, reserved  # the entry's client, over the tunnel
            assert "addr:127.0.0.1" not in reserved, reserved  # not the tunnel's loopback call
            await refused(a, entry.url)
            await admitted(b, entry.url)
            for forged in ({CLIENT_HEADER: b_id}, {CLIENT_HEADER: b_id, TUNNEL_HEADER: "0" * 64}):
                await refused(a, sup.url, forged)  # counted under its own address: still A
                await admitted(b, sup.url, forged | {CLIENT_HEADER: a_id})  # B is not made A
            assert set(k for k in reserved if isinstance(k, str)) == {a_id}, reserved
        # A hung up at the entry: the supernode's session was cancelled through the link.
        deadline = time.monotonic() + 10
        while reserved and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert reserved == {} and sup.node.scheduler.reserved_tokens == 0


@pytest.mark.asyncio(loop_scope="function")
async def test_long_prompts_are_bounded_and_tokenized_off_the_loop(real_model_dir, tmp_path):
    async with running_node(real_model_dir, tmp_path / "state") as served, aiohttp.ClientSession() as http:
        tokenizer, context = served.node.serving_parts()
        bound = context * tokenizer.max_token_chars
        words = "hello world the quick brown fox jumps over the lazy dog "

        async def post(chars: int) -> tuple[int, dict]:
            prompt = (words * (chars // len(words) + 1))[:chars]
            async with http.post(served.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
                return r.status, await r.json()

        # Over the bound: refused at once, the tokenizer never sees it.
        t0 = time.monotonic()
        status, data = await post(bound + 1)
        assert status == 400 and "characters" in data["error"]["message"], data
        assert time.monotonic() - t0 < 1.0
        # Under it: tokenized (then refused for its length in tokens) while /healthz answers.
        posts = asyncio.gather(*(post(bound - 16) for _ in range(3)))
        worst = 0.0
        while not posts.done():
            t0 = time.monotonic()
            async with http.get(served.url + "/healthz") as r:
                assert r.status == 200
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.05)
        results = await posts
        assert all(s == 400 and d["error"]["code"] == "context_length_exceeded" for s, d in results), results
        assert worst < 1.0, f"/healthz took {worst:.2f} s while prompts were tokenized"


@pytest.mark.netns
@pytest.mark.xdist_group("tiny_mesh")  # the session's one four-daemon mesh (tests/fixtures/workers.py)
def test_control_endpoints_answer_only_this_host_without_a_key(tiny_mesh):
    """No key configured: a drain from another box (pytest, across the bridge) is refused,
    a foreign page's text/plain POST too; the same drain from the peer's own box gets in."""
    import json
    import urllib.request

    from tests.meshlab import http_json_from

    target = tiny_mesh.daemons[1]

    def drain_terms() -> list[int]:
        return [t["term"] for t in tiny_mesh.daemons[0].status()["terms"] if t["reason"].startswith("drain")]

    drains = drain_terms()
    url = target.url + "/v1/mesh/drain"
    body = {"node": "no-such-node"}
    for ctype, want in (("application/json", 403), ("text/plain", 415)):
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": ctype})
        try:
            urllib.request.urlopen(req, timeout=10)
            raise AssertionError(f"a {ctype} drain from another host got in")
        except urllib.error.HTTPError as exc:
            status, data = exc.code, json.loads(exc.read())
        assert status == want, (ctype, status, data)
        assert_error_body(data)
    status, data = http_json_from(target.host, url, body)
    assert status == 404 and "no-such-node" in data["error"]["message"], (status, data)
    # Nothing was drained (the plan itself may have been rebalanced meanwhile: not a drain).
    assert drain_terms() == drains
    peers = tiny_mesh.daemons[0].status()["peers"]
    assert all(p["state"] not in ("draining", "drained") for p in peers), peers


def test_an_ipv6_client_is_one_client_across_its_64():
    """A host on IPv6 holds a whole /64 (privacy addresses: a new one whenever it likes), so
    counting shares per address would give it as many KV shares as it cares to use. Its
    requests count as its /64; another /64, and IPv4 clients, stay apart; an IPv4-mapped
    address is the IPv4 client it maps."""
    from aiohttp.test_utils import make_mocked_request

    from meshd.serving.guards import client_id

    def from_(remote: str) -> str:
        transport = SimpleNamespace(get_extra_info=lambda name, default=None:
                                    (remote, 40000) if name == "peername" else default)
        return client_id(make_mocked_request("POST", "/v1/completions", transport=transport), False, None)

    one = {from_(f"2001:db8:1:2:{i:x}::{i:x}") for i in range(1, 200)}
    assert one == {"addr:2001:db8:1:2::/64"}
    assert from_("2001:db8:1:3::1") == "addr:2001:db8:1:3::/64"
    assert from_("::ffff:192.0.2.7") == from_("192.0.2.7") == "addr:192.0.2.7"
    assert from_("192.0.2.8") != from_("192.0.2.7")


async def test_the_kv_budget_is_what_the_tightest_stage_of_the_plan_holds(tiny_model_dir, tmp_path):
    """With no budget configured, a plan over two peers admits what the stage with the least
    KV room holds (a quarter of its peer's memory over its own layers' KV bytes a position),
    recomputed at each plan; this peer alone holding every layer, what its memory holds for
    all of them."""
    async with running_node(tiny_model_dir, tmp_path / "state") as served:
        node = served.node
        config = Manifest.load(tiny_model_dir).config
        per_layer = kv_bytes_per_token(config, torch.float32) // config.n_layers
        mine = int(node.view.caps.mem_budget * KV_SHARE)
        alone = node.scheduler.kv_budget_tokens
        assert alone == max(config.max_position, mine // (config.n_layers * per_layer))
        plan = node.pipeline.plan
        small = node.view.caps.mem_budget // 64  # a peer with 1/64 of this one's memory
        other = NodeId("other")
        node.view.links[other] = SimpleNamespace(caps=SimpleNamespace(mem_budget=small), alive=False)  # (no link: its caps)
        try:
            split = (Assignment(node.node_id, Span(0, 2)), Assignment(other, Span(2, config.n_layers)))
            await node.pipeline.serve(plan.term + 1, split, {node.node_id: plan.runners[node.node_id],
                                                             other: plan.runners[node.node_id]})
            tight = int(small * KV_SHARE) // ((config.n_layers - 2) * per_layer)
            assert node.scheduler.kv_budget_tokens == max(config.max_position, min(mine // (2 * per_layer), tight))
            assert node.scheduler.kv_budget_tokens < alone
        finally:
            del node.view.links[other]
            await node.pipeline.serve(plan.term + 2, plan.assignments, dict(plan.runners))
        assert node.scheduler.kv_budget_tokens == alone


async def test_a_configured_kv_budget_is_held_to_what_the_stages_can_hold(tiny_model_dir, tmp_path):
    """A configured budget past what the plan's stages hold in their own share of memory
    (``STAGE_KV_SHARE``: past it a stage refuses the step) admits only that much, and says
    so in the log; one within it stands as configured."""
    config = Manifest.load(tiny_model_dir).config
    per_position = kv_bytes_per_token(config, torch.float32)
    with capture_logs() as logs:
        async with running_node(tiny_model_dir, tmp_path / "big", kv_budget_tokens=10**15) as served:
            held = int(served.node.view.caps.mem_budget * STAGE_KV_SHARE) // per_position
            assert served.node.scheduler.kv_budget_tokens == max(config.max_position, held) < 10**15
    assert [e for e in logs if e.get("event") == "kv_budget_capped"]
    async with running_node(tiny_model_dir, tmp_path / "small", kv_budget_tokens=3 * KVCache.CHUNK) as served:
        assert served.node.scheduler.kv_budget_tokens == 3 * KVCache.CHUNK


async def test_a_stage_without_room_ends_that_request_with_a_503_and_the_peer_serves_on(tiny_model_dir, tmp_path):
    """A stage whose caches reach its own limit mid-answer (here its limit set below what
    the supernode admits, as a supernode of another mind would admit): that request ends
    with a 503 naming the stage's limit, not a 200 cut short; the plan stays (no re-plan)
    and the next request that fits is answered."""
    async with running_node(tiny_model_dir, tmp_path / "state", prefix_cache_entries=0) as served:
        node = served.node
        term = node.pipeline.plan.term
        node.store.engine.kv_limit = KVCache.CHUNK
        async with aiohttp.ClientSession() as http:
            long = {"prompt": "A mesh of small machines", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
            async with http.post(served.url + "/v1/completions", json=long) as resp:
                status, data = resp.status, await resp.json()
            assert status == 503 and "limit of 256" in data["error"]["message"], data
            assert_error_body(data)
            async with http.post(served.url + "/v1/completions", json=dict(long, max_tokens=8)) as resp:
                assert resp.status == 200 and len((await resp.json())["choices"][0]["token_ids"]) == 8
        assert node.pipeline.plan.term == term and node.store.engine.held_positions() == 0
