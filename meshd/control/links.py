"""Keeping one authenticated link per peer: dialing what discovery and the static
peer list name (the smaller node id dials), taking incoming links at /mesh/ws,
dropping duplicates, and the heartbeat that tells a hung or cut-off peer from a
live one. It is the one writer of the view's ``links`` and ``lost``; what a join or
a loss means for the plan is the leader's to decide (``on_joined``, ``on_lost``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from meshd.config import Config
from meshd.control.discovery import Advert, DiscoveryEvent, PeerGone, PeerSeen
from meshd.control.mesh import MeshView
from meshd.control.peers import CLOSE_AUTH, CLOSE_DUPLICATE, Link, url_host
from meshd.control.secure import WIRE_MAX, LocalIdentity, SelfLink, handshake
from meshd.errors import AuthError, PeerLost, ProtocolError
from protocol.messages import Message, NodeId

log = structlog.get_logger()

LOST_SHOWN_S = 600.0  # how long /status lists a lost peer before it is gone
REDIAL_AFTER_S = 2.0  # the larger id dials too once a peer it sees has stayed unlinked this long
REFUSED_WAIT_S = 10.0  # an address whose handshake failed is dialled again after this long
# mDNS is unauthenticated: anyone on the LAN can advertise any node id at any address.
# So a node id keeps several addresses, each dialled on its own, and only the handshake
# (which proves the id) tells the real one; a flood of spoofed addresses is bounded.
MAX_ADDRS_PER_PEER = 8
MAX_PEERS_HEARD = 256


@dataclass(slots=True)
class Heard:
    """One address mDNS gave for a node id."""

    at: float  # when last heard (discovery tells every listed advert again every few seconds)
    refused: bool = False  # its handshake failed: not that peer, or not of this mesh


class LinkKeeper:
    def __init__(self, config: Config, view: MeshView, identity: LocalIdentity,
                 http: Callable[[], aiohttp.ClientSession], spawn: Callable[[Coroutine], object],
                 handle: Callable[[Link, Message], Awaitable[None]],
                 on_joined: Callable[[NodeId], None], on_lost: Callable[[NodeId, str], None],
                 on_beat: Callable[[], None] = lambda: None):
        self.config = config
        self.view = view
        self.identity = identity
        self._http = http
        self.spawn = spawn
        self.handle = handle  # every message the link's read loop does not settle itself
        self.on_joined = on_joined
        self.on_lost = on_lost
        self.on_beat = on_beat  # each heartbeat, after the pings (the leader re-weighs hops)
        self.events: asyncio.Queue[DiscoveryEvent] = asyncio.Queue()  # discovery's PeerSeen / PeerGone
        # node id -> (host, port) -> what mDNS said: more than one address per id, since
        # a stranger can advertise a real peer's id too (see MAX_ADDRS_PER_PEER).
        self.adverts: dict[str, dict[tuple[str, int], Heard]] = {}
        self._proven: dict[str, tuple[str, int]] = {}  # node id -> an address its handshake came from
        self._dialing: set[str] = set()
        self._dial_after: dict[str, float] = {}
        self._unlinked_since: dict[str, float] = {}  # advertised peers without a link, since when
        self._recent_losses: list[float] = []  # when links were lost (for isolated_since)
        # Every link lost at once (a cut cable, or this process stopped while the others
        # closed on it): this peer is likely the one cut off, and asks before it leads alone.
        self.isolated_since: float | None = None

    async def discovery_loop(self) -> None:
        while True:
            event = await self.events.get()
            match event:
                case PeerSeen(advert=advert):
                    self.hear(advert)
                case PeerGone(node_id=node_id):
                    # Kept, to be dialled again: a goodbye heard while a cable was out, or
                    # a restart announced then, must not leave two live peers unlinked.
                    link = self.view.links.get(NodeId(node_id))
                    if link is not None:  # mDNS says gone: confirm with a ping, the heartbeat decides
                        with contextlib.suppress(PeerLost):
                            await link.call_ping()

    def hear(self, advert: Advert) -> None:
        """Note one address for ``advert.node_id``. When the id already has
        MAX_ADDRS_PER_PEER, one goes: a refused one first, then the one heard longest
        ago; never the one a handshake came from. A real peer's address pushed out by a
        flood comes back when discovery tells it again."""
        now = time.monotonic()
        addrs = self.adverts.get(advert.node_id)
        if addrs is None:
            if len(self.adverts) >= MAX_PEERS_HEARD:
                self._forget_a_peer()
            addrs = self.adverts[advert.node_id] = {}
        key = (advert.host, advert.port)
        if key in addrs:
            addrs[key].at = now
            return
        if len(addrs) >= MAX_ADDRS_PER_PEER:
            proven = self._proven.get(advert.node_id)
            evictable = [k for k in addrs if k != proven]
            del addrs[min(evictable, key=lambda k: (not addrs[k].refused, addrs[k].at))]
        addrs[key] = Heard(now)

    def _forget_a_peer(self) -> None:
        """Make room for a new node id: drop the unlinked one heard from longest ago."""
        unlinked = [pid for pid in self.adverts if pid not in self.view.links]
        if not unlinked:
            return
        oldest = min(unlinked, key=lambda pid: max(h.at for h in self.adverts[pid].values()))
        del self.adverts[oldest]
        self._unlinked_since.pop(oldest, None)

    def _dial_targets(self) -> list[tuple[str, str, int, NodeId | None]]:
        targets: list[tuple[str, str, int, NodeId | None]] = []
        now = time.monotonic()
        linked_addrs = {(link.addr, link.caps.api_port) for link in self.view.live_links().values()}
        for node_id, addrs in self.adverts.items():
            if node_id in self.view.links:
                self._unlinked_since.pop(node_id, None)
                continue
            since = self._unlinked_since.setdefault(node_id, now)
            if now - since > LOST_SHOWN_S:
                continue  # gone for good (a goodbye, and silence since): dialled no more
            # One link per pair: the peer with the smaller id dials; the other one too
            # once the pair has stayed unlinked (that peer may never have heard of it).
            if self.view.node_id < node_id or now - since > REDIAL_AFTER_S:
                for host, port in addrs:
                    targets.append((f"{node_id}@{host}:{port}", host, port, NodeId(node_id)))
        for addr in self.config.peer:
            host, _, port_text = addr.rpartition(":")
            if (host, int(port_text)) not in linked_addrs:
                targets.append((addr, host, int(port_text), None))
        return targets

    async def connect_loop(self) -> None:
        while True:
            now = time.monotonic()
            # Spoofed adverts can name many addresses over time: keep only live backoffs.
            self._dial_after = {k: t for k, t in self._dial_after.items() if t > now}
            for key, host, port, expect in self._dial_targets():
                if key in self._dialing or self._dial_after.get(key, 0) > now:
                    continue
                self._dialing.add(key)
                self.spawn(self._dial(key, host, port, expect))
            await asyncio.sleep(0.5)

    async def _dial(self, key: str, host: str, port: int, expect: NodeId | None) -> None:
        url = f"{'wss' if self.config.tls_cert else 'ws'}://{url_host(host)}:{port}/mesh/ws"
        try:
            try:
                ws = await self._http().ws_connect(
                    url, max_msg_size=WIRE_MAX, compress=0, autoping=True,
                    timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
                )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self._backoff(key)
                log.debug("dial_failed", url=url, error=str(exc))
                return
            try:
                hello, channel = await handshake(ws, self.identity, self.view.caps, initiator=True,
                                                 max_frame=self.config.max_frame_bytes, expect=expect)
            except SelfLink:
                self._dial_after[key] = float("inf")  # never again
                await ws.close()
                return
            except (AuthError, ProtocolError) as exc:
                self._backoff(key, refused=True)
                if expect is not None and (heard := self.adverts.get(expect, {}).get((host, port))):
                    heard.refused = True
                log.warning("peer_refused", addr=f"{host}:{port}", reason=str(exc))
                await ws.close(code=CLOSE_AUTH, message=str(exc)[:120].encode())
                return
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                self._backoff(key)
                log.info("handshake_failed", addr=f"{host}:{port}", reason=str(exc))
                await ws.close()
                return
            self._dial_after.pop(key, None)
            await self._serve_link(Link(ws, hello, channel, host, True, self.config.max_frame_bytes))
        finally:
            self._dialing.discard(key)

    def _backoff(self, key: str, refused: bool = False) -> None:
        wait = REFUSED_WAIT_S if refused else 1.0
        self._dial_after[key] = time.monotonic() + wait

    async def ws_handler(self, request: web.Request) -> web.WebSocketResponse:
        # Every message is one sealed piece, so the limit is the same before and after
        # the handshake: a stranger cannot make us buffer more than WIRE_MAX.
        ws = web.WebSocketResponse(max_msg_size=WIRE_MAX, compress=False, autoping=True)
        await ws.prepare(request)
        try:
            hello, channel = await handshake(ws, self.identity, self.view.caps, initiator=False,
                                             max_frame=self.config.max_frame_bytes)
        except SelfLink:
            await ws.close()
            return ws
        except (AuthError, ProtocolError) as exc:
            log.warning("peer_refused", addr=request.remote, reason=str(exc))
            await ws.close(code=CLOSE_AUTH, message=str(exc)[:120].encode())
            return ws
        except (ConnectionError, TimeoutError) as exc:
            log.info("handshake_failed", addr=request.remote, reason=str(exc))
            return ws
        await self._serve_link(Link(ws, hello, channel, request.remote or "", False, self.config.max_frame_bytes))
        return ws

    async def _serve_link(self, link: Link) -> None:
        if self.config.debug_link_delay_ms:
            link.simulate_delay(self.config.debug_link_delay_ms, self.config.debug_link_jitter_ms)
        if not self._register(link):
            await link.close("duplicate link", CLOSE_DUPLICATE)
            return
        try:
            await link.read_loop(self.handle)
        finally:
            self._unregister(link)

    def _preferred(self, link: Link) -> bool:
        """Of two links to one peer, keep the one the smaller id dialed."""
        return link.dialed == (self.view.node_id < link.peer_id)

    def _register(self, link: Link) -> bool:
        old = self.view.links.get(link.peer_id)
        if old is not None and old.alive and self._preferred(old) and not self._preferred(link):
            return False
        self.view.add_link(link)
        self._proven[link.peer_id] = (link.addr, link.caps.api_port)
        if heard := self.adverts.get(link.peer_id, {}).get(self._proven[link.peer_id]):
            heard.refused = False
        if old is not None and old.alive:
            self.spawn(old.close("replaced by a newer link", CLOSE_DUPLICATE))
        self.isolated_since = None
        log.info("peer_joined", peer=link.peer_id, name=link.hello.name, addr=link.addr,
                 device=link.caps.device, vram=link.caps.vram)
        self.on_joined(link.peer_id)
        self.spawn(self.ping(link))  # an RTT to show (and to place by) from the start
        return True

    def _unregister(self, link: Link) -> None:
        if self.view.remove_link(link):
            now = time.monotonic()
            window = self.config.heartbeat_s * self.config.missed_beats
            self._recent_losses = [t for t in self._recent_losses if now - t < window] + [now]
            if not self.view.links and len(self._recent_losses) >= 2:
                self.isolated_since = now
                log.warning("isolated", peers_lost=len(self._recent_losses))
            log.warning("peer_lost", peer=link.peer_id, reason=link.close_reason)
            self.on_lost(link.peer_id, link.close_reason)

    async def heartbeat_loop(self) -> None:
        """Ping every link each beat; a link silent for ``missed_beats`` beats is lost
        (a hung or partitioned peer sends no close)."""
        beat = self.config.heartbeat_s
        limit = beat * self.config.missed_beats
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last > limit:
                # This loop slept past the limit: this process was stopped (or starved),
                # not its peers. Ask them (the pings below) before declaring any lost.
                log.warning("heartbeat_stalled", seconds=round(now - last, 2))
                for link in self.view.links.values():
                    link.last_heard = max(link.last_heard, now)
            last = now
            for link in list(self.view.links.values()):
                if now - link.last_heard > limit:
                    self.spawn(link.close(f"missed {self.config.missed_beats} heartbeats"))
                else:
                    self.spawn(self.ping(link))
            self.view.forget_lost(LOST_SHOWN_S)
            self.on_beat()
            await asyncio.sleep(beat)

    async def ping(self, link: Link) -> None:
        with contextlib.suppress(PeerLost):
            await link.call_ping()
