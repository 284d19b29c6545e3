"""The HTTP server's limits: how many connections it holds, how long an idle one (or one
still sending its headers) stays, and how many files the process may open.

1,100 idle connections used to take every file descriptor (the soft limit is often
1024): accept() failed in a loop, logging a traceback each time, and /healthz went
unanswered. Now the soft limit is raised to the hard one, and past ``max_connections``
the oldest idle connection (kept alive, or never past its headers) makes room for the
new one, so a client that asks something gets in. aiohttp's keep-alive timer, which
starts at accept and runs until a request is whole, closes idle and slow-header ones.
"""

from __future__ import annotations

import asyncio
import resource
import time

import structlog
from aiohttp import web

log = structlog.get_logger()

WANT_NOFILE = 65536


def raise_nofile_limit(want: int = WANT_NOFILE) -> int:
    """Raise this process's soft limit on open files toward ``want`` (never above the
    hard limit); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("nofile_limit_unchanged", soft=soft, hard=hard, error=str(exc))
    return soft


class _Refused(asyncio.Protocol):
    """A connection past the limit with nothing idle to close: a 503 and goodbye."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        transport.close()


class GuardedSite(web.TCPSite):
    """A TCPSite that holds at most ``max_connections`` connections."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, max_connections: int,
                 ssl_context=None):
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=1024)
        self.max_connections = max_connections
        self.evicted = 0
        self.refused = 0
        self._logged_at = 0.0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        self._server = await asyncio.get_running_loop().create_server(
            self._protocol, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        conns = server.connections
        if len(conns) >= self.max_connections:
            # aiohttp marks a handler busy from a whole request's arrival to its answer's end
            # (a WebSocket link stays busy); an unknown aiohttp counts every one as busy.
            idle = next((h for h in conns if not getattr(h, "_request_in_progress", True)
                         and h.transport is not None and not h.transport.is_closing()), None)
            if idle is None:
                self.refused += 1
                self._note("connections_refused")
                return _Refused()
            idle.force_close()
            self.evicted += 1
            self._note("connections_evicted")
        return server()

    def _note(self, event: str) -> None:
        now = time.monotonic()
        if now - self._logged_at >= 1.0:  # at most once a second, however many come
            self._logged_at = now
            log.warning(event, limit=self.max_connections, evicted=self.evicted, refused=self.refused)
