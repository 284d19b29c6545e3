"""Hostile frames on a live link: a real node's ``/mesh/ws`` on loopback, pytest as the peer.

One in-process node on the tiny model (its own supernode, all layers) with a 1 MiB frame
limit. Before the Noise handshake is done nothing is acted on and nothing is told: a
ForwardBatch, a Plan or a Hello in place of the first handshake message, a text frame, a
wrong secret, another mesh name or protocol version, a first message replayed from an
earlier connection (answered, but the answer is useless and the confirmation cannot be
made), a reflected answer, silence, a frame over the pre-authentication limit: each closes
that socket (4001, or 1009 for the size) with a logged reason and runs nothing. After a good
handshake: pieces that do not open (injected, replayed) are dropped and the link goes on;
oversize frames, dtypes off the list, tensors whose bytes do not match their shape, unknown
tags, a ForwardBatch whose rows are not its hidden's, close that link alone (logged); a
ForwardBatch of a term the node is not at, or for a session the stage never saw (start > 0),
or of the wrong width, is answered by Fail and nothing else changes. After every case the
node still serves the same greedy completion as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import aiohttp
import msgpack
from noise.connection import NoiseConnection
import pytest
import pytest_asyncio
import torch
from structlog.testing import capture_logs

from meshd.control.peers import CLOSE_AUTH, CLOSE_PROTOCOL
from meshd.control.secure import NOISE_PROTOCOL, WIRE_MAX, handshake, mesh_psk
from tests.sealed import caps, identity, sealed_peer
from protocol.codec import encode, pack_tensor
from shards.wire import to_wire
from protocol.messages import (
    PROTOCOL_VERSION,
    Accept,
    Assignment,
    Commit,
    Drop,
    Fail,
    ForwardBatch,
    NodeId,
    Ping,
    Plan,
    Pong,
    ResultBatch,
    Segment,
    SessionId,
)
from shards.manifest import Manifest
from shards.span import Span
from tests.fixtures.daemon import running_node

pytestmark = pytest.mark.timeout(240)
LIVE = pytest.mark.asyncio(loop_scope="module")

MAX_FRAME = 1 << 20  # the node's limit here, so that oversize is cheap to send
PROMPT = "A mesh of small machines"
MAX_TOKENS = 12
CLOSE_WAIT_S = 10.0
SERVE_WAIT_S = 30.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def node(tiny_model_dir, tmp_path_factory):
    async with running_node(tiny_model_dir, tmp_path_factory.mktemp("hostile-state"),
                            max_frame_bytes=MAX_FRAME, heartbeat_s=0.5) as served:
        yield served


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture(scope="module")
def hidden_size(tiny_model_dir) -> int:
    return Manifest.load(tiny_model_dir).config.hidden_size


async def completion(http, url: str) -> list[int]:
    """The node's greedy tokens for PROMPT, once it serves again (a peer joining or
    leaving makes it re-plan)."""
    deadline = time.monotonic() + SERVE_WAIT_S
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    last = None
    while time.monotonic() < deadline:
        async with http.post(url + "/v1/completions", json=body) as resp:
            data = await resp.json()
            if resp.status == 200:
                return data["choices"][0]["token_ids"]
            last = (resp.status, data)
        await asyncio.sleep(0.2)
    raise AssertionError(f"the node stopped serving: last answer {last}")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def reference(node, http) -> list[int]:
    return await completion(http, node.url)


@contextlib.asynccontextmanager
async def raw_ws(http, url: str):
    async with http.ws_connect(url + "/mesh/ws", max_msg_size=WIRE_MAX, compress=0) as ws:
        yield ws


async def closed_code(ws, timeout: float = CLOSE_WAIT_S) -> int | None:
    """Read until the server closes; its close code (frames it sent are skipped)."""
    async with asyncio.timeout(timeout):
        async for _ in ws:
            pass
    return ws.close_code


def noise_initiator(secret: bytes, prologue: bytes) -> NoiseConnection:
    """A Noise initiator built by hand, for a prologue (mesh, version) the node does not use."""
    conn = NoiseConnection.from_name(NOISE_PROTOCOL)
    conn.set_psks(psk=mesh_psk(secret))
    conn.set_prologue(prologue)
    conn.set_as_initiator()
    conn.start_handshake()
    return conn


async def received(ws, timeout: float = CLOSE_WAIT_S) -> list[bytes]:
    """Every binary message until the server closes."""
    out = []
    async with asyncio.timeout(timeout):
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                out.append(msg.data)
    return out


def events(logs, name: str) -> list[dict]:
    return [e for e in logs if e.get("event") == name]


SERVED: list[int] = []  # one entry per ForwardBatch frame a peer got the stage to act on


@pytest.fixture(scope="module", autouse=True)
def count_served_forwards():
    """Counts the frames that reach the stage's forward handler (``Follower.serve_forward``)."""
    from meshd.control.follower import Follower

    real = Follower.serve_forward

    async def counting(*args, **kwargs):
        SERVED.append(1)
        return await real(*args, **kwargs)

    Follower.serve_forward = counting
    yield
    Follower.serve_forward = real


