"""The entry peer's side of a completion: hand it to the supernode as a ``Generate``,
turn the frames that come back into the client's answer (``Edge``), and keep each
choice's history, so that if the supernode is lost mid-answer, or yields, or stops, the
request is resubmitted to the next one and the answer goes on where it stopped (no
duplicate, no missing token).

What to do about an upstream failure is read from typed frames: a ``Failure``'s ``act``
(the supernode changed: ask the next; nothing serves: a 503; or the client's error), an
``End`` (the answer is whole), or neither (cut off: resubmitted). An upstream failure
never becomes a 200: an answer that did not finish (no ``End``, a ``Failure``, a choice
without a finish) is resubmitted or is an error with its reason.

The supernode hands its own requests on through here too when it yields
(``Handoff``): what it already sent is the history the next supernode resumes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from meshd.control.tunnel import GENERATE, TunnelResponse
from meshd.errors import NoCapacity, ProtocolError
from meshd.serving.daemon import REQUEST_ID, TRACE, Upstream
from meshd.serving.edge import Edge
from meshd.serving.guards import CLIENT_KEY
from meshd.serving.openai import DONE, SSE_HEADERS, MeshCode, completion_id, error_json, sse
from protocol import generate as gen
from protocol.codec import decode_of, encode

log = structlog.get_logger()

# Resubmissions in a row that add no token before the proxy gives up. An attempt that
# got tokens out starts the count again: a long answer may live through several faults
# (a soak saw one stream meet five in 30 s, each time going on), and each further
# attempt still needs a token to be worth another.
MAX_RESUBMITS = 4


@dataclass
class Handoff:
    """A request the supernode began itself and hands on when it yields: its edge (the id
    the client knows, what each choice was sent) and its response if streaming began."""

    edge: Edge
    resp: web.StreamResponse | None


class _Retry(Exception):
    """This upstream cannot finish the answer; the next supernode may (``moved``:
    wait for the mesh to name it first; ``told``: the supernode said it is not one now,
    so it is no use again however long the mesh takes to name the next)."""

    def __init__(self, message: str, moved: bool = True, told: bool = False):
        super().__init__(message)
        self.moved, self.told = moved, told


@dataclass
class _Refused:
    """The supernode refused the request (4xx, or a 503 such as a full KV budget)."""

    status: int
    payload: bytes


def _error_of(data: object) -> tuple[str, MeshCode | None]:
    """An OpenAI error body's message, and its code where it is one the proxy acts on."""
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return "", None
    return str(err.get("message", "")), MeshCode.of(err.get("code"))


