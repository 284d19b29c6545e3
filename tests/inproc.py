"""Helpers for in-process tests of one part of a peer (no namespaces, no root): a
configuration, a peer's capabilities, a stand-in for a peer's link where the link is
not what is under test, and a task group for the part's ``spawn``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from meshd.config import Config, build_config
from meshd.control.mesh import MeshView
from meshd.control.store import ModelStore
from protocol.messages import PROTOCOL_VERSION, Capabilities, Hello, Message, NodeId

GiB = 1 << 30


def config(state_dir: Path, model: Path | str = "none", **flags) -> Config:
    return build_config(environ={}, flags={"state_dir": state_dir, "model": str(model), "device": "cpu",
                                           "dtype": "float32", "mdns": False, "settle_s": 0.05, **flags})


def caps(vram: int = 0, layer_ms: float = 1.0, mem_budget: int = 100 * GiB, models: tuple[str, ...] = (),
         api_port: int = 1) -> Capabilities:
    return Capabilities(vram=vram, ram=8 * GiB, device="cpu", api_port=api_port, mem_budget=mem_budget,
                        layer_ms=layer_ms, models=models)


class FakeLink:
    """A linked peer as the part under test sees it: what it advertises, and every
    message sent to it; ``answer`` (if set) replies to each message, like the peer would."""

    def __init__(self, peer_id: str, caps: Capabilities, answer: Callable[[Message], None] | None = None):
        self.peer_id = NodeId(peer_id)
        self.hello = Hello(PROTOCOL_VERSION, self.peer_id, "home", peer_id, caps)
        self.addr = "127.0.0.1"
        self.alive = True
        self.rtt_ms: float | None = 0.3
        self.close_reason = ""
        self.leaving = False  # it sent Leaving
        self.sent: list[Message] = []
        self.answer = answer

    @property
    def caps(self) -> Capabilities:
        return self.hello.caps

    @property
    def rtt_floor_ms(self) -> float | None:
        return self.rtt_ms

    @property
    def rtt_samples(self) -> int:
        return 8

    async def call_ping(self) -> None:
        pass

    async def send(self, msg: Message) -> None:
        self.sent.append(msg)
        if self.answer is not None:
            asyncio.get_running_loop().call_soon(self.answer, msg)

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


def view_with(me: str, my_caps: Capabilities, *links: FakeLink) -> MeshView:
    view = MeshView(NodeId(me), my_caps)
    for link in links:
        view.add_link(link)
    return view


def store_for(cfg: Config, view: MeshView, model_dir: Path | None) -> ModelStore:
    from shards.manifest import Manifest

    model = (model_dir, Manifest.load(model_dir)) if model_dir is not None else (None, None)
    return ModelStore(cfg, view, b"s" * 32, http=lambda: None, model=model)


class Tasks:
    """A part's ``spawn``: the tasks it starts, cancelled when the test ends."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task] = []

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task


async def until(ready: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait (bounded) for a condition the part under test makes true."""
    async with asyncio.timeout(timeout):
        while not ready():
            await asyncio.sleep(0.01)
