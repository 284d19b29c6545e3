"""A member of the mesh (it holds the secret) sends what the review sent: path-shaped and
out-of-range fields in every message type, a Plan whose model name is a path, a Plan
whose manifest says ``n_kv_heads: 0``, a Plan naming this peer's model with another
digest, and a Reject with a huge term. The peer is a real in-process node on loopback;
the attacker is pytest doing the real handshake, then frames by hand, and serving the
files a supernode serves from an aiohttp app of its own.

What must hold: each bad frame is refused (that link closed with 4002, or the plan
rejected), no file appears outside the state directory, the peer's own manifest and
shards are byte for byte what they were, and the node goes on: its task runs, /healthz
answers within 1 s, and once the attacker leaves it serves again. Its file endpoint
then refuses a shard that is a symlink.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path

import aiohttp
import msgpack
import pytest
import torch
from aiohttp import web

from meshd.control.peers import CLOSE_PROTOCOL
from meshd.control.transfer import AUTH_HEADER, files_path, files_token
from meshd.errors import PeerLost, ProtocolError
from meshd.node import Node
from protocol.codec import decode, encode
from protocol.messages import (
    MAX_TERM,
    Accept,
    ApiCancel,
    ApiReply,
    ApiRequest,
    Assignment,
    Bye,
    Capabilities,
    Commit,
    Drop,
    Fail,
    ForwardBatch,
    Hello,
    NodeId,
    Ping,
    Plan,
    Pong,
    Reject,
    RejectCode,
    ResultBatch,
    Segment,
    SessionId,
)
from shards.manifest import MANIFEST_FILE, Manifest
from shards.span import Span
from shards.wire import to_wire
from tests.fixtures.daemon import free_port, running_node
from tests.sealed import sealed_peer

GiB = 1 << 30
HUGE = 2**64 - 1


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class Attacker:
    """pytest as a member: a link to the node, and an HTTP server where the node fetches
    manifests and shard files from (``files``: name -> bytes)."""

    def __init__(self, url: str, secret: bytes, vram: int):
        self.url, self.secret, self.vram = url, secret, vram
        self.node_id = NodeId("f" + secrets.token_hex(5))
        self.files: dict[tuple[str, str], bytes] = {}
        self.port = free_port()

    async def serve_files(self) -> web.AppRunner:
        async def handler(request: web.Request) -> web.Response:
            body = self.files.get((request.match_info["model"], request.match_info["name"]))
            return web.Response(body=body) if body is not None else web.Response(status=404)

        app = web.Application()
        app.router.add_get("/mesh/files/{model}/{name}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner

    def link(self, http: aiohttp.ClientSession):
        """A sealed link as this member (the real Noise handshake): a ``SealedPeer``."""
        return sealed_peer(http, self.url, self.secret, vram=self.vram, node_id=self.node_id, api_port=self.port)


async def healthz_within_1s(http: aiohttp.ClientSession, url: str) -> int:
    t0 = time.monotonic()
    async with http.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
        assert time.monotonic() - t0 < 1.0
        return resp.status


def member_token(secret: bytes, path: str) -> dict[str, str]:
    """A shard-file request's single-use token, as a member of the mesh makes one."""
    return {AUTH_HEADER: files_token(secret, "pytest-member", path)}


def tampered(msg, **fields) -> bytes:
    frame = msgpack.unpackb(encode(msg), raw=False)
    frame.update(fields)
    return msgpack.packb(frame, use_bin_type=True)


