"""Peer links: one authenticated, sealed WebSocket per pair of peers at /mesh/ws.

The handshake and the sealing of frames are ``meshd.control.secure``'s (Noise
with the mesh secret as pre-shared key); a Link only ever sees frames that
opened under its key. The read loop here is one of the three places errors are
caught: a ProtocolError closes this one link, with its reason, and nothing else;
a piece that does not open (injected, replayed) is dropped and logged.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum

import aiohttp
import structlog
import torch
from aiohttp import WSMsgType

from meshd.control.secure import CLOSE_AUTH, WS, Channel, Forged  # noqa: F401 (CLOSE_AUTH: the handshake's code, listed with ours)
from meshd.control.timing import STEP_TIMES
from meshd.errors import NoCapacity, PeerLost, ProtocolError, StageFailed
from meshd.hardware import process_rss
from protocol.codec import decode, encode
from protocol.messages import (
    ApiReply,
    Bye,
    Drop,
    Fail,
    FailCode,
    ForwardBatch,
    Hello,
    Leaving,
    Message,
    NodeId,
    Ping,
    Pong,
    ResultBatch,
    Segment,
    SessionId,
)
from shards.engine import URGENT
from shards.wire import from_wire, to_wire

log = structlog.get_logger()

# WebSocket close codes in the private range, so a peer's log says why.
CLOSE_PROTOCOL = 4002
CLOSE_DUPLICATE = 4003
CLOSE_LOST = 4004
CLOSE_BYE = 4005
# Round trips kept per link for its floor (one a heartbeat: the last several seconds).
RTT_WINDOW = 8


def step_error(peer: str, fail: Fail) -> StageFailed | NoCapacity:
    """What a stage's Fail means to the step that waits on it: a broken stage (StageFailed:
    a new plan, then a replay), or one whose caches have no room (KV_FULL: not a broken
    stage; the step's sessions end as the supernode's own full budget would end them)."""
    if fail.code is FailCode.KV_FULL:
        return NoCapacity(f"{peer} has no room for the step: {fail.reason}")
    return StageFailed(f"{peer} failed the step: {fail.reason}")


class LinkState(Enum):
    READY = "ready"
    CLOSED = "closed"


def url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def peer_url(scheme: str, link: Link) -> str:
    """The base URL of a linked peer's HTTP API (which also serves its shard files)."""
    return f"{scheme}://{url_host(link.addr)}:{link.caps.api_port}"


