"""GET /live, /traces, /traces/{id} and /metrics/targets on every peer: the live
figures, the request timelines, and the mesh's peers as Prometheus scrape targets.

The supernode's figures and timelines are the mesh's. A member asks its supernode
for them over the sealed link (a GET through the API tunnel, ``control/tunnel.py``)
and answers with them, adding what is its own: the batch jobs it runs, and, for a
request it proxied, its part of the time (``proxy``: its handler and the tunnel,
what its client waited beyond the supernode's wall time). Read-only and open, as
/status and /metrics are: timings and ids, never a prompt or an answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import structlog
from aiohttp import web

from meshd.errors import NoCapacity
from meshd.serving.daemon import NODE, Daemon
from meshd.serving.openai import error_json
from meshd.serving.traces import PROXY, REQUEST_ID

log = structlog.get_logger()

RELAY_TIMEOUT_S = 2.0
MAX_LIST = 256


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_json(message, status, param), status=status)


def _int_query(request: web.Request, name: str, default: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 15 or int(raw) > hi:
        raise web.HTTPBadRequest(reason=f"{name} must be an integer in 0..{hi}")
    return int(raw)


def trace_json(node: Daemon, trace) -> dict:
    """A trace with the plan's layers and order for its stages."""
    plan = node.view.plan
    order = {a.node: i for i, a in enumerate(plan.assignments)} if plan is not None else {}
    return trace.to_json(layers=node.view.span_of, order=lambda peer: order.get(peer, len(order)))


def merge(theirs: dict | None, mine: dict | None) -> dict | None:
    """The supernode's timeline of a request and this entry peer's record of it, as one:
    the entry's wall time (what its client waited), the difference as its ``proxy`` phase."""
    if theirs is None or mine is None or not mine.get("proxied_to"):
        return theirs if theirs is not None else mine
    extra = max(0.0, float(mine["wall_ms"]) - float(theirs.get("wall_ms") or 0.0))
    phases = [p for p in theirs.get("phases", []) if isinstance(p, dict)]
    phases.append({"kind": PROXY, "peer": mine["node"], "prefill_ms": None, "decode_ms": None,
                   "ms": round(extra, 3)})
    return theirs | {"phases": phases, "entry": mine["node"], "supernode_wall_ms": theirs.get("wall_ms"),
                     "wall_ms": mine["wall_ms"], "status": mine["status"] if mine["status"] else theirs.get("status")}


class Observe:
    """The handlers; ``mesh_peer(request)`` tells a request a member tunneled here (never relayed again)."""

    def __init__(self, mesh_peer: Callable[[web.Request], bool]):
        self.mesh_peer = mesh_peer

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/live", self.live)
        app.router.add_get("/traces", self.traces)
        app.router.add_get("/traces/{id}", self.trace)
        app.router.add_get("/metrics/targets", targets)

    def _relays(self, request: web.Request) -> bool:
        """Whether this peer answers ``request`` with its supernode's figures: it is a member
        that serves, and the request is not one a member tunneled here."""
        node = request.app[NODE]
        return not node.view.is_supernode and not self.mesh_peer(request) and node.uplink.serves()

    async def _from_supernode(self, request: web.Request, path: str) -> tuple[int, object] | None:
        """(status, JSON) of ``path`` on the supernode, for a member; None on the supernode
        itself, for a request a member tunneled here, or when it does not answer in time."""
        node = request.app[NODE]
        if not self._relays(request):
            return None
        try:
            async with asyncio.timeout(RELAY_TIMEOUT_S):
                async with node.uplink.get(path, RELAY_TIMEOUT_S) as up:
                    return up.status, json.loads(await up.read())
        except (aiohttp.ClientError, TimeoutError, NoCapacity, ValueError) as exc:
            log.info("relay_failed", path=path, error=str(exc) or type(exc).__name__)
            return None

    async def live(self, request: web.Request) -> web.Response:
        """GET /live[?since=SEQ]: the samples after SEQ (all 15 minutes without), the peers,
        the batch jobs, the recent requests. ``source`` is the peer whose samples they are."""
        node = request.app[NODE]
        since = _int_query(request, "since", 0, 2**53)
        own = node.live.snapshot(since)
        got = await self._from_supernode(request, f"/live?since={since}")
        if got is None or got[0] != 200 or not isinstance(got[1], dict) or not isinstance(got[1].get("samples"), list):
            # relay_failed: the supernode's figures did not come (a page keeps the ones it has for a while)
            return web.json_response(own | {"relay_failed": self._relays(request)})
        theirs = got[1]
        mine = {b["id"] for b in own["batches"]}
        batches = [b for b in theirs.get("batches", []) if isinstance(b, dict) and b.get("id") not in mine]
        return web.json_response(theirs | {"node": own["node"], "batches": own["batches"] + batches})

    async def traces(self, request: web.Request) -> web.Response:
        """GET /traces[?limit=N]: the newest requests (running first) with their wall time and TTFT."""
        node = request.app[NODE]
        limit = _int_query(request, "limit", 20, MAX_LIST)
        got = await self._from_supernode(request, f"/traces?limit={limit}")
        if got is not None and got[0] == 200 and isinstance(got[1], dict):
            return web.json_response(got[1] | {"node": node.node_id})
        return web.json_response({"node": node.node_id, "source": node.node_id,
                                  "requests": node.traces.recent(limit)})

    async def trace(self, request: web.Request) -> web.Response:
        """GET /traces/{id}: one request's timeline, by x-request-id (or trace id)."""
        node = request.app[NODE]
        key = request.match_info["id"]
        if REQUEST_ID.fullmatch(key) is None:
            return _error("a request id is 1-128 characters of A-Z a-z 0-9 . _ : -", 400, "id")
        local = node.traces.get(key)
        mine = trace_json(node, local) if local is not None else None
        theirs = None
        if local is None or local.proxied:
            got = await self._from_supernode(request, f"/traces/{key}")
            if got is not None and got[0] == 200 and isinstance(got[1], dict) and isinstance(got[1].get("phases"), list):
                theirs = got[1]
        found = merge(theirs, mine)
        if found is None:
            return _error(f"no recent request {key!r} on this mesh's supernode (it keeps the last few hundred)",
                          404, "id")
        return web.json_response(found)


async def targets(request: web.Request) -> web.Response:
    """GET /metrics/targets: every live peer's API as a Prometheus HTTP service-discovery
    target group (``http_sd_configs``), this one as the scraper reached it."""
    node = request.app[NODE]
    view = node.view
    groups = [{"targets": [request.host], "labels": {"meshd_node": node.node_id, "meshd_name": node.config.name,
                                                     "meshd_mesh": node.config.mesh}}]
    for pid, link in sorted(view.links.items()):
        if link.alive:
            host = f"[{link.addr}]" if ":" in link.addr else link.addr
            groups.append({"targets": [f"{host}:{link.caps.api_port}"],
                           "labels": {"meshd_node": pid, "meshd_name": link.hello.name,
                                      "meshd_mesh": node.config.mesh}})
    return web.json_response(groups)
