"""What the serving side (HTTP API, proxy, status, metrics) reads of and asks of the
node, as Protocols: the node satisfies them, and nothing in serving/ imports it."""

from __future__ import annotations

from typing import Protocol

import aiohttp
from aiohttp import web

from meshd.config import Config
from meshd.control.mesh import MeshView
from meshd.control.store import ModelStore
from meshd.serving.metrics import NodeMetrics
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Scheduler
from protocol.messages import NodeId
from shards.tokenizer import MeshTokenizer


class Upstream(Protocol):
    """What the entry peer's proxy needs: where the supernode is, and how to wait for the next one."""

    config: Config
    http: aiohttp.ClientSession | None

    def current_term(self) -> int: ...

    async def supernode_base_url(self) -> str: ...

    async def wait_new_term(self, term: int) -> None: ...

    def mesh_auth(self, path: str) -> dict[str, str]: ...


class Daemon(Upstream, Protocol):
    node_id: NodeId
    secret: bytes
    api_keys: frozenset[str]
    control_keys: frozenset[str]
    device: str
    started: float
    stopping: bool
    view: MeshView
    store: ModelStore
    scheduler: Scheduler
    pipeline: Pipeline
    metrics: NodeMetrics

    @property
    def model_name(self) -> str: ...

    def serves(self) -> bool: ...

    def serving_parts(self) -> tuple[MeshTokenizer, int] | None:
        """The supernode's tokenizer and context length, once it serves."""

    def unavailable_reason(self) -> str: ...

    async def drain_peer(self, peer: NodeId) -> dict: ...

    def status(self) -> dict: ...


NODE = web.AppKey("node", Daemon)
# The request's id (x-request-id), set by the API's middleware, sent upstream by the proxy.
REQUEST_ID = web.RequestKey("request_id", str)