def bad_frames(outside: Path) -> list[tuple[str, bytes]]:
    """Every message type a member may send after the handshake, each with a path-shaped
    and an out-of-range value in its fields."""
    path = str(outside / "pwned")
    hidden = to_wire(torch.zeros(1, 4))
    seg = Segment(SessionId("s1"), 0, 1)
    plan = Plan(1, NodeId("a"), "tiny", "ab" * 32, (Assignment(NodeId("a"), Span(0, 1)),))
    caps = Capabilities(vram=1, ram=1, device="cpu", api_port=1, mem_budget=1, layer_ms=1.0, models=("tiny",))
    samples = [Hello(1, NodeId("a"), "home", "n", caps),
               Plan(1, NodeId("a"), "tiny", "ab" * 32, (Assignment(NodeId("a"), Span(0, 1)),)),
               Accept(1, Span(0, 1)), Reject(1, "no"), Commit(1), ForwardBatch(1, 1, (seg,), hidden),
               ResultBatch(1, 1, hidden), Fail(1, 1, "x"), Drop(1, SessionId("s1")), Bye("x"), Ping(1, 1.0),
               Pong(1, 1.0), ApiRequest(1, "POST", "/v1/completions", b"{}", "Bearer k", "c"),
               ApiReply(1, 200, b"{}", 1), ApiCancel(1)]
    out = []
    for msg in samples:
        frame = msgpack.unpackb(encode(msg), raw=False)
        for key, value in frame.items():
            if key == "t":
                continue
            if isinstance(value, int):
                out += [(f"{msg.tag}.{key}={HUGE}", tampered(msg, **{key: HUGE})),
                        (f"{msg.tag}.{key}=-1", tampered(msg, **{key: -1}))]
            elif isinstance(value, str):
                out.append((f"{msg.tag}.{key}=path", tampered(msg, **{key: "../../../.." + path})))
    out += [
        ("plan.model=../", tampered(plan, model="../../../.." + path)),
        ("plan.model=abs", tampered(plan, model=path)),
        ("plan.span=huge", tampered(plan, assignments=[{"node": "a", "span": [0, HUGE]}])),
        ("fwdb.segment.start=huge", tampered(ForwardBatch(1, 1, (seg,), hidden),
                                             segments=[{"session": "s1", "start": 2**40, "rows": 1}])),
        ("fwdb.session=path", tampered(ForwardBatch(1, 1, (seg,), hidden),
                                       segments=[{"session": "x" * 4096, "start": 0, "rows": 1}])),
        ("reject.held_term=huge", tampered(Reject(1, "stale", code=RejectCode.STALE_TERM), held_term=HUGE)),
        ("hello.caps.models=path", tampered(samples[0], caps=dict(msgpack.unpackb(encode(samples[0]))["caps"],
                                                                 models=["../../x"]))),
        ("hello.caps.layer_ms=-1", tampered(samples[0], caps=dict(msgpack.unpackb(encode(samples[0]))["caps"],
                                                                 layer_ms=-1.0))),
        ("fwdb.hidden=int64", encode(ForwardBatch(1, 1, (seg,), to_wire(torch.zeros(1, 4, dtype=torch.int64))))),
    ]
    return out


def test_codec_refuses_path_names_and_out_of_range_values(tmp_path):
    """The protocol layer is where they stop: each typed field's bad value is a ProtocolError."""
    refused = [name for name, raw in bad_frames(tmp_path) if _refused(raw)]
    must = [n for n, _ in bad_frames(tmp_path)
            if n.endswith(f"={HUGE}") or n.endswith("=-1") or n.startswith(("plan.", "reject.held", "hello.caps"))
            or n.startswith("fwdb.") and n != "fwdb.hidden=int64"]
    assert set(must) <= set(refused), sorted(set(must) - set(refused))


def _refused(raw: bytes) -> bool:
    try:
        decode(raw)
    except ProtocolError:
        return True
    return False


