"""Member-to-member API calls over the sealed link instead of plain HTTP.

An entry peer that is not the supernode hands a client's request to it as an
``ApiRequest`` on their link; the supernode runs it against its own API on
loopback (with the client's own ``Authorization``, so its API keys apply as if
the client had come straight to it) and streams the answer back as ``ApiReply``
pieces. Prompts, answers and token ids thus cross the LAN only sealed; a peer
without API keys cannot let a client past the supernode's. ``ApiCancel`` stops a
request whose client went away (the supernode's handler is cancelled and its
sessions freed).

On the calling side ``call`` gives an object that reads like aiohttp's response
(``status``, ``read()``, ``content`` line by line), and its failures are the
ones aiohttp raises, so the proxy's retry logic does not care which way it went.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import structlog

from meshd.control.peers import Link
from meshd.errors import PeerLost
from protocol.messages import ApiCancel, ApiReply, ApiRequest

log = structlog.get_logger()

TUNNEL_HEADER = "X-Meshd-Tunnel"  # this process's local token: the request came over a sealed link
CLIENT_HEADER = "X-Meshd-Client"  # the client a member forwards for (trusted only with TUNNEL_HEADER)
ENTRY_HEADER = "X-Meshd-Entry"  # the member that handed it over (set here, trusted only with TUNNEL_HEADER)
MAX_CLIENT = 128
# A completion a member hands over: a ``protocol.generate.Generate`` in, its frames back.
# No client reaches it: the supernode's API answers it only for the tunnel (or itself).
GENERATE = "/mesh/generate"
# What a member may ask of the supernode's API through the tunnel.
TUNNELED = frozenset({GENERATE, "/tokenize", "/detokenize", "/v1/mesh/drain"})
# A member leaving (at its own shutdown) asks the supernode to move its span away: the
# only control act a member may ask without a control key, and only for itself. No HTTP
# route leads here: a member's client can reach only /v1/mesh/drain, which the supernode
# runs through its own API (its Host, key and caller checks) like any other call.
LEAVE = "/mesh/leave"
# A peer's batch jobs, replicated to the peer that would lead without it (the supernode,
# or the next one when it is the supernode): no HTTP route leads here either, and a peer
# may only write replicas of its own batches (``BatchRunner.on_replica`` keys them by it).
REPLICA = "/mesh/batch-replica"
# ...and what it may read (GET): the live figures and request timelines it shows for the mesh.
READABLE = re.compile(r"/live(\?since=[0-9]{1,15})?|/traces(\?limit=[0-9]{1,4})?|/traces/[A-Za-z0-9._:-]{1,128}")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{0,4096}")
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def plain_header(value: str) -> bool:
    """Printable ASCII of a sane length: what an Authorization header may be, to travel on."""
    return _HEADER_VALUE.fullmatch(value) is not None


FRAMES_TYPE = "application/vnd.meshd.frames"  # a body of length-prefixed protocol.generate frames


def content_type(path: str) -> str:
    """What a tunneled POST's body is: a ``Generate`` frame, or JSON."""
    return FRAMES_TYPE if path == GENERATE else "application/json"


def loopback_headers(local_token: str, authorization: str = "", client: str = "",
                     request_id: str = "", traceparent: str = "", entry: str = "",
                     content_type: str = "application/json") -> dict[str, str]:
    """The headers of a call to this process's own API on behalf of an entry peer's client
    (one that came over a link, or the proxy's own when this peer is the supernode): the
    client's key as given, so the API keys apply, and the tunnel's mark (this process's
    own token), with which the API believes the client named (KV fairness), and the
    request's trace context and entry peer (its timeline)."""
    headers = {"Content-Type": content_type, TUNNEL_HEADER: local_token}
    if authorization:
        headers["Authorization"] = authorization
    if client and len(client) <= MAX_CLIENT and plain_header(client):
        headers[CLIENT_HEADER] = client
    if request_id and len(request_id) <= MAX_CLIENT and plain_header(request_id):
        headers["X-Request-Id"] = request_id
    if traceparent and _TRACEPARENT.fullmatch(traceparent):
        headers["traceparent"] = traceparent
    if entry and len(entry) <= MAX_CLIENT and plain_header(entry):
        headers[ENTRY_HEADER] = entry
    return headers


class TunnelResponse:
    """The calling side's view of one tunneled answer."""

    def __init__(self, link: Link, req: int, queue: asyncio.Queue, sock_read: float | None):
        self._link, self._req, self._queue, self._sock_read = link, req, queue, sock_read
        self.status = 0
        self.ended = False
        self._first: bytes = b""
        self.content = self.lines()  # as aiohttp's response offers it: the body, line by line

    async def _piece(self) -> bytes:
        try:
            async with asyncio.timeout(self._sock_read):  # no task per piece, as wait_for makes
                reply = await self._queue.get()
        except TimeoutError:
            raise asyncio.TimeoutError(f"no word from {self._link.peer_id} for {self._sock_read} s") from None
        if isinstance(reply, PeerLost):
            raise aiohttp.ClientConnectionError(str(reply))
        self.status = reply.status
        self.ended = bool(reply.end)
        return reply.data

    async def start(self) -> None:
        self._first = await self._piece()

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
            self._first = b""
        while not self.ended:
            data = await self._piece()
            if data:
                yield data

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        buf = b""
        async for data in self.chunks():
            buf += data
            *whole, buf = buf.split(b"\n")
            for line in whole:
                yield line + b"\n"
        if buf:
            yield buf


