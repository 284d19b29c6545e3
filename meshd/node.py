"""The node: one per daemon. It builds the parts and wires them together, owns
every long-lived task (inside one TaskGroup) and the HTTP server, dispatches each
peer message to its handler, and shuts down in order.

The parts, and what each one owns:

- ``view`` (``control/mesh.py``): what this peer knows of the mesh.
- ``keeper`` (``control/links.py``): the links to peers (writes ``view.links``).
- ``leader`` (``control/leader.py``): who leads, the term, the plan (writes the rest of the view).
- ``follower`` (``control/follower.py``): this peer's side of a plan, and the forwards it serves.
- ``store`` (``control/store.py``): the model's files and the engine of this peer's part.
- ``uplink`` (``control/uplink.py``): the way to the supernode's API, and the waits of a failover.
- ``pipeline``, ``scheduler``, ``served`` (``serving/``): the supernode's requests, and its parts of
  the model that do not split; the HTTP side reads the node through the Protocols of ``serving/daemon.py``.

Only entry points (``tools/cli.py``) import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import aiohttp
import structlog
from aiohttp import web

from meshd.config import Config
from meshd.control.discovery import Advert, Discovery
from meshd.control.follower import Follower
from meshd.control.leader import Leader
from meshd.control.links import LinkKeeper
from meshd.control.mesh import MeshView
from meshd.control import tunnel
from meshd.control.peers import CLOSE_PROTOCOL, Link, url_host
from meshd.control.secure import LocalIdentity
from meshd.control.store import ModelStore, local_model
from meshd.control.transfer import AUTH_HEADER, TokenCheck
from meshd.control.uplink import Uplink
from meshd.errors import (
    KNOWN_ERRORS,
    BadRequest,
    ConfigError,
    ModelError,
    NoCapacity,
    PeerLost,
    ProtocolError,
    Stopping,
)
from meshd.hardware import detect_vram, memory_budget, pick_device, speed_probe, total_ram
from meshd.serving import api, batchapi
from meshd.serving.batch import BatchRunner
from meshd.serving.live import LiveFeed
from meshd.serving.metrics import NodeMetrics
from meshd.serving.openai import error_json
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Scheduler
from meshd.serving.served import ServedModel
from meshd.serving.server import GuardedSite, raise_nofile_limit
from meshd.serving.status import build_status
from meshd.serving.traces import TraceStore
from protocol.messages import (
    PROTOCOL_VERSION,
    Accept,
    ApiCancel,
    ApiRequest,
    Bye,
    Capabilities,
    Commit,
    Drop,
    ForwardBatch,
    Hello,
    Leaving,
    Measured,
    Message,
    ModelName,
    NodeId,
    Plan,
    Reject,
)
from shards.chat import ChatTemplate
from shards.chat_templates import GivenTemplate, given_template
from shards.engine import apart, default_threads, measure_parts
from shards.fetch import list_models
from shards.manifest import Manifest
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()

ABORT_GRACE_S = 1.0  # at the drain deadline, for the sessions ended then to tell their clients


def load_node_id(state_dir: Path) -> NodeId:
    """A node id that survives restarts, so a peer that comes back is known again."""
    path = state_dir / "node-id"
    if path.exists():
        return NodeId(path.read_text().strip())
    state_dir.mkdir(parents=True, exist_ok=True)
    node_id = secrets.token_hex(6)
    path.write_text(node_id + "\n")
    return NodeId(node_id)


def chat_template_of(config: Config) -> GivenTemplate | None:
    """``chat_template`` read and compiled at start: a bad name or file stops the daemon
    now, not the first chat."""
    if config.chat_template is None:
        return None
    try:
        given = given_template(config.chat_template)
        ChatTemplate(given.source, origin=given.origin).check()
    except ModelError as exc:
        raise ConfigError(str(exc)) from None
    return given


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
        # Engines and start-up probes run on the configured threads, passed to each (their
        # workers are threads of their own, made where no count is set); the daemon's own
        # thread keeps one (cmd_run: shards/engine.py default_threads).
        self.threads = config.threads or default_threads()
        self.identity = LocalIdentity(self.node_id, config.name, config.mesh, self.secret,
                                      plaintext=config.debug_plaintext_links)
        self.tokens = TokenCheck(self.secret)  # shard-file requests from peers
        self.local_token = secrets.token_hex(32)  # never leaves this process: see local_auth
        self.api_keys = config.load_keys(config.api_key_file)
        self.control_keys = config.load_keys(config.control_key_file)
        self.chat_template = chat_template_of(config)  # used only while this peer is the supernode
        self.started = time.time()
        self.stopping = False
        self.relays = 0  # completions this peer answers or relays to the supernode now (a stop waits for them)
        self.relays_ending = asyncio.Event()  # set at the drain deadline: relays still open end now
        self.http: aiohttp.ClientSession | None = None  # made when the node runs (it needs the loop)
        self._tg: asyncio.TaskGroup | None = None

        model = local_model(config)
        self.view = MeshView(self.node_id, self._capabilities(*model))
        self.store = ModelStore(config, self.view, self.secret, self._http_client, model, threads=self.threads)
        self.traces = TraceStore(self.node_id)  # request timelines: those running, the last few hundred
        self.metrics = NodeMetrics(self.view, self.device, self.status, self.traces,
                                   lambda: self.pipeline.totals)  # one registry per node
        self.traces.on_done = self.metrics.request_done
        self.pipeline = Pipeline(lambda: self.store.engine,
                                 on_stage_failed=lambda why: self.leader.view_changed(f"a stage failed: {why}",
                                                                                      urgent=True),
                                 node=self.node_id)
        self.scheduler = Scheduler(self.pipeline, None, on_finished=self.view.changes.pulse,
                                   prefix_entries=config.prefix_cache_entries, speculate=config.speculate)
        # The supernode's parts of the model that do not split: tokenizer, KV budget, draft model.
        self.served = ServedModel(config, self.view, self.scheduler, self.pipeline, self.chat_template, self.spawn)
        self.leader = Leader(config, self.view, self.store, self.pipeline, spawn=self.spawn,
                             local_runner=lambda engine: self.follower.runner(engine),
                             use_model=self.served.use, busy=lambda: bool(self.scheduler.active),
                             isolated_since=lambda: self.keeper.isolated_since)
        self.follower = Follower(config, self.view, self.store, self.leader, self.spawn,
                                 forwarded=self.metrics.forwarded)
        # The way to the supernode's API (this peer's own when it leads): the proxy, drains, views.
        self.uplink = Uplink(config, self.view, self._http_client, self.own_url, self.local_token,
                             lambda: self.pipeline.plan.term if self.pipeline.plan is not None else None)
        self.tunnel = tunnel.TunnelServer(self._http_client, self.own_url, self._tunneled_leave, self.spawn,
                                          self.local_token, lambda peer, body: self.batches.on_replica(peer, body))
        self.keeper = LinkKeeper(config, self.view, self.identity, self._http_client, self.spawn, self.handle,
                                 on_joined=self.leader.peer_joined, on_lost=self.leader.peer_lost,
                                 on_beat=self.leader.beat)
        self.batches = BatchRunner(self)  # batch jobs submitted to this peer, in its state dir
        self.live = LiveFeed(self.view, config.name, self.scheduler, lambda: self.pipeline.totals, self.traces,
                             self.batches.status)  # a sample a second, the last 15 minutes

    def _http_client(self) -> aiohttp.ClientSession:
        """The node's HTTP client, for its parts that are called only while it runs (the
        links, the tunnel, the store's downloads, the API): ``run`` makes it first."""
        return cast(aiohttp.ClientSession, self.http)

    # -- identity ------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.store.model_name

    def _measure(self, model_dir: Path | None, manifest: Manifest | None) -> Measured:
        """This box's real cost of the configured model's layer and head, when it has the
        model (about a second: one layer and the head are loaded and timed); placement
        balances stages on it. A simulated slow box (debug delay) looks slow here too."""
        if model_dir is None or manifest is None:
            return Measured()
        try:
            t = apart(lambda: measure_parts(model_dir, self.config.device, self.config.dtype), self.threads)
        except (*KNOWN_ERRORS, OSError, RuntimeError) as exc:  # torch's too (out of memory): the probe serves
            log.warning("measure_failed", model=manifest.name, error=str(exc))
            return Measured()
        delay = self.config.debug_layer_delay_ms
        m = Measured(manifest.name, round(t.layer_ms + delay, 4), round(t.layer_ms_batch + delay, 4),
                     round(t.head_ms, 4), round(t.head_ms_batch, 4), t.batch)
        log.info("model_measured", model=m.model, layer_ms=m.layer_ms, layer_ms_batch=m.layer_ms_batch,
                 head_ms=m.head_ms, head_ms_batch=m.head_ms_batch, batch=m.batch)
        return m

    def _capabilities(self, model_dir: Path | None, manifest: Manifest | None) -> Capabilities:
        vram = self.config.advertise_vram
        if vram is None:
            vram = detect_vram(self.device)
        models = {ModelName(m.name) for m in list_models(self.config.state_dir)}
        if manifest is not None:
            models.add(ModelName(manifest.name))
        # A simulated slow box (debug delay) must look slow to placement too.
        layer_ms = apart(lambda: speed_probe(self.device), self.threads) + self.config.debug_layer_delay_ms
        return Capabilities(
            vram=vram,
            ram=total_ram(),
            device=self.device,
            api_port=self.config.port,
            mem_budget=memory_budget(self.device, self.config.mem_budget),
            layer_ms=round(layer_ms, 4),
            models=tuple(sorted(models)),
            measured=self._measure(model_dir, manifest),
        )

    def _advert(self) -> Advert:
        caps = self.view.caps
        return Advert(self.node_id, self.config.name, self.config.mesh, PROTOCOL_VERSION, "", self.config.port,
                      caps.vram, caps.ram, self.device)

    # -- running -------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = api.make_app(self)
        batchapi.add_routes(app)  # OpenAI's Batch API (/v1/files, /v1/batches) over this peer's runner
        app.router.add_get("/mesh/ws", self.keeper.ws_handler)
        app.router.add_get("/mesh/files/{model}/{name}", self._files_handler)
        return app

    async def run(self, stop: asyncio.Event, on_ready=None, watchdog=None) -> None:
        """Serve until ``stop`` is set, then shut down in order."""
        server_tls, client_tls = tls_contexts(self.config)
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5),
                                          connector=aiohttp.TCPConnector(ssl=client_tls))
        # A client that hangs up cancels its handler, so its sessions are freed at once.
        # keepalive_timeout: aiohttp's timer runs from accept until a request is whole, so
        # it closes idle connections and ones that dribble their headers alike.
        runner = web.AppRunner(self.make_app(), shutdown_timeout=self.config.drain_timeout_s,
                               handler_cancellation=True, keepalive_timeout=self.config.http_idle_s)
        discovery = None
        deadline: float | None = None  # of the stop, once it began
        try:
            nofile = raise_nofile_limit()
            await runner.setup()
            site = GuardedSite(runner, self.config.host, self.config.port, ssl_context=server_tls,
                               max_connections=min(self.config.max_connections, max(8, nofile - 64)))
            await site.start()
            log.info("node_started", node=self.node_id, name=self.config.name, mesh=self.config.mesh,
                     port=self.config.port, device=self.device, vram=self.view.caps.vram, model=self.model_name,
                     has_model=self.store.manifest is not None)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                if self.config.mdns:
                    discovery = Discovery(self._advert(), self.keeper.events,
                                          list(self.config.mdns_interface) or None)
                    await discovery.start()
                    tg.create_task(self.keeper.discovery_loop())
                tg.create_task(self.leader.run())
                tg.create_task(self.scheduler.run())
                tg.create_task(self.batches.run(client_tls))
                tg.create_task(self.keeper.heartbeat_loop())
                tg.create_task(self.keeper.connect_loop())
                tg.create_task(self.live.run())
                if on_ready is not None:
                    tg.create_task(self._notify_ready(on_ready))
                if watchdog is not None:
                    tg.create_task(watchdog())
                self.leader.view_changed("start")
                await stop.wait()
                log.info("node_stopping")
                self.stopping = True  # new requests get a 503 from here on; those in flight finish
                self.batches.stop()  # batch lines in flight are cut off: they run again after a restart
                # The whole stop takes one drain timeout, whatever is left running.
                deadline = time.monotonic() + self.config.drain_timeout_s
                if discovery is not None:  # stop announcing first
                    await discovery.close()
                    discovery = None
                led = self.view.is_supernode
                await self._step_down()  # no peer elects this one again; a supernode hands the lead on
                if not led:
                    await self.request_own_drain(deadline)  # hand the span away
                await self._drain(deadline)  # let in-flight sessions finish
                for link in list(self.view.links.values()):
                    with contextlib.suppress(Exception):
                        await link.send(Bye("shutting down"))
                raise _Stopped
        # A long-lived task (the leader's, a link loop) that asked for new work while the
        # group was being torn down ends with Stopping: part of the stop, not a failure.
        except* (_Stopped, Stopping):
            pass
        finally:
            if discovery is not None:
                await discovery.close()
            for link in list(self.view.links.values()):
                await link.close("node stopped")
            if deadline is not None:  # requests still open here get what is left of the drain timeout
                runner._shutdown_timeout = max(1.0, deadline - time.monotonic())  # aiohttp reads it at cleanup
            await runner.cleanup()
            await self.http.close()
            self.store.close()
            if self.scheduler.drafter is not None:  # (its worker joined off the loop)
                await asyncio.to_thread(self.scheduler.drafter.close)
            log.info("node_stopped")

    async def _step_down(self) -> None:
        """Tell every peer this one is stopping (``Leaving``), so that none elects it again.
        A supernode hands the lead on at once, while its links are still up: its sessions
        go on at the next one (entry peers resubmit theirs, its API hands on its own's),
        rather than the whole mesh waiting out its drain and then a heartbeat bound. Unless
        the peers left cannot hold the model: a supernode then leads on, alone, while it drains."""
        if self.view.is_supernode and not self.leader.others_can_lead():
            log.info("supernode_drains_leading", reason="the peers left cannot hold the model")
            return
        for link in list(self.view.live_links().values()):
            try:
                await link.send(Leaving("shutting down"))
            except (PeerLost, ConnectionError, aiohttp.ClientError) as exc:
                log.debug("leaving_not_sent", peer=link.peer_id, error=str(exc))
        self.leader.step_down()

    async def _drain(self, deadline: float) -> None:
        """Let in-flight sessions, and the completions this peer relays to the supernode,
        finish by ``deadline``; sessions left then end now, with a 503 that says so (an entry
        peer resubmits its own at the next supernode)."""
        def done() -> bool:
            return not self.scheduler.active and not self.relays

        left = max(0.0, deadline - time.monotonic() - ABORT_GRACE_S)
        if not await self.view.changes.wait_for(done, left):
            log.warning("drain_timeout", sessions=len(self.scheduler.active), relays=self.relays)
            self.relays_ending.set()
            await self.pipeline.suspend("this peer is shutting down", moved=True)
            await self.view.changes.wait_for(done, ABORT_GRACE_S)

    @contextlib.contextmanager
    def relaying(self) -> Iterator[asyncio.Event]:
        """Counts a completion this peer answers or relays to the supernode while it runs
        (a stop waits for it); yields the event set when the stop waits no longer."""
        self.relays += 1
        try:
            yield self.relays_ending
        finally:
            self.relays -= 1
            self.view.changes.pulse()

    async def _notify_ready(self, on_ready) -> None:
        await self.view.changes.wait_for(self.uplink.serves, None)
        on_ready()

    def spawn(self, coro, link: Link | None = None) -> asyncio.Task:
        """A task owned by the node's group (per-message work of the read loops).

        The task is guarded: an error it does not handle itself is logged and ends only
        what it belongs to (the ``link`` whose message it serves, closed with the reason),
        never the group, which would stop the daemon."""
        assert self._tg is not None
        task = _guarded(coro, link)
        try:
            started = self._tg.create_task(task)
        except RuntimeError:  # the group is shutting down: nothing new starts, the node stops
            task.close()
            coro.close()
            raise Stopping("this peer is stopping") from None
        # A task cancelled before it ran (the node stopped with a message just read) never
        # awaited ``coro``: closed here, it is not reported as a coroutine never awaited.
        started.add_done_callback(lambda _: coro.close())
        return started

    # -- messages ------------------------------------------------------------------

    async def handle(self, link: Link, msg: Message) -> None:
        """Every message the link's read loop does not settle itself (pings, results,
        goodbyes), to its handler. Nothing here may block the read loop: work that
        waits goes to a task."""
        match msg:
            case Plan():
                self.spawn(self.follower.on_plan(link, msg), link)
            case ForwardBatch():
                self.spawn(self.follower.serve_forward(link, msg), link)
            case Leaving():
                self.leader.peer_leaving(link.peer_id)
            case Hello():
                raise ProtocolError(f"{type(msg).__name__} after the handshake")
            case Commit() | Drop() | Accept() | Reject() | ApiRequest() | ApiCancel():
                try:
                    self._settle(link, msg)
                except (ProtocolError, PeerLost):
                    raise
                except Exception as exc:  # a message our code did not foresee closes its link, not the node
                    log.exception("message_failed", peer=link.peer_id, message=type(msg).__name__)
                    raise ProtocolError(f"{type(msg).__name__} could not be handled: {exc!r}") from exc
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__}")

    def _settle(self, link: Link, msg: Commit | Drop | Accept | Reject | ApiRequest | ApiCancel) -> None:
        """The messages handled at once, inside the read loop."""
        match msg:
            case Commit():
                self.follower.on_commit(link, msg)
            case Drop(session=session):
                self.follower.drop(session)
            case Accept() | Reject():
                self.leader.on_reply(link.peer_id, msg)
            case ApiRequest():
                self.tunnel.on_request(link, msg)
            case ApiCancel():
                self.tunnel.on_cancel(link, msg)

    # -- the supernode's serving parts --------------------------------------------------

    async def serving_parts_soon(self) -> tuple[MeshTokenizer, int] | None:
        """The supernode's serving parts, waiting (within the failover wait) while it
        negotiates its first plan: a peer just elected serves, not 503s."""
        if self.serving_parts() is None and self.leader.negotiating():
            await self.view.changes.wait_for(lambda: self.serving_parts() is not None or not self.leader.negotiating(),
                                             self.config.failover_wait_s)
        return self.serving_parts()

    def serving_parts(self) -> tuple[MeshTokenizer, int] | None:
        tokenizer, manifest = self.scheduler.tokenizer, self.store.manifest
        if tokenizer is None or manifest is None or self.pipeline.plan is None:
            return None
        return tokenizer, manifest.config.max_position

    def status(self) -> dict:
        return build_status(self)

    # -- files and drain -------------------------------------------------------------

    async def _files_handler(self, request: web.Request) -> web.FileResponse:
        self.tokens.check(request.headers.get(AUTH_HEADER), request.method, request.path)
        return self.store.serve_file(request.match_info["model"], request.match_info["name"])

    async def drain_peer(self, peer: NodeId) -> dict:
        return await self.leader.drain(peer)

    async def request_own_drain(self, deadline: float) -> None:
        """At shutdown, a stage asks the supernode to move its span away first (by half
        the time to ``deadline``: the sessions it serves itself need the rest)."""
        if self.view.is_supernode or not self.view.in_plan(self.node_id):
            return
        try:
            async with asyncio.timeout(max(1.0, (deadline - time.monotonic()) / 2)):
                if not await self.view.changes.wait_for(self.uplink.routable, 2.0):
                    raise NoCapacity("no supernode")
                async with self.uplink.post(tunnel.LEAVE, {}) as resp:  # no key needed for itself
                    await resp.read()
                    log.info("drained_self", status=resp.status)
        except (aiohttp.ClientError, TimeoutError, NoCapacity) as exc:
            log.warning("drain_self_failed", error=str(exc))

    async def _tunneled_leave(self, peer: str) -> tuple[int, bytes]:
        """A member leaving asks over its link that its own span be moved away: (status, JSON body)."""
        if not self.view.is_supernode:
            return 503, json.dumps(error_json("not the supernode (any more)", 503)).encode()
        try:
            return 200, json.dumps(await self.drain_peer(NodeId(peer))).encode()
        except BadRequest as exc:
            return exc.status, json.dumps(error_json(str(exc), exc.status, exc.param)).encode()
        except NoCapacity as exc:
            return 503, json.dumps(error_json(f"the mesh cannot serve now: {exc}", 503)).encode()
        except KNOWN_ERRORS as exc:
            log.warning("drain_failed", node=peer, error=str(exc))
            return 500, json.dumps(error_json(f"drain failed: {exc}", 500)).encode()

    def local_auth(self) -> dict[str, str]:
        return {api.LOCAL_HEADER: self.local_token}

    def own_url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"{self.config.scheme}://{url_host(host)}:{self.config.port}"


async def _guarded(coro, link: Link | None) -> None:
    """Run one spawned task; what escapes it closes its link (if any) and is logged."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the one catch-all: no task may end the node's TaskGroup
        peer = link.peer_id if link is not None else None
        log.exception("task_failed", task=getattr(coro, "__qualname__", repr(coro)), peer=peer, error=repr(exc))
        if link is not None:
            await link.close(f"internal error on its message: {exc!r}"[:200], CLOSE_PROTOCOL)


class _Stopped(Exception):
    """Raised inside the node's TaskGroup to end every task at shutdown."""