def forwarded(node) -> int:
    return len(SERVED)


async def assert_serves(node, http, reference) -> None:
    assert await completion(http, node.url) == reference


# -- before the handshake ------------------------------------------------------------------


def forward(term: int, session: str, req: int, start: int, hidden: torch.Tensor) -> ForwardBatch:
    """One session's rows, as the pipeline sends them."""
    return ForwardBatch(term, req, (Segment(SessionId(session), start, hidden.shape[0]),), to_wire(hidden))


def forward_frame(hidden_size: int, term: int = 1, start: int = 0, session: str = "s-hostile") -> bytes:
    return encode(forward(term, session, 1, start, torch.randn(1, hidden_size)))


def plan_frame(sender: str, target: str, term: int = 10**6) -> bytes:
    return encode(Plan(term, NodeId(sender), "tiny-llama", "0" * 64, (Assignment(NodeId(target), Span(0, 6)),)))


@LIVE
async def test_model_frames_before_the_handshake_are_refused(node, http, reference, hidden_size):
    secret = node.node.secret
    target = node.node.node_id
    engine_before, rows_before, term_before = node.node.store.engine, forwarded(node), node.node.view.term
    me = identity(secret)
    cases = {
        "forward instead of the first message": [forward_frame(hidden_size)],
        "plan instead of the first message": [plan_frame(me.node_id, target)],
        "hello in clear": [encode(me.hello(caps(vram=1 << 50)))],
        "text frame": ["hello"],
        "empty frame": [b""],
    }
    with capture_logs() as logs:
        for what, frames in cases.items():
            async with raw_ws(http, node.url) as ws:
                for f in frames:
                    await (ws.send_str(f) if isinstance(f, str) else ws.send_bytes(f))
                got = await received(ws)
                assert ws.close_code == CLOSE_AUTH, f"{what}: closed with {ws.close_code}"
                assert got == [], f"{what}: the node told a stranger {got!r:.80}"
        # Past the pre-authentication limit (WIRE_MAX, about 16 KiB): refused by the socket itself.
        async with raw_ws(http, node.url) as ws:
            await ws.send_bytes(b"\0" * (WIRE_MAX + 1))
            assert await received(ws) == [] and ws.close_code == 1009
    refused = events(logs, "peer_refused")
    assert len(refused) >= len(cases), refused
    assert all(r.get("reason") for r in refused), refused
    # Nothing ran and nothing was planned: same engine, no rows, no term from outside.
    assert node.node.store.engine is engine_before and forwarded(node) == rows_before
    assert node.node.view.term == term_before and not node.node.view.links
    await assert_serves(node, http, reference)


