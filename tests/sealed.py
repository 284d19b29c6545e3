"""pytest as a mesh peer on a real ``/mesh/ws``: the real Noise handshake
(``meshd.control.secure``), then frames sealed by hand, so a test can send what a
peer never would (malformed frames, forged or replayed pieces) and read what it gets."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import aiohttp

from meshd.control.secure import WIRE_MAX, Channel, LocalIdentity, handshake
from protocol.codec import decode, encode
from protocol.messages import Capabilities, Message, NodeId, Ping, Plan, Pong

CLOSED = object()  # put in a SealedPeer's inbox once its link is closed


def caps(vram: int = 0, api_port: int = 1) -> Capabilities:
    return Capabilities(vram=vram, ram=0, device="cpu", api_port=api_port, mem_budget=0, layer_ms=0.0)


def identity(secret: bytes, mesh: str = "home", node_id: str | None = None) -> LocalIdentity:
    return LocalIdentity(NodeId(node_id or "f" + secrets.token_hex(5)), "pytest-peer", mesh, secret)


class SealedPeer:
    """An authenticated link from pytest's side: answers pings, queues everything else."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, me: LocalIdentity, channel: Channel):
        self.ws, self.me, self.channel = ws, me, channel
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.sent: list[bytes] = []  # every sealed piece, as it went on the wire
        self.task = asyncio.create_task(self._read())

    async def send_raw(self, frame: bytes) -> None:
        """Any bytes as one sealed frame (they open fine; what they say is the test's)."""
        for piece in self.channel.seal(frame):
            self.sent.append(piece)
            await self.ws.send_bytes(piece)

    async def send(self, msg: Message) -> None:
        await self.send_raw(encode(msg))

    async def _read(self) -> None:
        try:
            async for piece in self.ws:
                if piece.type != aiohttp.WSMsgType.BINARY:
                    break
                frame = self.channel.open(piece.data)
                if frame is None:
                    continue
                msg = decode(frame)
                if isinstance(msg, Ping):
                    await self.send(Pong(msg.seq, msg.sent))
                else:
                    await self.inbox.put(msg)
        finally:
            self.inbox.put_nowait(CLOSED)

    async def next(self, kind, timeout: float = 15.0, where=lambda m: True):
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.inbox.get()
                if isinstance(msg, kind) and where(msg):
                    return msg

    async def reply(self, timeout: float = 10.0) -> Message | None:
        """The next message that is not one of the node's own Plans (a node that leads
        sends them unasked), or None once the link is closed."""
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.inbox.get()
                if msg is CLOSED:
                    self.inbox.put_nowait(CLOSED)  # closed stays closed
                    return None
                if not isinstance(msg, Plan):
                    return msg

    async def closed(self, timeout: float = 10.0) -> int | None:
        await asyncio.wait_for(asyncio.shield(self.task), timeout)
        return self.ws.close_code


@contextlib.asynccontextmanager
async def sealed_peer(http: aiohttp.ClientSession, url: str, secret: bytes, vram: int = 0, mesh: str = "home",
                      max_frame: int = 64 << 20, node_id: str | None = None, api_port: int = 1):
    """Dial ``url``'s /mesh/ws as ``node_id`` (a fresh one by default) holding ``secret``,
    announcing ``api_port`` as where its API and shard files are."""
    me = identity(secret, mesh, node_id)
    async with http.ws_connect(url + "/mesh/ws", max_msg_size=WIRE_MAX, compress=0) as ws:
        _, channel = await handshake(ws, me, caps(vram, api_port), initiator=True, max_frame=max_frame)
        p = SealedPeer(ws, me, channel)
        try:
            yield p
        finally:
            p.task.cancel()
            with contextlib.suppress(BaseException):
                await p.task
