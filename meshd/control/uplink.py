"""This peer's way to the supernode's API: whether a request sent here can go to one now,
a POST or GET there (over the sealed link's API tunnel, or on loopback when this peer is
the supernode), and the waits of a failover (``mark``, ``wait_change``). The entry peer's
proxy, /tokenize, drains and a member's read-only views use it; it holds no state of
its own beyond what the view says.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
import structlog

from meshd.config import Config
from meshd.control import tunnel
from meshd.control.mesh import MeshView
from meshd.errors import BadRequest, NoCapacity

log = structlog.get_logger()


class Uplink:
    def __init__(self, config: Config, view: MeshView, http: Callable[[], aiohttp.ClientSession],
                 own_url: Callable[[], str], local_token: str, serving_term: Callable[[], int | None]):
        """``serving_term``: the term of the plan this peer serves under as the supernode
        (None before it has one)."""
        self.config, self.view, self._http, self._own_url = config, view, http, own_url
        self._local_token, self._serving_term = local_token, serving_term

    def serves(self) -> bool:
        """Whether a completion sent here is served now: this peer is the supernode with a
        plan, or it follows the supernode of its plan over a live link."""
        view = self.view
        if view.is_supernode:
            return self._serving_term() is not None
        link = view.links.get(view.supernode) if view.supernode else None
        return view.plan is not None and view.plan.supernode == view.supernode and link is not None and link.alive

    def routable(self) -> bool:
        """Whether a completion sent here can go to a supernode now: as ``serves``, and a
        peer back from a restart, in no plan yet, sends it to the supernode it elects."""
        view = self.view
        if self.serves() or view.is_supernode or view.plan is not None:
            return self.serves()
        link = view.links.get(view.supernode) if view.supernode else None
        return link is not None and link.alive

    def current_term(self) -> int:
        term = self._serving_term() if self.view.is_supernode else (self.view.plan.term if self.view.plan else None)
        return term or 0

    def unavailable_reason(self) -> str:
        return str(self.view.unavailable or "")

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: object, authorization: str = "",
                   timeout: aiohttp.ClientTimeout | None = None, client: str = "", request_id: str = "",
                   traceparent: str = "") -> AsyncIterator:
        """POST ``body`` (JSON, or bytes as they are: a ``Generate`` frame) to the supernode's
        API: over the sealed link (the API tunnel), or on loopback when this peer is the
        supernode. Yields a response with ``status``, ``read()`` and the body's pieces
        (``content`` or ``chunks()``); fails as aiohttp does."""
        if not tunnel.plain_header(authorization):
            raise BadRequest("malformed Authorization header (printable ASCII only)", 401)
        await self._wait_for(self.routable, self.config.failover_wait_s, "no supernode serves")
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        if self.view.is_supernode:
            headers = tunnel.loopback_headers(self._local_token, authorization, client, request_id, traceparent,
                                              content_type=tunnel.content_type(path))
            async with self._http().post(self._own_url() + path, data=data, headers=headers, ssl=False,
                                         timeout=timeout) as up:
                yield up
            return
        supernode = self.view.supernode
        link = self.view.links.get(supernode) if supernode is not None else None
        if link is None:  # never: routable() just saw the supernode's link, and nothing ran since
            raise NoCapacity("no link to the supernode")
        async with tunnel.call(link, "POST", path, data, authorization,
                               sock_read=timeout.sock_read if timeout is not None else None, client=client,
                               request_id=request_id, traceparent=traceparent) as up:
            yield up

    @contextlib.asynccontextmanager
    async def get(self, path: str, timeout_s: float) -> AsyncIterator:
        """GET one of the supernode's read-only paths (``tunnel.READABLE``) over the sealed link."""
        link = self.view.links.get(self.view.supernode) if self.view.supernode else None
        if link is None or not link.alive:
            raise NoCapacity("no link to the supernode")
        async with tunnel.call(link, "GET", path, b"", sock_read=timeout_s) as up:
            yield up

    async def _wait_for(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        if not await self.view.changes.wait_for(ready, timeout):
            raise NoCapacity(f"{what}: {self.unavailable_reason()}")

    def mark(self) -> tuple:
        """Who serves now (supernode, term, link): what a failed attempt waits to see change."""
        view = self.view
        supernode = view.supernode
        link = view.links.get(supernode) if supernode is not None and not view.is_supernode else None
        return supernode, self.current_term(), link

    async def wait_change(self, mark: tuple, same_again: bool = True) -> None:
        """After an attempt failed (the supernode lost, yielded or stopping): wait until a
        supernode serves under another term, or another supernode, or over a new link. A
        supernode still there after the heartbeat bound, on the same link, was not lost
        (a cut stream, a pause it came back from): the next attempt goes to it again, not
        after the whole failover wait (unless it said it is not the supernode: not ``same_again``).
        NoCapacity when none does within the failover wait."""
        def changed() -> bool:
            now = self.mark()
            return self.routable() and (now[:2] != mark[:2] or now[2] is not mark[2])

        wait_s = self.config.failover_wait_s
        if not same_again:
            return await self._wait_for(changed, wait_s, "no new supernode took over")
        detect_s = self.config.heartbeat_s * self.config.missed_beats
        if await self.view.changes.wait_for(changed, detect_s):
            return
        log.info("upstream_unchanged", supernode=mark[0], term=mark[1], waited_s=detect_s)
        await self._wait_for(self.routable, max(0.0, wait_s - detect_s), "no new supernode took over")