@LIVE
async def test_wrong_replayed_reflected_and_silent_handshakes_are_refused(node, http, reference):
    secret = node.node.secret
    wrong = os.urandom(32)
    with capture_logs() as logs:
        # A legitimate handshake, recorded: the two messages the initiator sent.
        recorded: list[bytes] = []
        async with raw_ws(http, node.url) as ws:
            send = ws.send_bytes

            async def record(data, *a, **kw):
                recorded.append(bytes(data))
                return await send(data, *a, **kw)

            ws.send_bytes = record
            first, _ = await handshake(ws, identity(secret), caps(), initiator=True, max_frame=MAX_FRAME)
            assert first.node_id == node.node.node_id
        msg1, confirm = recorded
        await asyncio.sleep(0.3)

        # A wrong secret, another mesh's name, another protocol version: the first message
        # does not open, and the node answers nothing at all.
        for what, conn in {"wrong secret": noise_initiator(wrong, b"meshd|%d|home" % PROTOCOL_VERSION),
                           "other mesh": noise_initiator(secret, b"meshd|%d|other" % PROTOCOL_VERSION),
                           "other version": noise_initiator(secret, b"meshd|%d|home" % (PROTOCOL_VERSION + 1))
                           }.items():
            async with raw_ws(http, node.url) as ws:
                await ws.send_bytes(bytes(conn.write_message(b"")))
                assert await received(ws) == [] and ws.close_code == CLOSE_AUTH, what

        # Replay: the recorded first message is answered (it was made with the psk), but the
        # answer is for an ephemeral key we do not hold, and the recorded confirmation was
        # sealed under another connection's keys: refused.
        async with raw_ws(http, node.url) as ws:
            await ws.send_bytes(msg1)
            answer = (await ws.receive(timeout=CLOSE_WAIT_S)).data
            assert msg1[:32] not in answer and len(answer) > 48
            await ws.send_bytes(confirm)
            assert await received(ws) == [] and ws.close_code == CLOSE_AUTH

        # Reflection: the node's answer on one connection, fed back to it as the first
        # message and as the confirmation of another.
        async with raw_ws(http, node.url) as ws_a, raw_ws(http, node.url) as ws_b:
            await ws_a.send_bytes(msg1)
            answer_a = (await ws_a.receive(timeout=CLOSE_WAIT_S)).data
            await ws_b.send_bytes(answer_a)
            assert await received(ws_b) == [] and ws_b.close_code == CLOSE_AUTH
            await ws_a.send_bytes(answer_a)
            assert await received(ws_a) == [] and ws_a.close_code == CLOSE_AUTH

        # No confirmation at all: the handshake times out, and the socket is closed.
        async with raw_ws(http, node.url) as ws:
            await ws.send_bytes(msg1)
            await ws.receive(timeout=CLOSE_WAIT_S)
            assert await received(ws, timeout=15) == [] and ws.close_code == CLOSE_AUTH
    reasons = [r.get("reason", "") for r in events(logs, "peer_refused")]
    assert sum("secret" in r for r in reasons) >= 6, reasons
    assert any("within" in r for r in reasons), reasons
    assert not node.node.view.links, "a refused handshake left a link"
    # The secret itself is in no log record.
    assert not any(secret.decode() in repr(e) for e in logs)
    await assert_serves(node, http, reference)


# -- after the handshake: one link's bad frames ---------------------------------------------


def peer(http, url: str, secret: bytes, vram: int = 0):
    return sealed_peer(http, url, secret, vram=vram, max_frame=4 * MAX_FRAME)


def tensor_frame(tag: str, hidden: dict, **fields) -> bytes:
    return msgpack.packb({"t": tag, **fields, "hidden": hidden}, use_bin_type=True)