@contextlib.asynccontextmanager
async def call(link: Link, method: str, path: str, body: bytes, authorization: str = "",
               sock_read: float | None = None, client: str = "", request_id: str = "",
               traceparent: str = "") -> AsyncIterator[TunnelResponse]:
    req = link.next_req()
    queue: asyncio.Queue = asyncio.Queue()
    link.api_replies[req] = queue
    resp = TunnelResponse(link, req, queue, sock_read)
    try:
        try:
            await link.send(ApiRequest(req, method, path, body, authorization, client, request_id, traceparent))
        except PeerLost as exc:
            raise aiohttp.ClientConnectionError(str(exc)) from None
        await resp.start()
        yield resp
    finally:
        link.api_replies.pop(req, None)
        if not resp.ended and link.alive:
            with contextlib.suppress(PeerLost):
                await link.send(ApiCancel(req))


class TunnelServer:
    """The supernode's side: runs tunneled requests against its own API on loopback."""

    def __init__(self, http: Callable[[], aiohttp.ClientSession], own_url: Callable[[], str],
                 leave: Callable[[str], Awaitable[tuple[int, bytes]]], spawn: Callable, local_token: str,
                 replica: Callable[[str, bytes], Awaitable[tuple[int, bytes]]]):
        self._http, self._own_url, self._leave, self._spawn = http, own_url, leave, spawn
        self._replica = replica
        self._local_token = local_token
        self._running: dict[tuple[str, int], asyncio.Task] = {}

    def on_request(self, link: Link, msg: ApiRequest) -> None:
        key = (link.peer_id, msg.req)
        if key in self._running:
            return  # a repeated req number from a member: the first one stands
        task = self._spawn(self._serve(link, msg))
        self._running[key] = task
        task.add_done_callback(lambda _t: self._running.pop(key, None))

    def on_cancel(self, link: Link, msg: ApiCancel) -> None:
        task = self._running.get((link.peer_id, msg.req))
        if task is not None:
            task.cancel()

    async def _serve(self, link: Link, msg: ApiRequest) -> None:
        try:
            if msg.method == "GET" and READABLE.fullmatch(msg.path):
                await self._loopback(link, msg)
            elif msg.method == "POST" and msg.path == LEAVE:  # the member itself, never another peer
                status, body = await self._leave(link.peer_id)
                await link.send(ApiReply(msg.req, status, body, 1))
            elif msg.method == "POST" and msg.path == REPLICA:  # that peer's own batches only
                status, body = await self._replica(link.peer_id, msg.body)
                await link.send(ApiReply(msg.req, status, body, 1))
            elif msg.method != "POST" or msg.path not in TUNNELED:
                await link.send(ApiReply(msg.req, 404, b'{"error": {"message": "not through the tunnel"}}', 1))
            elif not plain_header(msg.authorization):
                await link.send(ApiReply(msg.req, 400, b'{"error": {"message": "malformed Authorization"}}', 1))
            else:  # drain too: the supernode's own API checks the caller's control key
                await self._loopback(link, msg)
        except PeerLost:
            pass  # the caller is gone; nobody to answer
        except asyncio.CancelledError:
            log.info("tunnel_cancelled", peer=link.peer_id, req=msg.req)
            raise

    async def _loopback(self, link: Link, msg: ApiRequest) -> None:
        headers = loopback_headers(self._local_token, msg.authorization, msg.client, msg.request_id,
                                   msg.traceparent, link.peer_id, content_type(msg.path))
        status = 502
        try:
            async with self._http().request(msg.method, self._own_url() + msg.path,
                                            data=msg.body if msg.method == "POST" else None, headers=headers,
                                            ssl=False, timeout=aiohttp.ClientTimeout(total=None, connect=5)) as up:
                status = up.status
                await link.send(ApiReply(msg.req, status, b""))
                async for data in up.content.iter_any():
                    await link.send(ApiReply(msg.req, status, data))
        except (aiohttp.ClientError, ConnectionError, TimeoutError, RuntimeError) as exc:
            # RuntimeError: the session closed under us at shutdown. Only this request fails.
            log.warning("tunnel_loopback_failed", error=str(exc))
            if status == 502:
                await link.send(ApiReply(msg.req, 502, b'{"error": {"message": "the supernode failed"}}', 1))
                return
        await link.send(ApiReply(msg.req, status, b"", 1))
