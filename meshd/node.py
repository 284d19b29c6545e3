"""The node: one per daemon. It owns the HTTP server, the discovery, the peer
links and every long-lived task (inside one TaskGroup), and holds what this
peer knows of the mesh: who is supernode, under which term, with which plan.

The supernode's side of negotiation lives in ``meshd.leader``, a stage's side
(plans, loading a span, serving forwards) in ``meshd.stage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
import time
from pathlib import Path

import aiohttp
import structlog
import torch
from aiohttp import web

from meshd import api, leader, stage
from meshd.config import Config
from meshd.discovery import Advert, Discovery
from meshd.election import elect
from meshd.errors import BadRequest, NoCapacity
from meshd.metrics import NodeMetrics
from meshd.hardware import detect_vram, memory_budget, pick_device, speed_probe, total_ram
from meshd.links import LinkKeeper, LostPeer, url_host
from meshd.peers import Link, LocalIdentity
from meshd.pipeline import Pipeline
from meshd.placement import Candidate
from meshd.scheduler import Scheduler, kv_bytes_per_token
from meshd.serving.batch import BatchRunner
from meshd.transfer import AUTH_HEADER, check_files_token, files_token, serve_file
from protocol.messages import PROTOCOL_VERSION, Bye, Capabilities, Message, NodeId, Plan
from shards.engine import StageEngine
from shards.fetch import list_models
from shards.manifest import MANIFEST_FILE, Manifest
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()

DEFAULT_HOP_MS = 0.3  # a LAN round trip of one decode frame, before any is measured
TERMS_KEPT = 20  # term history shown by /status
KV_SHARE = 0.25  # of a peer's memory budget, for KV caches when no budget is configured


def load_node_id(state_dir: Path) -> NodeId:
    """A node id that survives restarts, so a peer that comes back is known again."""
    path = state_dir / "node-id"
    if path.exists():
        return NodeId(path.read_text().strip())
    state_dir.mkdir(parents=True, exist_ok=True)
    node_id = secrets.token_hex(6)
    path.write_text(node_id + "\n")
    return NodeId(node_id)


def tls_contexts(config: Config) -> tuple[ssl.SSLContext | None, ssl.SSLContext | bool]:
    """(server context, what the client side verifies with): no TLS unless configured."""
    if config.tls_cert is None:
        return None, True
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_ca is None:
        return server, False  # encrypted; peers are authenticated by the mesh HMAC
    client = ssl.create_default_context(cafile=str(config.tls_ca))
    client.check_hostname = False  # peers are found by address, not name
    return server, client


class Node:
    def __init__(self, config: Config):
        self.config = config
        self.secret = config.load_secret()
        self.node_id = load_node_id(config.state_dir)
        self.device = pick_device(config.device)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.identity = LocalIdentity(self.node_id, config.name, config.mesh, self.secret)
        self.api_keys = config.load_keys(config.api_key_file)
        self.control_keys = config.load_keys(config.control_key_file)
        self.links: dict[NodeId, Link] = {}
        self.lost: dict[NodeId, LostPeer] = {}
        self.keeper = LinkKeeper(self)
        self.term = 0
        self.supernode: NodeId | None = None
        self.plan: Plan | None = None  # the active plan as this peer knows it
        self.engine: StageEngine | None = None
        self.engine_key: tuple | None = None
        self.tokenizer = None
        self.pending_plan: Plan | None = None  # the latest plan received, while it loads
        self.prepared: tuple[Plan, StageEngine | None] | None = None  # loaded, awaiting Commit
        self.pending_replies: dict[NodeId, asyncio.Future] = {}  # supernode: Accept/Reject per peer
        self.pending_term = 0  # supernode: the term of the plan those replies answer
        self.replicating = False
        self.stopping = False
        self.model_dir, self.manifest = self._local_model()
        self.pipeline = Pipeline(lambda: self.engine,
                                 on_stage_failed=lambda why: self.view_changed(f"a stage failed: {why}", urgent=True))
        self.scheduler = Scheduler(self.pipeline, None)
        self.unavailable = "starting"
        self.started = time.time()
        self.http: aiohttp.ClientSession | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._view_changed = asyncio.Event()
        self._loss_pending = False
        self._view_reason = "start"
        self.draining: set[NodeId] = set()  # supernode: peers being moved off the plan
        self.history: list[dict] = []  # the terms this peer has seen become active, newest last
        self.events: asyncio.Queue = asyncio.Queue()  # discovery's PeerSeen / PeerGone
        self._lead_task: asyncio.Task | None = None
        self.caps = self._capabilities()
        self.metrics = NodeMetrics(self)  # one registry per node: several run in one test process
        self.batches = BatchRunner(self)  # batch jobs submitted to this peer, in its state dir

    # -- identity ------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        if self.manifest is not None:
            return self.manifest.name
        return Path(self.config.model).name

    def _local_model(self) -> tuple[Path | None, Manifest | None]:
        model = self.config.model
        path = Path(model).expanduser()
        if not (path.is_absolute() or model.startswith(".") or "/" in model):
            path = self.config.state_dir / "models" / model
        if (path / MANIFEST_FILE).is_file():
            return path, Manifest.load(path)
        return path if path.is_absolute() or "/" in model else None, None

    def _capabilities(self) -> Capabilities:
        vram = self.config.advertise_vram
        if vram is None:
            vram = detect_vram(self.device)
        models = {m.name for m in list_models(self.config.state_dir)}
        # A simulated slow box (debug delay) must look slow to placement too.
        layer_ms = speed_probe(self.device) + self.config.debug_layer_delay_ms
        if self.manifest is not None:
            models.add(self.manifest.name)
        return Capabilities(
            vram=vram,
            ram=total_ram(),
            device=self.device,
            api_port=self.config.port,
            mem_budget=memory_budget(self.device, self.config.mem_budget),
            layer_ms=round(layer_ms, 4),
            models=tuple(sorted(models)),
        )

    def candidates(self) -> list[Candidate]:
        """This peer's view: itself plus every live, authenticated link."""
        view = [Candidate.from_caps(self.node_id, self.caps)]
        view += [Candidate.from_caps(pid, link.caps) for pid, link in self.links.items() if link.alive]
        return view

    def hop_ms(self) -> float:
        """The median measured link RTT, the cost of sending a span off the supernode."""
        rtts = sorted(link.rtt_ms for link in self.links.values() if link.alive and link.rtt_ms is not None)
        return rtts[len(rtts) // 2] if rtts else DEFAULT_HOP_MS

    @property
    def is_supernode(self) -> bool:
        return self.supernode == self.node_id

    def serves(self) -> bool:
        if self.is_supernode:
            return self.pipeline.plan is not None
        link = self.links.get(self.supernode) if self.supernode else None
        return (self.plan is not None and self.plan.supernode == self.supernode
                and link is not None and link.alive)

    def serving_parts(self):
        if self.tokenizer is None or self.manifest is None or self.pipeline.plan is None:
            return None
        return self.tokenizer, self.manifest.config.max_position

    def unavailable_reason(self) -> str:
        return self.unavailable

    # -- running -------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[api.auth_middleware, api.errors_middleware])
        app[api.NODE] = self
        api.add_routes(app)
        app.router.add_get("/mesh/ws", self.keeper.ws_handler)
        app.router.add_get("/mesh/files/{model}/{name}", self._files_handler)
        return app

    async def run(self, stop: asyncio.Event, on_ready=None, watchdog=None) -> None:
        """Serve until ``stop`` is set, then shut down in order."""
        server_tls, client_tls = tls_contexts(self.config)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5),
                                          connector=aiohttp.TCPConnector(ssl=client_tls))
        # A client that hangs up cancels its handler, so its sessions are freed at once.
        runner = web.AppRunner(self.make_app(), shutdown_timeout=self.config.drain_timeout_s,
                               handler_cancellation=True)
        discovery = None
        try:
            await runner.setup()
            site = web.TCPSite(runner, self.config.host, self.config.port, ssl_context=server_tls)
            await site.start()
            log.info("node_started", node=self.node_id, name=self.config.name, mesh=self.config.mesh,
                     port=self.config.port, device=self.device, vram=self.caps.vram, model=self.model_name,
                     has_model=self.manifest is not None)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                if self.config.mdns:
                    discovery = Discovery(self._advert(), self.events, list(self.config.mdns_interface) or None)
                    await discovery.start()
                    tg.create_task(self.keeper.discovery_loop())
                tg.create_task(self._election_loop())
                tg.create_task(self.scheduler.run())
                tg.create_task(self.batches.run())
                tg.create_task(self.keeper.heartbeat_loop())
                tg.create_task(self.keeper.connect_loop())
                if on_ready is not None:
                    tg.create_task(self._notify_ready(on_ready))
                if watchdog is not None:
                    tg.create_task(watchdog())
                self.view_changed("start")
                await stop.wait()
                log.info("node_stopping")
                self.stopping = True  # new requests get a 503 from here on; those in flight finish
                self.batches.stop()  # batch lines in flight are cut off: they run again after a restart
                if discovery is not None:  # stop announcing first
                    await discovery.close()
                    discovery = None
                await self.request_own_drain()  # hand the span away
                await self._drain()  # let in-flight sessions finish
                for link in list(self.links.values()):
                    with contextlib.suppress(Exception):
                        await link.send(Bye("shutting down"))
                raise _Stopped
        except* _Stopped:
            pass
        finally:
            if discovery is not None:
                await discovery.close()
            for link in list(self.links.values()):
                await link.close("node stopped")
            await runner.cleanup()
            await self.http.close()
            if self.engine is not None:
                self.engine.close()
            log.info("node_stopped")

    async def _drain(self) -> None:
        """Let in-flight sessions finish, within the drain timeout."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.scheduler.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.scheduler.active:
            log.warning("drain_timeout", sessions=len(self.scheduler.active))

    async def _notify_ready(self, on_ready) -> None:
        while not self.serves():
            await asyncio.sleep(0.1)
        on_ready()

    def spawn(self, coro) -> asyncio.Task:
        """A task owned by the node's group (per-message work of the read loops)."""
        assert self._tg is not None
        return self._tg.create_task(coro)

    # -- discovery and dialing -----------------------------------------------------

    def _advert(self) -> Advert:
        return Advert(self.node_id, self.config.name, self.config.mesh, PROTOCOL_VERSION, "", self.config.port,
                      self.caps.vram, self.caps.ram, self.device)

    # -- messages ------------------------------------------------------------------

    async def handle(self, link: Link, msg: Message) -> None:
        """Everything the link's read loop does not settle itself; nothing here may
        block the read loop, so work goes to tasks."""
        await stage.handle(self, link, msg)

    # -- election --------------------------------------------------------------------

    async def _election_loop(self) -> None:
        while True:
            await self._view_changed.wait()
            # Settle: peers that start together should produce one plan, not one
            # each. A loss skips it: requests in flight are waiting on the re-plan.
            while not self._loss_pending:
                self._view_changed.clear()
                try:
                    await asyncio.wait_for(self._view_changed.wait(), self.config.settle_s)
                except TimeoutError:
                    break
            urgent, self._loss_pending = self._loss_pending, False
            # An urgent change skips the settling loop, which is what clears the
            # event: left set, it made a second re-plan (and replay) 1 s later.
            self._view_changed.clear()
            if not urgent:
                await self._defer_join()
                if self._loss_pending:  # a loss came while waiting: this re-plan covers it too
                    self._loss_pending = False
                    self._view_changed.clear()
            self._reelect()

    async def _defer_join(self) -> None:
        """A join re-plans only once the streams in flight are done (within
        ``join_defer_s``), so a peer that comes back disturbs none of them; the
        supernode stays the same, or a loss arrives meanwhile, or time runs out."""
        if not self.is_supernode or elect(self.candidates()) != self.node_id:
            return
        deadline = time.monotonic() + self.config.join_defer_s
        while self.scheduler.active and time.monotonic() < deadline and not self._loss_pending:
            await asyncio.sleep(0.1)

    def view_changed(self, reason: str, urgent: bool = False) -> None:
        """Something the plan depends on changed; ``urgent`` skips the settling
        (a loss or a drain: requests are waiting on the re-plan)."""
        self._view_reason = reason
        self._loss_pending = self._loss_pending or urgent
        self._view_changed.set()

    def _reelect(self) -> None:
        winner = elect(self.candidates())
        if self._lead_task is not None and not self._lead_task.done():
            self._lead_task.cancel()
        if winner == self.node_id:
            self.supernode = self.node_id
            self._lead_task = self.spawn(leader.lead(self, self._view_reason))
        else:
            if self.supernode == self.node_id:
                log.info("supernode_yields", to=winner)
                self.spawn(self.pipeline.set_plan(None, f"supernode moved to {winner}"))
            self.supernode = winner
            self.unavailable = f"waiting for a plan from {winner}"

    # -- plans and models ----------------------------------------------------------

    def activate(self, plan: Plan, engine: StageEngine | None, reason: str = "") -> None:
        """Make ``plan`` this peer's active plan, with ``engine`` for its part."""
        self.plan = plan
        self.supernode = plan.supernode
        self.history.append({"term": plan.term, "at": round(time.time(), 3), "reason": reason,
                             "plan": [{"node": a.node, "start": a.span.start, "stop": a.span.stop}
                                      for a in plan.assignments]})
        del self.history[:-TERMS_KEPT]
        if engine is not self.engine:
            old, self.engine = self.engine, engine
            if old is not None:
                old.close()

    def adopt_model(self, model_dir: Path, manifest: Manifest) -> None:
        self.model_dir, self.manifest = model_dir, manifest

    def tokenizer_for(self, model_dir: Path) -> None:
        """The supernode's parts that do not split: tokenizer, and the KV admission budget."""
        if self.tokenizer is None:
            self.tokenizer = MeshTokenizer.load(model_dir)
            self.scheduler.tokenizer = self.tokenizer
        if self.manifest is not None:
            budget = self.config.kv_budget_tokens
            if budget is None:
                per_token = kv_bytes_per_token(self.manifest.config, torch.float32)
                budget = max(self.manifest.config.max_position, int(self.caps.mem_budget * KV_SHARE) // per_token)
            self.scheduler.kv_budget_tokens = budget

    # -- files and status ----------------------------------------------------------

    async def _files_handler(self, request: web.Request) -> web.FileResponse:
        check_files_token(self.secret, request.headers.get(AUTH_HEADER, ""), request.path)
        return serve_file(self.model_dir, self.manifest, request.match_info["model"], request.match_info["name"])

    def status(self) -> dict:
        from meshd.status import build_status

        return build_status(self)

    # -- drain ---------------------------------------------------------------------

    async def drain_peer(self, peer: NodeId) -> dict:
        """Supernode: move ``peer``'s span to the others, and return once a plan
        without it is active (a planned shutdown then loses no time)."""
        if peer == self.node_id:
            raise BadRequest("the supernode cannot be drained: stop it and the next peer takes over", 409)
        if peer not in self.links:
            raise BadRequest(f"no peer {peer} in this mesh", 404, param="node")
        self.draining.add(peer)
        self.view_changed(f"drain {peer}", urgent=True)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline:
            plan = self.pipeline.plan
            if plan is not None and all(a.node != peer for a in plan.assignments):
                return {"node": peer, "drained": True, "term": plan.term,
                        "plan": [{"node": a.node, "start": a.span.start, "stop": a.span.stop}
                                 for a in plan.assignments]}
            if self.pipeline.plan is None and self.unavailable and "room" in self.unavailable:
                break
            await asyncio.sleep(0.05)
        self.draining.discard(peer)
        self.view_changed(f"drain of {peer} undone")
        raise NoCapacity(f"could not move {peer}'s span away: {self.unavailable or 'timed out'}")

    async def request_own_drain(self) -> None:
        """At shutdown, a stage asks the supernode to move its span away first."""
        plan = self.plan
        if self.is_supernode or plan is None or all(a.node != self.node_id for a in plan.assignments):
            return
        try:
            base = await asyncio.wait_for(self.supernode_base_url(), 2.0)
            path = "/v1/mesh/drain"
            headers = self.mesh_auth(path)
            timeout = aiohttp.ClientTimeout(total=self.config.drain_timeout_s)
            async with self.http.post(base + path, json={"node": self.node_id}, headers=headers,
                                      timeout=timeout) as resp:
                log.info("drained_self", status=resp.status)
        except (aiohttp.ClientError, TimeoutError, NoCapacity) as exc:
            log.warning("drain_self_failed", error=str(exc))

    # -- for the entry peer's proxy ---------------------------------------------------

    def current_term(self) -> int:
        plan = self.pipeline.plan if self.is_supernode else self.plan
        return plan.term if plan is not None else 0

    def mesh_auth(self, path: str) -> dict[str, str]:
        """The header that lets a peer's API take a request we forward."""
        return {AUTH_HEADER: files_token(self.secret, self.node_id, path)}

    def peer_url(self, link: Link) -> str:
        return f"{self.config.scheme}://{url_host(link.addr)}:{link.caps.api_port}"

    def own_url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{self.config.scheme}://{url_host(host)}:{self.config.port}"

    async def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise NoCapacity(f"{what}: {self.unavailable}")
            await asyncio.sleep(0.05)

    async def supernode_base_url(self) -> str:
        """Where to send a completion now: the supernode's API (maybe our own)."""
        await self._wait_for(self.serves, self.config.failover_wait_s, "no supernode serves")
        if self.is_supernode:
            return self.own_url()
        link = self.links[self.supernode]
        return self.peer_url(link)

    async def wait_new_term(self, term: int) -> None:
        """After losing the supernode mid-request: wait for the plan of the next one."""
        await self._wait_for(lambda: self.serves() and self.current_term() > term, self.config.failover_wait_s,
                             "no new supernode took over")


class _Stopped(Exception):
    """Raised inside the node's TaskGroup to end every task at shutdown."""
