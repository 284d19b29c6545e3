"""An attacker on the LAN, without the mesh secret, against two real daemons in namespaces.

``alpha`` (the supernode) and ``beta`` (a stage) split the tiny model. beta reaches alpha
only through a TCP relay that pytest runs on the lab's bridge (beta's static peer): the
relay is the attacker's machine in the middle. It records every byte of the link (a
passive capture) and, after the handshake, injects into both directions: replays of frames
it saw, a copy with a flipped bit, random frames. Meanwhile an outsider process dials both
daemons itself: the two-sided relay (a link to alpha and one to beta, each side's handshake
forwarded to the other), a replay of beta's recorded handshake and frames, a reflection of
alpha's own answer. What it must show: the outsider gets no byte of a Hello or a frame and
nothing changes (both daemons keep their one real link, term and plan as they were, the
same tokens after); the capture of a whole generation, asked of beta (so the request
crosses to the supernode too), holds neither the prompt nor any frame in clear, while the
same capture of a pair running ``--debug-plaintext-links`` reads all of it (the control).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import pytest

from meshd.control.peers import CLOSE_AUTH
from tests.fixtures.mesh import GiB, LAYER_DELAY_MS
from tests.meshlab import PORT, MeshLab, complete
from tests.netlab import Lab

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

PROMPT_WORDS = "the zebra quietly audits forty-seven purple lighthouses"
MAX_TOKENS = 16
ATTACK_WAIT_S = 7.0  # past the daemons' 5 s handshake deadline


# -- a relay that speaks just enough WebSocket to cut frames ---------------------------------------


@dataclass
class Frame:
    raw: bytes  # the frame as it was on the wire (header, mask, payload)
    opcode: int
    payload: bytes  # unmasked


def _frames(buf: bytearray) -> list[Frame]:
    """Cut whole WebSocket frames off the front of ``buf`` (RFC 6455 framing)."""
    out = []
    while len(buf) >= 2:
        b0, b1 = buf[0], buf[1]
        n, at = b1 & 0x7F, 2
        if n == 126:
            if len(buf) < 4:
                break
            n, at = struct.unpack(">H", buf[2:4])[0], 4
        elif n == 127:
            if len(buf) < 10:
                break
            n, at = struct.unpack(">Q", buf[2:10])[0], 10
        mask = b""
        if b1 & 0x80:
            mask, at = bytes(buf[at:at + 4]), at + 4
        if len(buf) < at + n:
            break
        payload = bytes(buf[at:at + n])
        if mask:
            payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
        out.append(Frame(bytes(buf[:at + n]), b0 & 0x0F, payload))
        del buf[:at + n]
    return out


def ws_frame(payload: bytes, masked: bool) -> bytes:
    """One final binary frame (masked as a client must)."""
    head = bytearray([0x82])
    n = len(payload)
    length = bytes([n]) if n < 126 else (b"\x7e" + struct.pack(">H", n) if n < 65536 else b"\x7f" + struct.pack(">Q", n))
    if not masked:
        return bytes(head + length + payload)
    key = os.urandom(4)
    head += bytes([length[0] | 0x80]) + length[1:]
    return bytes(head + key + bytes(c ^ key[i % 4] for i, c in enumerate(payload)))


@dataclass
class Direction:
    masked: bool  # client-to-server frames are masked
    wire: bytearray = field(default_factory=bytearray)  # every byte, as captured
    frames: list[Frame] = field(default_factory=list)  # after the HTTP upgrade
    _head: bytearray = field(default_factory=bytearray)
    _upgraded: bool = False
    _buf: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[bytes]:
        """Record ``data``; the chunks to forward, cut at frame boundaries once upgraded."""
        self.wire += data
        if not self._upgraded:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return []
            self._upgraded = True
            self._buf += self._head[end + 4:]
            out = [bytes(self._head[:end + 4])]
        else:
            self._buf += data
            out = []
        for f in _frames(self._buf):
            self.frames.append(f)
            out.append(f.raw)
        return out


class Relay:
    """The attacker's TCP relay: ``listen`` -> ``target``, recording, injecting on demand."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.listen, self.target = listen, target
        self.loop = asyncio.new_event_loop()
        self.conns: list[tuple[Direction, Direction, asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._ready.wait(10), "relay did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, *self.listen))
        self._ready.set()
        self.loop.run_forever()

    async def _conn(self, r_in: asyncio.StreamReader, w_in: asyncio.StreamWriter) -> None:
        try:
            r_out, w_out = await asyncio.open_connection(*self.target)
        except OSError:
            w_in.close()
            return
        up, down = Direction(masked=True), Direction(masked=False)
        self.conns.append((up, down, w_out, w_in))

        async def pump(r, w, d: Direction) -> None:
            try:
                while data := await r.read(65536):
                    for chunk in d.feed(data):
                        w.write(chunk)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pump(r_in, w_out, up), pump(r_out, w_in, down))

    def links(self) -> list[tuple[Direction, Direction]]:
        """The relayed /mesh/ws connections (beta's other HTTP to alpha, if any, is not one)."""
        return [(up, down) for up, down, _, _ in self.conns if up.wire.startswith(b"GET /mesh/ws")]

    def inject(self, conn: int, upstream: bool, raw: bytes) -> None:
        """Write ``raw`` (whole frames) into one direction of connection ``conn``, between frames."""
        up, down, w_out, w_in = [c for c in self.conns if c[0].wire.startswith(b"GET /mesh/ws")][conn]
        asyncio.run_coroutine_threadsafe(self._write(w_out if upstream else w_in, raw), self.loop).result(5)

    async def _write(self, w: asyncio.StreamWriter, raw: bytes) -> None:
        w.write(raw)
        await w.drain()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# -- the lab ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def relayed_pair(tiny_model_dir, workdir, extra: tuple[str, ...] = ()):
    lab = Lab()
    relay = None
    try:
        mesh = MeshLab(lab, workdir)
        h_alpha, h_beta = lab.add_host(), lab.add_host()
        relay = Relay((mesh.uplink, PORT), (h_alpha.addr, PORT))
        alpha = mesh.start(h_alpha, name="alpha", model=str(tiny_model_dir), vram=8 * GiB, mdns=False,
                           layer_delay_ms=LAYER_DELAY_MS, extra=extra)
        beta = mesh.start(h_beta, name="beta", model=str(tiny_model_dir), vram=4 * GiB, mdns=False,
                          peers=(f"{mesh.uplink}:{PORT}",), layer_delay_ms=LAYER_DELAY_MS, extra=extra)
        try:
            view = mesh.wait_converged([alpha, beta], n_stages=2)
            yield mesh, alpha, beta, relay, view
        finally:
            mesh.close()
    finally:
        if relay is not None:
            relay.close()
        lab.close()


@pytest.fixture(scope="module")
def relayed(netlab_session, tiny_model_dir, tmp_path_factory):
    with relayed_pair(tiny_model_dir, tmp_path_factory.mktemp("relayed")) as pair:
        yield pair


def capture_generation(relay: Relay, entry) -> tuple[bytes, str, list[int], dict]:
    """One generation asked of ``entry``, and what a sniffer on the link reads of it: the
    bytes, and the WebSocket payloads unmasked (a dialer's frames are XORed with a key
    that travels in the frame's own header: no secrecy there)."""
    (up, down), = relay.links()
    prompt = f"{PROMPT_WORDS} {secrets.token_hex(4)}"
    before = len(up.wire) + len(down.wire)
    tokens, answer = complete(entry.url, prompt, MAX_TOKENS)
    assert len(tokens) == MAX_TOKENS
    assert len(up.wire) + len(down.wire) - before > MAX_TOKENS * 2 * 256, "the generation did not cross the relay"
    captured = b"".join([bytes(up.wire), bytes(down.wire), *(f.payload for f in up.frames + down.frames)])
    return captured, prompt, tokens, answer


# What must not be readable: the prompt, and the msgpack of frames (dtype names, tags, keys).
IN_CLEAR = (b"float32", b"fwdb", b"resb", b"hidden", b"apireq", b"/mesh/generate", b"gdelta", b"prompt", b"token_ids")


def test_the_capture_reads_a_plaintext_link(netlab_session, tiny_model_dir, tmp_path):
    """The control: with --debug-plaintext-links on both, the same capture reads it all."""
    with relayed_pair(tiny_model_dir, tmp_path, extra=("--debug-plaintext-links",)) as (_, alpha, beta, relay, view):
        assert view["supernode"] == alpha.node_id
        captured, prompt, _, _ = capture_generation(relay, beta)
        assert prompt.encode() in captured
        assert all(marker in captured for marker in IN_CLEAR), [m for m in IN_CLEAR if m not in captured]


def assert_unchanged(mesh, daemons, view) -> None:
    for d in daemons:
        v = d.status()
        assert v is not None and v["serving"], mesh.fail_report([d])
        assert v["term"] == view["term"] and v["plan"] == view["plan"], (d.name, v["term"], v["plan"])
        live = {p["id"] for p in v["peers"] if p["state"] != "lost"}
        assert live == {x.node_id for x in daemons}, (d.name, live)
        assert not d.log_events("peer_lost") and len(d.log_events("peer_joined")) == 1, mesh.fail_report([d])


async def _collect(ws: aiohttp.ClientWebSocketResponse, got: list, forward_to=None) -> None:
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY:
            got.append(msg.data)
            if forward_to is not None and not forward_to.closed:
                await forward_to.send_bytes(msg.data)


async def outsider_attacks(alpha_url: str, beta_url: str, msg1: bytes, confirm: bytes, later: list[bytes],
                           answer: bytes) -> dict[str, tuple[list, int | None]]:
    """Each attack on its own sockets: what came back, and how the daemon closed it."""
    results = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        # The two-sided relay: a link to alpha as if we were beta and one to beta as if we
        # were alpha, each side's handshake forwarded to the other (neither speaks first).
        async with http.ws_connect(alpha_url + "/mesh/ws") as to_a, http.ws_connect(beta_url + "/mesh/ws") as to_b:
            got_a, got_b = [], []
            await asyncio.wait_for(asyncio.gather(_collect(to_a, got_a, to_b), _collect(to_b, got_b, to_a),
                                                  return_exceptions=True), ATTACK_WAIT_S + 3)
            results["relay to alpha"] = (got_a, to_a.close_code)
            results["relay to beta"] = (got_b, to_b.close_code)
        # Replays of beta's recorded handshake (and the frames after it) to alpha: the first
        # message is answered (an answer only beta's ephemeral key opens), nothing more.
        for what, sequence in {"replayed handshake": [msg1, confirm],
                               "replayed frames": [msg1, *later[:8]],
                               "reflected answer": [answer],
                               "answer as confirmation": [msg1, answer]}.items():
            async with http.ws_connect(alpha_url + "/mesh/ws") as ws:
                got = []
                for data in sequence:
                    await ws.send_bytes(data)
                await asyncio.wait_for(_collect(ws, got), ATTACK_WAIT_S + 3)
                results[what] = (got, ws.close_code)
        async with http.ws_connect(beta_url + "/mesh/ws") as ws:  # beta was never a responder here
            got = []
            await ws.send_bytes(msg1)
            await asyncio.wait_for(_collect(ws, got), ATTACK_WAIT_S + 3)
            results["beta's handshake to beta"] = (got, ws.close_code)
    return results


def test_outsider_and_man_in_the_middle_get_nothing_and_change_nothing(relayed):
    mesh, alpha, beta, relay, view = relayed
    assert view["supernode"] == alpha.node_id, "beta must be the entry that forwards to the supernode"
    assert len(relay.links()) == 1, "beta dials alpha through the relay, once"
    up, down = relay.links()[0]
    # The recorded handshake: beta's first message and its confirmation, alpha's answer.
    msg1, confirm = up.frames[0].payload, up.frames[1].payload
    answer = down.frames[0].payload
    later = [f.payload for f in up.frames[2:] if f.opcode == 0x2]

    # A passive capture of one whole generation, asked of beta: the request crosses to the
    # supernode over the link, hidden states go back and forth.
    captured, prompt, tokens, answer_json = capture_generation(relay, beta)
    answer_text = answer_json["choices"][0]["text"].encode()
    for secret_thing in (prompt.encode(), b"zebra", *([answer_text] if len(answer_text) >= 6 else []), *IN_CLEAR):
        assert secret_thing not in captured, f"{secret_thing!r} is readable on the wire"

    # The attacker in the middle injects into both directions, between frames: replays
    # of what it saw, a copy with a bit flipped, random bytes.
    up_seen, down_seen = [f.payload for f in up.frames if f.opcode == 0x2], \
        [f.payload for f in down.frames if f.opcode == 0x2]
    flipped = bytearray(up_seen[-1])
    flipped[len(flipped) // 2] ^= 0x10
    for payload in (up_seen[-1], up_seen[3], bytes(flipped), os.urandom(300)):
        relay.inject(0, True, ws_frame(payload, masked=True))
    for payload in (down_seen[-1], down_seen[3], os.urandom(300)):
        relay.inject(0, False, ws_frame(payload, masked=False))

    # The outsider's own connections, to both daemons.
    results = asyncio.run(outsider_attacks(alpha.url, beta.url, msg1, confirm, later, answer))
    for what, (got, code) in results.items():
        if what in ("replayed handshake", "replayed frames", "answer as confirmation", "beta's handshake to beta"):
            # alpha answers a replayed first message (it opens: it was made with the psk) with
            # fresh keys; the answer is no Hello anyone without beta's ephemeral key can read.
            assert len(got) == 1 and got[0] != answer, (what, len(got))
        else:
            assert got == [], f"{what}: the daemon sent {len(got)} messages to an outsider"
        assert code == CLOSE_AUTH, f"{what}: closed with {code}" + mesh.fail_report()

    # Both kept their real link, term and plan; the forged pieces were dropped there.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (alpha.log_events("link_piece_dropped")
                                               and beta.log_events("link_piece_dropped")):
        time.sleep(0.2)
    assert len(alpha.log_events("link_piece_dropped")) == 4, mesh.fail_report([alpha])
    assert len(beta.log_events("link_piece_dropped")) == 3, mesh.fail_report([beta])
    refused = alpha.log_events("peer_refused") + beta.log_events("peer_refused")
    assert len(refused) >= len(results), refused
    assert_unchanged(mesh, [alpha, beta], view)
    assert len(relay.links()) == 1, "beta dialed the relay again: its link was lost"
    again, _ = complete(beta.url, prompt, MAX_TOKENS)
    assert again == tokens, mesh.fail_report()