@pytest.fixture(scope="module")
def own_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model where a named model lives: ``<state>/models/<name>``."""
    state = tmp_path_factory.mktemp("victim-state")
    name = Manifest.load(tiny_model_dir).name
    shutil.copytree(tiny_model_dir, state / "models" / name)
    return state / "models" / name


@pytest.mark.asyncio(loop_scope="module")
async def test_a_member_sending_bad_values_ends_nothing_and_writes_nothing(own_model, tmp_path):
    state = own_model.parent.parent
    outside = tmp_path / "outside"
    outside.mkdir()
    own_before = tree_digest(own_model)
    manifest = Manifest.load(own_model)
    async with running_node(own_model, state) as served, aiohttp.ClientSession() as http:
        node = served.node
        # 1. Every message type, each field bad, one link each: refused or harmless.
        quiet = Attacker(served.url, node.secret, vram=0)
        closed = 0
        for name, raw in bad_frames(outside):
            async with quiet.link(http) as wire:
                await wire.send_raw(raw)
                await wire.send(Ping(1, 1.0))  # a live link answers it
                reply = await wire.reply()
                if reply is None:
                    closed += 1
                    assert wire.ws.close_code in (CLOSE_PROTOCOL, 4005), (name, wire.ws.close_code)
            assert not served.task.done(), f"{name} ended the node"
            assert await healthz_within_1s(http, served.url) in (200, 503), name
        assert closed >= len(bad_frames(outside)) // 2
        assert not any(outside.iterdir()), list(outside.iterdir())
        assert node.view.term < 1000, "a refused frame moved the term"

        # 2. The attacker becomes supernode (most VRAM) and sends plans.
        evil = Attacker(served.url, node.secret, vram=64 * GiB)
        runner = await evil.serve_files()
        try:
            async with evil.link(http) as wire:
                deadline = time.monotonic() + 15
                while node.view.supernode != evil.node_id and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert node.view.supernode == evil.node_id
                layers = Span(0, manifest.n_layers)

                def plan(term: int, model: str, digest: str) -> Plan:
                    return Plan(term, evil.node_id, model, digest, (Assignment(node.node_id, layers),),
                                sources=(evil.node_id,))

                # 2a. n_kv_heads 0: the stage stopped on a ZeroDivisionError before.
                cfg = json.loads(manifest.to_bytes())
                cfg["config"]["n_kv_heads"] = 0
                zero = json.dumps(cfg).encode()
                evil.files[(manifest.name, MANIFEST_FILE)] = zero
                term = node.view.term + 1
                await wire.send(plan(term, manifest.name, hashlib.sha256(zero).hexdigest()))
                reply = await wire.reply(20)
                assert isinstance(reply, Reject) and reply.code is RejectCode.CANNOT_LOAD, reply
                assert "n_kv_heads" in reply.reason, reply.reason  # the fetch's error travels in the reason

                # 2b. This peer's model by name, another digest: other weights of the same
                # sizes. It overwrote the peer's own manifest and shards in place before.
                other = json.loads(manifest.to_bytes())
                other["chat_template"] = "{{ 'substituted' }}"
                for fname, entry in other["files"].items():
                    junk = os.urandom(entry["size"])
                    evil.files[(manifest.name, fname)] = junk
                    entry["sha256"] = hashlib.sha256(junk).hexdigest()
                raw = json.dumps(other).encode()
                evil.files[(manifest.name, MANIFEST_FILE)] = raw
                digest = hashlib.sha256(raw).hexdigest()
                await wire.send(plan(term + 1, manifest.name, digest))
                reply = await wire.reply(30)
                assert isinstance(reply, Reject) and reply.code is RejectCode.CANNOT_LOAD, reply  # junk shards
                assert tree_digest(own_model) == own_before, "the peer's own model was changed"
                fetched = state / "models" / ".by-digest" / digest
                assert (fetched / MANIFEST_FILE).read_bytes() == raw  # kept apart, by its digest

                # 2c. A path for a name and a term at the bound: refused, nothing written.
                await wire.send_raw(tampered(plan(term + 2, manifest.name, digest), model=str(outside / "x")))
                assert await wire.reply() is None and wire.ws.close_code == CLOSE_PROTOCOL
            assert not any(outside.iterdir())
            assert not served.task.done()
            assert await healthz_within_1s(http, served.url) in (200, 503)
            # An unasked Reject naming the highest term leaves the term alone.
            async with quiet.link(http) as wire:
                await wire.send(Reject(1, "stale", code=RejectCode.STALE_TERM, held_term=MAX_TERM))
                await wire.send(Ping(2, 1.0))
                assert isinstance(await wire.reply(), Pong)
            assert node.view.term < MAX_TERM
        finally:
            await runner.cleanup()
        # 3. The attacker gone, the node leads again and serves.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and await healthz_within_1s(http, served.url) != 200:
            await asyncio.sleep(0.1)
        assert await healthz_within_1s(http, served.url) == 200
        assert not served.task.done()
        assert tree_digest(own_model) == own_before

        # 4. The file endpoint sends regular files only: a manifest-listed name that is a
        # symlink (to anything this process may read) is refused, even to a member.
        name = sorted(manifest.files)[0]
        real = own_model / name
        kept = own_model.parent / (name + ".kept")
        real.rename(kept)
        real.symlink_to(kept)
        try:
            path = files_path(manifest.name, name)
            async with http.get(served.url + path, headers=member_token(node.secret, path)) as resp:
                assert resp.status == 403, resp.status
            path = files_path(manifest.name, MANIFEST_FILE)
            async with http.get(served.url + path, headers=member_token(node.secret, path)) as resp:
                assert resp.status == 200 and await resp.read() == manifest.to_bytes()
        finally:
            real.unlink()
            kept.rename(real)
    assert tree_digest(own_model) == own_before


async def test_a_message_that_arrives_while_the_node_stops_closes_its_link_quietly():
    """Work a message asks for once the node's group is shutting down (a member's tunnelled
    request during the stop) is a PeerLost, which closes that one link, not a RuntimeError
    logged as a failed message with a coroutine never awaited."""
    node = Node.__new__(Node)  # only the group matters to spawn
    async with asyncio.TaskGroup() as group:
        pass
    node._tg = group

    async def work() -> None:
        raise AssertionError("must not run")

    coro = work()
    with pytest.raises(PeerLost, match="stopping"):
        node.spawn(coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning
