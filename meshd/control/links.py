"""Keeping one authenticated link per peer: dialing what discovery and the static
peer list name (the smaller node id dials), taking incoming links at /mesh/ws,
dropping duplicates, and the heartbeat that tells a hung or cut-off peer from a
live one. Every link it keeps is in ``node.links``; a lost one moves to ``node.lost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import structlog
from aiohttp import web

from meshd.control.discovery import Advert, PeerGone, PeerSeen
from meshd.control.peers import CLOSE_AUTH, CLOSE_DUPLICATE, Link, SelfLink, handshake
from meshd.errors import AuthError, PeerLost, ProtocolError

if TYPE_CHECKING:
    from meshd.node import Node

log = structlog.get_logger()

LOST_SHOWN_S = 600.0  # how long /status lists a lost peer before it is gone


def url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


@dataclass(slots=True)
class LostPeer:
    hello: object
    addr: str
    since: float
    reason: str


class LinkKeeper:
    def __init__(self, node: Node):
        self.node = node
        self.adverts: dict[str, Advert] = {}  # what mDNS lists now
        self._dialing: set[str] = set()
        self._dial_after: dict[str, float] = {}

    async def discovery_loop(self) -> None:
        while True:
            event = await self.node.events.get()
            match event:
                case PeerSeen(advert=advert):
                    self.adverts[advert.node_id] = advert
                case PeerGone(node_id=node_id):
                    self.adverts.pop(node_id, None)
                    link = self.node.links.get(node_id)
                    if link is not None:  # mDNS says gone: confirm with a ping, the heartbeat decides
                        with contextlib.suppress(PeerLost):
                            await link.call_ping()

    def _dial_targets(self) -> list[tuple[str, str, int]]:
        targets = []
        linked_addrs = {(link.addr, link.caps.api_port) for link in self.node.links.values() if link.alive}
        for advert in self.adverts.values():
            # One link per pair: the peer with the smaller id dials.
            if advert.node_id not in self.node.links and self.node.node_id < advert.node_id:
                targets.append((f"{advert.host}:{advert.port}", advert.host, advert.port))
        for addr in self.node.config.peer:
            host, _, port = addr.rpartition(":")
            if (host, int(port)) not in linked_addrs:
                targets.append((addr, host, int(port)))
        return targets

    async def connect_loop(self) -> None:
        while True:
            now = time.monotonic()
            for key, host, port in self._dial_targets():
                if key in self._dialing or self._dial_after.get(key, 0) > now:
                    continue
                self._dialing.add(key)
                self.node.spawn(self._dial(key, host, port))
            await asyncio.sleep(0.5)

    async def _dial(self, key: str, host: str, port: int) -> None:
        url = f"{'wss' if self.node.config.tls_cert else 'ws'}://{url_host(host)}:{port}/mesh/ws"
        try:
            try:
                ws = await self.node.http.ws_connect(
                    url, max_msg_size=self.node.config.max_frame_bytes, compress=0, autoping=True,
                    timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
                )
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                self._backoff(key)
                log.debug("dial_failed", url=url, error=str(exc))
                return
            try:
                hello = await handshake(ws, self.node.identity, self.node.caps)
            except SelfLink:
                self._dial_after[key] = float("inf")  # never again
                await ws.close()
                return
            except (AuthError, ProtocolError) as exc:
                self._backoff(key, refused=True)
                log.warning("peer_refused", addr=f"{host}:{port}", reason=str(exc))
                await ws.close(code=CLOSE_AUTH, message=str(exc)[:120].encode())
                return
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                self._backoff(key)
                log.info("handshake_failed", addr=f"{host}:{port}", reason=str(exc))
                await ws.close()
                return
            self._dial_after.pop(key, None)
            await self._serve_link(Link(ws, hello, host, True, self.node.config.max_frame_bytes))
        finally:
            self._dialing.discard(key)

    def _backoff(self, key: str, refused: bool = False) -> None:
        wait = 10.0 if refused else 1.0
        self._dial_after[key] = time.monotonic() + wait

    async def ws_handler(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=self.node.config.max_frame_bytes, compress=False, autoping=True)
        await ws.prepare(request)
        try:
            hello = await handshake(ws, self.node.identity, self.node.caps)
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
        await self._serve_link(Link(ws, hello, request.remote or "", False, self.node.config.max_frame_bytes))
        return ws

    async def _serve_link(self, link: Link) -> None:
        if self.node.config.debug_link_delay_ms:
            link.simulate_delay(self.node.config.debug_link_delay_ms, self.node.config.debug_link_jitter_ms)
        if not self._register(link):
            await link.close("duplicate link", CLOSE_DUPLICATE)
            return
        try:
            await link.read_loop(self.node.handle)
        finally:
            self._unregister(link)

    def _preferred(self, link: Link) -> bool:
        """Of two links to one peer, keep the one the smaller id dialed."""
        return link.dialed == (self.node.node_id < link.peer_id)

    def _register(self, link: Link) -> bool:
        old = self.node.links.get(link.peer_id)
        if old is not None and old.alive and self._preferred(old) and not self._preferred(link):
            return False
        self.node.links[link.peer_id] = link
        self.node.lost.pop(link.peer_id, None)
        if old is not None and old.alive:
            self.node.spawn(old.close("replaced by a newer link", CLOSE_DUPLICATE))
        log.info("peer_joined", peer=link.peer_id, name=link.hello.name, addr=link.addr,
                 device=link.caps.device, vram=link.caps.vram)
        self.node.draining.discard(link.peer_id)  # a peer that comes back is no longer drained
        self.node.view_changed(f"peer {link.peer_id} joined")
        self.node.spawn(self.ping(link))  # an RTT to show (and to place by) from the start
        return True

    def _unregister(self, link: Link) -> None:
        if self.node.links.get(link.peer_id) is not link:
            return
        del self.node.links[link.peer_id]
        self.node.lost[link.peer_id] = LostPeer(link.hello, link.addr, time.time(), link.close_reason)
        log.warning("peer_lost", peer=link.peer_id, reason=link.close_reason)
        # A peer with no span (idle, or drained before it stopped) that is not the
        # supernode leaves the plan and the election as they are: re-planning would
        # only bump the term and replay every stream. Unless a negotiation waits on it.
        plan = self.node.plan
        negotiating = self.node._lead_task is not None and not self.node._lead_task.done()
        if (plan is not None and not negotiating and link.peer_id != self.node.supernode
                and all(a.node != link.peer_id for a in plan.assignments)):
            return
        self.node.view_changed(f"peer {link.peer_id} lost: {link.close_reason}", urgent=True)

    async def heartbeat_loop(self) -> None:
        """Ping every link each beat; a link silent for ``missed_beats`` beats is lost
        (a hung or partitioned peer sends no close)."""
        beat = self.node.config.heartbeat_s
        limit = beat * self.node.config.missed_beats
        while True:
            now = time.monotonic()
            for link in list(self.node.links.values()):
                if now - link.last_heard > limit:
                    self.node.spawn(link.close(f"missed {self.node.config.missed_beats} heartbeats"))
                else:
                    self.node.spawn(self.ping(link))
            for pid in [p for p, lost in self.node.lost.items() if time.time() - lost.since > LOST_SHOWN_S]:
                del self.node.lost[pid]
            await asyncio.sleep(beat)

    async def ping(self, link: Link) -> None:
        with contextlib.suppress(PeerLost):
            await link.call_ping()
