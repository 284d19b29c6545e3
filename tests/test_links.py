"""The link keeper, in process, over real WebSockets on loopback (no namespaces): two
keepers that name each other as static peers end with one authenticated link between
them, which stays, with an RTT measured; a peer that goes silent is lost
after the missed heartbeats, one that closes its socket at once, each with its reason
in the view and told to the leader's ``on_lost``. Plain-text frames only when both ends
run ``--debug-plaintext-links``; a dialer told (by mDNS) it reaches one node refuses another,
and a flood of adverts naming a peer's id at other addresses does not keep it from the real one."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from structlog.testing import capture_logs
from aiohttp import web

from meshd.control.discovery import Advert, PeerSeen
from meshd.control.links import MAX_ADDRS_PER_PEER, LinkKeeper
from meshd.control.mesh import MeshView
from meshd.control.peers import Link
from meshd.control.secure import Channel, LocalIdentity, handshake
from meshd.errors import AuthError
from protocol.codec import decode
from protocol.messages import ForwardBatch, NodeId, Ping, Segment, SessionId
from shards.wire import from_wire, to_wire
from tests.fixtures.shared import free_port
from tests.mdns_spoofer import impostor as impostor_server
from tests.inproc import Tasks, caps, config, until

pytestmark = pytest.mark.timeout(60)
SECRET = secrets.token_hex(32).encode()


@contextlib.asynccontextmanager
async def keeper(tmp_path, node_id: str, port: int, peers: tuple[str, ...] = (), **flags):
    """A link keeper serving /mesh/ws on ``port``, dialing ``peers``; what it tells the leader is recorded."""
    cfg = config(tmp_path / node_id, port=port, peer=peers, **flags)
    view = MeshView(NodeId(node_id), caps(vram=1, api_port=port))
    tasks = Tasks()
    joined, lost = [], []
    async with aiohttp.ClientSession() as http:
        me = LocalIdentity(NodeId(node_id), node_id, "home", SECRET, plaintext=cfg.debug_plaintext_links)
        k = LinkKeeper(cfg, view, me, lambda: http,
                       tasks.spawn, handle=_ignore, on_joined=joined.append,
                       on_lost=lambda peer, reason: lost.append((peer, reason)))
        app = web.Application()
        app.router.add_get("/mesh/ws", k.ws_handler)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        tasks.spawn(k.connect_loop())
        tasks.spawn(k.heartbeat_loop())
        tasks.spawn(k.discovery_loop())
        try:
            yield SimpleNamespace(keeper=k, view=view, joined=joined, lost=lost, url=f"http://127.0.0.1:{port}")
        finally:
            for link in list(view.links.values()):
                await link.close("test over")
            await tasks.close()
            await runner.cleanup()


async def _ignore(link, msg) -> None:
    pass


async def test_two_peers_that_dial_each_other_keep_one_link(tmp_path):
    pa, pb = free_port(), free_port()
    async with keeper(tmp_path, "aaaa", pa, peers=(f"127.0.0.1:{pb}",)) as a, \
            keeper(tmp_path, "bbbb", pb, peers=(f"127.0.0.1:{pa}",)) as b:
        await until(lambda: "bbbb" in a.view.links and "aaaa" in b.view.links
                    and a.view.links["bbbb"].rtt_ms is not None and b.view.links["aaaa"].rtt_ms is not None)
        ab, ba = a.view.links["bbbb"], b.view.links["aaaa"]
        assert ab.alive and ba.alive and ab.dialed != ba.dialed, "two ends of one connection"
        # Past a redial backoff (1 s): the dial loops go round and leave the link as it is.
        await b.view.changes.wait_for(lambda: False, 1.5)
        assert a.view.links["bbbb"] is ab and b.view.links["aaaa"] is ba and ab.alive and ba.alive
        assert a.joined == ["bbbb"] and b.joined == ["aaaa"] and not a.lost and not b.lost


async def test_a_silent_peer_is_lost_after_the_missed_beats_a_closed_one_at_once(tmp_path):
    async with keeper(tmp_path, "aaaa", free_port(), heartbeat_s=0.2, missed_beats=3) as a:
        async with aiohttp.ClientSession() as http:
            # pytest as a peer that authenticates, then never answers a ping.
            silent = LocalIdentity(NodeId("ssss"), "silent", "home", SECRET)
            async with http.ws_connect(a.url + "/mesh/ws") as ws:
                await handshake(ws, silent, caps(), initiator=True, max_frame=1 << 20)
                await until(lambda: "ssss" in a.view.links)
                await until(lambda: a.lost, timeout=5)
                assert a.lost == [("ssss", "missed 3 heartbeats")]
                assert "ssss" not in a.view.links and a.view.lost["ssss"].reason == "missed 3 heartbeats"

            closing = LocalIdentity(NodeId("cccc"), "closing", "home", SECRET)
            async with http.ws_connect(a.url + "/mesh/ws") as ws:
                await handshake(ws, closing, caps(), initiator=True, max_frame=1 << 20)
                await until(lambda: "cccc" in a.view.links)
            # The socket closed with the block: lost well before any heartbeat could miss.
            await until(lambda: len(a.lost) == 2, timeout=0.5)
            peer, reason = a.lost[1]
            assert peer == "cccc" and "socket closed" in reason and a.view.lost["cccc"].reason == reason


async def test_plaintext_links_need_both_ends_and_a_dialer_checks_who_answers(tmp_path):
    pa, pb, pc = free_port(), free_port(), free_port()
    with capture_logs() as logs:
        async with keeper(tmp_path, "aaaa", pa, peers=(f"127.0.0.1:{pb}",), debug_plaintext_links=True) as a, \
                keeper(tmp_path, "bbbb", pb) as b:
            await until(lambda: any("plaintext" in e.get("reason", "") for e in logs
                                    if e.get("event") == "peer_refused"), timeout=10)
            assert not a.view.links and not b.view.links
    async with keeper(tmp_path, "cccc", pc, peers=(f"127.0.0.1:{pa}",), debug_plaintext_links=True) as c, \
            keeper(tmp_path, "aaab", pa, debug_plaintext_links=True) as a:
        await until(lambda: "aaab" in c.view.links and "cccc" in a.view.links)
        link = c.view.links["aaab"]
        assert link.channel.plaintext
        # In clear: the frame's own msgpack is what goes on the wire.
        sent = []
        real = link.ws.send_bytes

        async def spy(data, *args, **kw):
            sent.append(bytes(data))
            return await real(data, *args, **kw)

        link.ws.send_bytes = spy
        await link.call_ping()
        # The heartbeat may send a pong meanwhile: the ping is among the frames, readable as is.
        assert any(b"\xa1t\xa4ping" in frame for frame in sent), sent
        async with aiohttp.ClientSession() as http, http.ws_connect(a.url + "/mesh/ws") as ws:
            with pytest.raises(AuthError, match="relay"):
                me = LocalIdentity(NodeId("dddd"), "d", "home", SECRET, plaintext=True)
                await handshake(ws, me, caps(), initiator=True, max_frame=1 << 20, expect=NodeId("eeee"))


async def test_a_flood_of_spoofed_adverts_for_a_peer_id_does_not_keep_it_unlinked(tmp_path):
    """What discovery hands the keeper when a stranger on the LAN advertises both peers'
    ids at addresses of its own, a new one every 20 ms (an impostor that fails the
    handshake, or a port nobody listens on), while the real adverts come only every
    second (discovery tells what it lists every few seconds). Kept as "the last advert
    per id", every dial would go to the stranger; the keepers link all the same, and
    dialled (and refused) the stranger on the way."""
    pa, pb, evil = free_port(), free_port(), free_port()
    closed = [free_port() for _ in range(2 * MAX_ADDRS_PER_PEER)]
    impostor = await impostor_server("127.0.0.1", evil, accepted=[0])
    with capture_logs() as logs:
        async with keeper(tmp_path, "aaaa", pa) as a, keeper(tmp_path, "bbbb", pb) as b:
            real = {"aaaa": Advert("aaaa", "a", "home", 2, "127.0.0.1", pa, 0, 1, "cpu"),
                    "bbbb": Advert("bbbb", "b", "home", 2, "127.0.0.1", pb, 0, 1, "cpu")}

            async def flood():
                for i in range(10_000):  # bounded: 200 s at most, cancelled once linked
                    port = [evil, *closed][i % (len(closed) + 1)]
                    for peer, there in (("bbbb", a), ("aaaa", b)):
                        if i % 50 == 0:
                            there.keeper.events.put_nowait(PeerSeen(real[peer]))
                        spoof = Advert(peer, "evil", "home", 2, "127.0.0.1", port, 1 << 40, 1, "cuda")
                        there.keeper.events.put_nowait(PeerSeen(spoof))
                    await asyncio.sleep(0.02)

            spoofing = asyncio.create_task(flood())
            try:
                await until(lambda: "bbbb" in a.view.links and "aaaa" in b.view.links, timeout=20)
                await until(lambda: any(e.get("event") == "peer_refused" and e.get("addr") == f"127.0.0.1:{evil}"
                                        for e in logs), timeout=10)
            finally:
                spoofing.cancel()
                await impostor.cleanup()
            assert a.view.links["bbbb"].addr == "127.0.0.1" and a.view.links["bbbb"].caps.api_port == pb
            assert len(a.keeper.adverts["bbbb"]) <= MAX_ADDRS_PER_PEER
            assert not a.lost and not b.lost


class SlowSocket:
    """The sending end of a link's WebSocket whose socket takes a while per piece (a full
    send buffer); what went out, in order."""

    def __init__(self):
        self.pieces: list[bytes] = []

    async def send_bytes(self, piece: bytes) -> None:
        await asyncio.sleep(0.005)
        self.pieces.append(piece)


async def test_a_frame_goes_out_whole_when_its_sender_is_cancelled_mid_way():
    """A wave's group is cancelled when a sibling fails, maybe between two pieces of its
    frame. The pieces' nonces are spent at sealing, so half a frame would leave the peer
    dropping every later piece as forged: the frame goes out whole, and the link goes on."""
    a = LocalIdentity(NodeId("a"), "a", "home", SECRET).noise(initiator=True)
    b = LocalIdentity(NodeId("b"), "b", "home", SECRET).noise(initiator=False)
    b.read_message(a.write_message(b""))
    a.read_message(b.write_message(b""))
    ws = SlowSocket()
    link = Link(ws, SimpleNamespace(node_id=NodeId("b")), Channel(a, False, 64 << 20), "127.0.0.1", True, 64 << 20)
    big = ForwardBatch(1, 1, (Segment(SessionId("s"), 0, 64),), to_wire(torch.randn(64, 576)))  # ~150 KB: ten pieces
    sender = asyncio.create_task(link.send(big))
    await until(lambda: len(ws.pieces) >= 2, timeout=5)
    sender.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sender
    await link.send(Ping(7, 0.0))
    receiver = Channel(b, False, 64 << 20)
    frames = [decode(f) for f in map(receiver.open, ws.pieces) if f is not None]
    assert receiver.forged == 0 and len(ws.pieces) > 3
    assert [type(f).__name__ for f in frames] == ["ForwardBatch", "Ping"]
    assert torch.equal(from_wire(frames[0].hidden), from_wire(big.hidden))