@LIVE
async def test_bad_frames_close_only_that_link(node, http, reference, hidden_size):
    secret = node.node.secret
    good = pack_tensor(to_wire(torch.randn(2, hidden_size)))
    data = bytes(good["data"])
    fwd = dict(term=1, req=1, segments=[{"session": "s1", "start": 0, "rows": 1}])
    cases = {
        "oversize": b"\x00" * (MAX_FRAME + 1024),
        "bad dtype": tensor_frame("fwdb", {"dtype": "float64", "shape": [1, hidden_size],
                                              "data": b"\0" * 8 * hidden_size}, **fwd),
        "object dtype": tensor_frame("fwdb", {"dtype": "object", "shape": [1], "data": b"\0" * 8}, **fwd),
        "bytes short of the shape": tensor_frame("fwdb", {**good, "data": data[:-4]}, **fwd),
        "bytes past the shape": tensor_frame("fwdb", {**good, "data": data + b"\0" * 4}, **fwd),
        "huge shape, no bytes": tensor_frame("fwdb", {"dtype": "float32", "shape": [1 << 30, 1 << 30],
                                                         "data": b""}, **fwd),
        "negative shape": tensor_frame("fwdb", {"dtype": "float32", "shape": [-1, hidden_size],
                                                   "data": b""}, **fwd),
        "unknown tag": msgpack.packb({"t": "launch-missiles", "term": 1}),
        "no tag": msgpack.packb({"term": 1}),
        "not a map": msgpack.packb([1, 2, 3]),
        "truncated": encode(forward(1, "s1", 1, 0, torch.randn(1, hidden_size)))[:-7],
        "fwdb rows off hidden": encode(ForwardBatch(1, 1, (Segment(SessionId("a"), 0, 1),
                                                           Segment(SessionId("b"), 0, 2)),
                                                    to_wire(torch.randn(2, hidden_size)))),
        "fwdb 1-d hidden": encode(ForwardBatch(1, 1, (Segment(SessionId("a"), 0, 1),), to_wire(torch.randn(hidden_size)))),
        "hello again": encode(identity(secret).hello(caps())),
    }
    rows_before = forwarded(node)
    with capture_logs() as logs:
        for what, frame in cases.items():
            async with peer(http, node.url, secret) as p:
                await p.send_raw(frame)
                code = await p.closed()
                assert code in (CLOSE_PROTOCOL, 1009), f"{what}: closed with {code}"
            await assert_serves(node, http, reference)
    closed = [e for e in events(logs, "link_closed") if e.get("reason", "") != "node stopped"]
    assert len(closed) >= len(cases), closed
    protocol = events(logs, "link_protocol_error")
    assert len(protocol) >= len(cases), "\n".join(e.get("reason")[:70] for e in protocol)
    assert all(e.get("reason") for e in protocol)
    assert forwarded(node) == rows_before, "a bad frame was run"