class Link:
    """An authenticated link to one peer; calls out (``call_*``), and feeds incoming
    messages to the node's handler."""

    def __init__(self, ws: WS, hello: Hello, channel: Channel, addr: str, dialed: bool, max_frame: int):
        self.ws = ws
        self.channel = channel
        self.hello = hello
        self.peer_id: NodeId = hello.node_id
        self.addr = addr
        self.dialed = dialed
        self.max_frame = max_frame
        self.state = LinkState.READY
        self.rtt_ms: float | None = None  # the last round trip, as shown
        self._rtts: deque[float] = deque(maxlen=RTT_WINDOW)
        self.ram_used: int | None = None  # the peer's resident memory, from its last Pong
        self.last_heard = time.monotonic()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.close_reason = ""
        self.leaving = False  # the peer said it is stopping: no longer a candidate for the election
        self._req = itertools.count(1)
        self._ping = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.api_replies: dict[int, asyncio.Queue] = {}  # tunneled requests we sent, by req
        self._send_lock = asyncio.Lock()
        self._delay = (0.0, 0.0)
        self._last_due = 0.0

    @property
    def rtt_floor_ms(self) -> float | None:
        """The least of the last few round trips: what the network costs. The rest is time
        the Pong waited behind a busy event loop (a peer that has just started, a host
        running other work), which a plan made on it would keep paying for nothing."""
        return min(self._rtts) if self._rtts else None

    @property
    def rtt_samples(self) -> int:
        return len(self._rtts)

    @property
    def caps(self):
        return self.hello.caps

    @property
    def alive(self) -> bool:
        return self.state is LinkState.READY

    def simulate_delay(self, delay_ms: float, jitter_ms: float) -> None:
        """Benchmarks on kernels without netem: hold each frame back ``delay_ms``
        (± ``jitter_ms``), in order, as a slow link would."""
        self._delay = (delay_ms / 1000.0, jitter_ms / 1000.0)

    async def _delayed(self) -> None:
        delay, jitter = self._delay
        due = max(self._last_due, time.monotonic() + delay + random.uniform(-jitter, jitter))
        self._last_due = due
        await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def send(self, msg: Message) -> None:
        if not self.alive:
            raise PeerLost(f"link to {self.peer_id} is closed: {self.close_reason}")
        data = encode(msg)
        if self._delay[0] > 0:
            await self._delayed()
        # A frame of several pieces goes out whole even when its sender is cancelled between
        # two of them (a wave's group, when a sibling fails): the pieces' nonces are spent at
        # sealing, so half a frame would leave the peer dropping every later piece as forged.
        frame = asyncio.ensure_future(self._send_frame(data))
        frame.add_done_callback(_retrieve)
        await asyncio.shield(frame)

    async def _send_frame(self, data: bytes) -> None:
        try:
            async with self._send_lock:  # sealed in send order: the nonce counter is the order
                for piece in self.channel.seal(data):
                    await self.ws.send_bytes(piece)
                    self.bytes_sent += len(piece)
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            await self.close(f"send failed: {exc}", CLOSE_LOST)
            raise PeerLost(f"send to {self.peer_id} failed: {exc}") from None

    # -- outgoing calls ------------------------------------------------------

    async def forward_batch(self, term: int, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
        """Run a batch of sessions' rows through this peer's span."""
        req = next(self._req)
        future = asyncio.get_running_loop().create_future()
        self._pending[req] = future
        began = time.monotonic()
        try:
            await self.send(ForwardBatch(term, req, tuple(segments), to_wire(hidden), urgent=int(URGENT.get())))
            result: ResultBatch = await future
        finally:
            self._pending.pop(req, None)
        if (times := STEP_TIMES.get()) is not None:  # the stage's share, the rest is the hop
            times.forward(self.peer_id, time.monotonic() - began, result.seconds, result.queued)
        return from_wire(result.hidden)

    async def drop(self, term: int, session: str) -> None:
        await self.send(Drop(term, SessionId(session)))

    async def call_ping(self) -> None:
        await self.send(Ping(next(self._ping), time.monotonic()))

    def next_req(self) -> int:
        return next(self._req)

    # -- incoming ------------------------------------------------------------

    async def read_loop(self, handle: Callable[[Link, Message], Awaitable[None]]) -> None:
        """Decode frames until the socket closes; ResultBatch/Fail/Pong are settled here,
        everything else goes to ``handle`` (which must not block on torch)."""
        try:
            async for frame in self.ws:
                if frame.type != WSMsgType.BINARY:
                    if frame.type == WSMsgType.ERROR:
                        raise PeerLost(f"socket error: {self.ws.exception()}")
                    raise ProtocolError(f"unexpected {frame.type.name} frame")
                self.bytes_received += len(frame.data)
                try:
                    data = self.channel.open(frame.data)
                except Forged as exc:
                    log.warning("link_piece_dropped", peer=self.peer_id, reason=str(exc), dropped=self.channel.forged)
                    continue
                if data is None:
                    continue
                self.last_heard = time.monotonic()
                msg = decode(data, max_size=self.max_frame)
                match msg:
                    case Ping(seq=seq, sent=sent):
                        await self.send(Pong(seq, sent, process_rss()))
                    case Pong(sent=sent, ram_used=ram_used):
                        self.rtt_ms = (time.monotonic() - sent) * 1000.0
                        self._rtts.append(self.rtt_ms)
                        self.ram_used = ram_used or None
                    case ResultBatch(req=req):
                        self._settle(req, msg)
                    case Fail(req=req):
                        self._settle(req, step_error(self.peer_id, msg))
                    case ApiReply(req=req):
                        if (queue := self.api_replies.get(req)) is not None:
                            queue.put_nowait(msg)
                    case Bye(reason=reason):
                        await self.close(f"peer left: {reason}", CLOSE_BYE)
                    case Leaving():
                        self.leaving = True
                        await handle(self, msg)
                    case _:
                        await handle(self, msg)
            await self.close(f"socket closed ({self.ws.close_code})", CLOSE_LOST)
        except ProtocolError as exc:
            log.warning("link_protocol_error", peer=self.peer_id, reason=str(exc))
            await self.close(f"protocol error: {exc}", CLOSE_PROTOCOL)
        except PeerLost as exc:
            await self.close(str(exc), CLOSE_LOST)
        except (ConnectionError, aiohttp.ClientError) as exc:
            await self.close(f"connection error: {exc}", CLOSE_LOST)
        finally:
            if self.alive:
                await self.close("read loop ended", CLOSE_LOST)

    def _settle(self, req: int, value) -> None:
        future = self._pending.get(req)
        if future is None or future.done():
            log.debug("result_unmatched", peer=self.peer_id, req=req)
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    async def close(self, reason: str, code: int = CLOSE_LOST) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.close_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerLost(f"{self.peer_id}: {reason}"))
        self._pending.clear()
        for queue in self.api_replies.values():
            queue.put_nowait(PeerLost(f"{self.peer_id}: {reason}"))
        log.info("link_closed", peer=self.peer_id, reason=reason)
        try:
            await asyncio.wait_for(self.ws.close(code=code, message=reason[:120].encode()), 1.0)
        except (TimeoutError, ConnectionError, RuntimeError, aiohttp.ClientError):
            pass  # the other side is gone or hung; the socket is dropped either way


def _retrieve(frame: asyncio.Future) -> None:
    """Mark a shielded send's error seen: its sender may have been cancelled before it came
    (the link is closed by then, and the next send says so)."""
    if not frame.cancelled():
        frame.exception()
