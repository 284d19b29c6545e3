"""What the serving side (HTTP API, proxy, status, metrics) reads of and asks of the
node, as Protocols: the node satisfies them, and nothing in serving/ imports it."""

from __future__ import annotations

import asyncio
from typing import ContextManager, Protocol

from aiohttp import web

from meshd.config import Config
from meshd.control.mesh import MeshView
from meshd.control.store import ModelStore
from meshd.control.uplink import Uplink
from meshd.serving.batch import BatchRunner
from meshd.serving.live import LiveFeed
from meshd.serving.metrics import NodeMetrics
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Scheduler
from meshd.serving.traces import TraceContext, TraceStore
from protocol.messages import NodeId
from shards.tokenizer import MeshTokenizer


class Upstream(Protocol):
    """What the entry peer's proxy needs: the way to the supernode (and the waits of a
    failover), and the count of completions a stop waits for."""

    config: Config
    uplink: Uplink

    def relaying(self) -> ContextManager[asyncio.Event]:
        """Counts a completion this peer answers or relays to the supernode while it runs
        (a stop waits for it); yields the event set when the stop waits no longer."""


class Daemon(Upstream, Protocol):
    node_id: NodeId
    secret: bytes
    api_keys: frozenset[str]
    control_keys: frozenset[str]
    local_token: str  # see local_auth
    device: str
    started: float
    stopping: bool
    view: MeshView
    store: ModelStore
    scheduler: Scheduler
    pipeline: Pipeline
    metrics: NodeMetrics
    batches: BatchRunner
    traces: TraceStore
    live: LiveFeed

    @property
    def model_name(self) -> str: ...

    async def serving_parts_soon(self) -> tuple[MeshTokenizer, int] | None:
        """serving_parts, once a plan being negotiated is active (bounded)."""

    def serving_parts(self) -> tuple[MeshTokenizer, int] | None:
        """The supernode's tokenizer and context length, once it serves."""

    def own_url(self) -> str:
        """This peer's own API (batch lines are sent there, as any client's request)."""

    def local_auth(self) -> dict[str, str]:
        """The header that lets this process's own calls to its API past the keys (the batch
        runner's lines: their submitter was checked when the batch was made)."""

    async def drain_peer(self, peer: NodeId) -> dict: ...

    def status(self) -> dict: ...


NODE = web.AppKey("node", Daemon)
# The request's id (x-request-id), set by the API's middleware, sent upstream by the proxy.
REQUEST_ID = web.RequestKey("request_id", str)
# Its W3C trace context (traceparent), set by the same middleware, sent upstream and back in the answer.
TRACE = web.RequestKey("trace", TraceContext)