@LIVE
async def test_injected_and_replayed_pieces_are_dropped_and_the_link_stays(node, http, reference, hidden_size):
    """An on-path attacker's pieces: random bytes, a replay of one the peer sent, the same
    with a bit flipped, and a ForwardBatch sealed under another link's key. None opens;
    each is dropped (logged), nothing runs, and the link goes on as before."""
    secret = node.node.secret
    rows_before = forwarded(node)
    with capture_logs() as logs:
        async with peer(http, node.url, secret) as other:
            foreign = other.channel.seal(forward_frame(hidden_size))[0]  # never sent on its own link
        async with peer(http, node.url, secret) as p:
            await p.send(Ping(1, 0.0))
            await p.next(Pong, where=lambda m: m.seq == 1)
            replay = p.sent[-1]
            flipped = bytearray(replay)
            flipped[len(flipped) // 2] ^= 0x01
            for piece in (os.urandom(200), replay, bytes(flipped), foreign):
                await p.ws.send_bytes(piece)
            await p.send(Ping(2, 0.0))
            await p.next(Pong, where=lambda m: m.seq == 2)
            link = node.node.view.links[p.me.node_id]
            assert link.alive and link.channel.forged == 4
    assert len(events(logs, "link_piece_dropped")) == 4
    assert forwarded(node) == rows_before, "a forged piece was run"
    await assert_serves(node, http, reference)


@LIVE
async def test_frames_a_stage_must_not_act_on_get_fail(node, http, reference, hidden_size):
    """pytest takes the node over as its supernode (it holds the secret and advertises the
    most VRAM), gives it every layer, then sends Forwards it must refuse by Fail."""
    secret = node.node.secret
    n = node.node.store.manifest.n_layers
    m = node.node.store.manifest
    target = node.node.node_id
    with capture_logs() as logs:
        async with peer(http, node.url, secret, vram=1 << 50) as p:
            # The node yields to us, and takes a plan from us for all its layers.
            await asyncio.sleep(0.5)
            term = max(node.node.view.term, 1) + 5
            plan = Plan(term, p.me.node_id, m.name, m.digest, (Assignment(NodeId(target), Span(0, n)),))
            await p.send(plan)
            accept = await p.next(Accept, timeout=30)
            assert accept.term == term and accept.span == Span(0, n)
            await p.send(Commit(term))
            await asyncio.sleep(0.2)
            engine = node.node.store.engine
            assert engine is not None and engine.span == Span(0, n)

            async def ask(msg) -> object:
                await p.send(msg)
                return await p.next((Fail, ResultBatch), where=lambda r: r.req == msg.req)

            # A real forward runs, and makes a session on the stage.
            ok = await ask(forward(term, "real", 1, 0, torch.randn(3, hidden_size)))
            assert isinstance(ok, ResultBatch) and tuple(ok.hidden.shape) == (3, hidden_size), ok
            assert engine.sessions == 1
            bad = {
                "stale term": forward(term - 1, "real", 2, 3, torch.randn(1, hidden_size)),
                "future term": forward(term + 1, "real", 3, 3, torch.randn(1, hidden_size)),
                "no such session": forward(term, "ghost", 4, 5, torch.randn(1, hidden_size)),
                "past the cache": forward(term, "real", 5, 7, torch.randn(1, hidden_size)),
                "wrong width": forward(term, "real", 6, 3, torch.randn(1, hidden_size + 1)),
                "ghost in a batch": ForwardBatch(term, 8, (Segment(SessionId("real"), 3, 1),
                                                           Segment(SessionId("ghost"), 2, 1)),
                                                 to_wire(torch.randn(2, hidden_size))),
                "one session twice": ForwardBatch(term, 9, (Segment(SessionId("real"), 3, 1),
                                                            Segment(SessionId("real"), 3, 1)),
                                                  to_wire(torch.randn(2, hidden_size))),
                "past max position": forward(term, "long", 10, 0, torch.randn(m.config.max_position + 1, hidden_size)),
            }
            for what, msg in bad.items():
                reply = await ask(msg)
                assert isinstance(reply, Fail), f"{what}: {reply!r}"
                assert reply.reason, what
            # A bad batch changed nothing: the real session is as it was, and goes on.
            assert engine.sessions == 1 and engine.cached_length("real") == 3
            ok = await ask(forward(term, "real", 11, 3, torch.randn(1, hidden_size)))
            assert isinstance(ok, ResultBatch), ok
            # Drops of sessions that do not exist, results nobody asked for: ignored.
            for frame in (Drop(term, SessionId("ghost")), ResultBatch(term, 999, to_wire(torch.randn(1, 2))),
                          Fail(term, 998, "nobody asked"), ResultBatch(term, 997, to_wire(torch.randn(1, 2))),
                          Accept(term + 9, Span(0, 1))):
                await p.send(frame)
            await p.send(Drop(term, SessionId("real")))
            await p.send(Ping(1, 0.0))
            await p.next(Pong)
            assert engine.sessions == 0
            assert node.node.view.links[p.me.node_id].alive, "a frame the stage could answer closed the link"
    assert len(events(logs, "stale_frame_dropped")) >= 2
    assert len(events(logs, "forward_failed")) >= len(bad) - 2
    # With us gone it is its own supernode again, and serves as before.
    await assert_serves(node, http, reference)