class _Client:
    """The client's side: its response once streaming began, and what it asked for."""

    def __init__(self, request: web.Request, asked: gen.Request, resp: web.StreamResponse | None):
        self.request = request
        self.stream = bool(asked.stream)
        self.usage = bool(asked.include_usage) if self.stream else True
        self.resp = resp

    async def prepared(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = web.StreamResponse(headers=SSE_HEADERS)
            await self.resp.prepare(self.request)
        return self.resp

    async def end(self, error: dict | bytes | None = None) -> web.StreamResponse:
        """The stream's last events: the error (if any), then [DONE]."""
        resp = await self.prepared()
        if error is not None:
            await resp.write(sse(error.decode("utf-8", "replace") if isinstance(error, bytes) else error))
        await resp.write(sse(DONE))
        await resp.write_eof()
        return resp


async def proxy_completion(node: Upstream, request: web.Request, msg: gen.Generate,
                           handoff: Handoff | None = None) -> web.StreamResponse:
    """Relay a completion to the supernode (resubmitting it where one is lost or yields),
    and its answer to the client. A peer that stops waits for the relays it runs, up to its
    drain deadline (``ending``): one still open then ends with an error event and [DONE]
    (a 503 before the answer began), never a stream cut off without either."""
    client = _Client(request, msg.request, handoff.resp if handoff else None)
    with node.relaying() as ending:
        work = asyncio.ensure_future(_proxy_completion(node, client, msg, handoff))
        stop = asyncio.ensure_future(ending.wait())
        try:
            await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the client went away (this handler cancelled)
            stop.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait((work,))
        if not work.cancelled():
            return work.result()
        # Still counted as a relay while its end is written: the stop waits for it (up to its
        # abort grace), and only then closes the server's connections.
        why = "the supernode could not finish the request: this peer is shutting down"
        log.warning("relay_cut", reason="this peer's drain deadline", path=request.path)
        if client.resp is None:
            raise NoCapacity(why)
        return await client.end(error_json(why, 503))


async def _proxy_completion(node: Upstream, client: _Client, first: gen.Generate,
                            handoff: Handoff | None) -> web.StreamResponse:
    chat = bool(first.request.chat)
    edge = handoff.edge if handoff else Edge(chat, completion_id(chat))
    if handoff is None:
        edge.seed_from(first)  # the client's own meshd_resume / meshd_finished
    resubmits = attempts = 0
    had = edge.tokens()
    while True:
        # The first attempt as the client sent it; each later one with every choice's history.
        msg = edge.request(first) if attempts or handoff else first
        mark = node.uplink.mark()
        try:
            refused = await _relay(node, msg, edge, client)
            if refused is not None:
                if client.resp is None:
                    return web.Response(body=refused.payload, status=refused.status, content_type="application/json")
                return await client.end(refused.payload)
            if not edge.finished:
                raise _Retry("the supernode ended the answer without a finish reason", moved=False)
            if not client.stream:
                return web.json_response(edge.whole())
            return await client.end()
        except (_Retry, aiohttp.ClientError, ConnectionError, asyncio.TimeoutError, ProtocolError) as exc:
            # The supernode went away, yielded or stops mid-answer. Each choice goes on
            # from its token history; those already whole are not run again.
            attempts += 1
            resubmits = 1 if edge.tokens() > had else resubmits + 1
            had = edge.tokens()
            why = f"the supernode could not finish the request: {exc or type(exc).__name__}"
            if resubmits > MAX_RESUBMITS:
                log.warning("proxy_gave_up", error=str(exc), resubmits=resubmits, tokens_so_far=len(edge.first_ids))
                if client.resp is None:
                    raise NoCapacity(why) from None
                return await client.end(error_json(why, 503))
            log.warning("proxy_resubmit", error=str(exc), tokens_so_far=len(edge.first_ids), attempt=attempts,
                        without_progress=resubmits)
            try:
                if not isinstance(exc, _Retry) or exc.moved:
                    await node.uplink.wait_change(mark, same_again=not (isinstance(exc, _Retry) and exc.told))
                else:  # the same supernode, once it had a moment (a re-plan under way)
                    await asyncio.sleep(node.config.heartbeat_s)
            except NoCapacity as gone:
                log.warning("proxy_gave_up", error=str(gone), resubmits=resubmits, tokens_so_far=len(edge.first_ids))
                if client.resp is None:
                    raise
                return await client.end(error_json(f"{why}; {gone}", 503))
        except NoCapacity as exc:  # no supernode serves: the request cannot go on
            if client.resp is None:
                raise
            return await client.end(error_json(f"the mesh cannot serve now: {exc}", 503))


def _pieces(up: object) -> AsyncIterator[bytes]:
    """The body of an upstream answer as it arrives (over the tunnel, or aiohttp's on loopback)."""
    return up.chunks() if isinstance(up, TunnelResponse) else up.content.iter_any()  # type: ignore[attr-defined]


async def _relay(node: Upstream, msg: gen.Generate, edge: Edge, client: _Client) -> _Refused | None:
    """One upstream attempt: frames go on to the client as they come (streaming) or into
    ``edge``. None once the answer's ``End`` came; the refusal; or _Retry (or a connection
    error) when this supernode cannot finish."""
    # The supernode sends at least a keepalive each second; silence for
    # as long as the heartbeat allows means it is hung or cut off.
    silence = aiohttp.ClientTimeout(total=None, sock_read=node.config.heartbeat_s * node.config.missed_beats + 1)
    # Over the sealed link (the client's own key goes along: the supernode's keys apply).
    request = client.request
    ctx = request.get(TRACE)
    async with node.uplink.post(GENERATE, encode(msg, gen.REQUEST_TYPES), request.headers.get("Authorization", ""),
                                   silence, client=request.get(CLIENT_KEY, ""), request_id=request.get(REQUEST_ID, ""),
                                   traceparent=ctx.header() if ctx is not None else "") as up:
        if up.status != 200:  # the supernode's keys, or the tunnel's own refusal
            payload = await up.read()
            try:
                message, code = _error_of(json.loads(payload))
            except ValueError:
                message, code = payload[:200].decode("utf-8", "replace"), None
            if code is MeshCode.SUPERNODE_CHANGED:
                raise _Retry(message, told=True)
            return _Refused(up.status, payload)
        begun = False  # this attempt's answer began (before it, a Failure is a refusal of the request)
        async for data in gen.read_frames(_pieces(up)):
            frame = decode_of(data, gen.OUTPUT_TYPES, gen.MAX_OUTPUT_FRAME)
            match frame:
                case gen.Begin():
                    begun = True
                    edge.begin(frame)
                case gen.Delta():
                    chunk = edge.delta(frame)
                    if client.stream and chunk is not None:
                        await (await client.prepared()).write(sse(chunk))
                case gen.Usage():
                    final = edge.usage_chunk(frame)
                    if client.stream and client.usage:
                        await (await client.prepared()).write(sse(final))
                case gen.End():
                    return None
                case gen.Failure():
                    if frame.act is gen.Act.MOVED:
                        raise _Retry(frame.message, told=True)
                    if begun and edge.generated:  # mid-answer: the next attempt resumes from the history
                        raise _Retry(frame.message, moved=False)
                    # Refused (a bad request, a full KV budget), or failed before a token: the
                    # client gets that (an error event where its stream began), not a 200.
                    error = error_json(frame.message, frame.status, frame.param or None, frame.code or None)
                    return _Refused(frame.status, json.dumps(error).encode())
    raise _Retry("the supernode ended the answer without its end")
