"""The entry peer's side of a completion: forward it to the supernode, stream
the answer back, and keep the token history, so that if the supernode is lost
mid-stream, or yields, or stops, the request is resubmitted to the next one and
the stream goes on where it stopped (no duplicate, no missing token).

Upstream is always a stream (with usage), whatever the client asked; a client
that asked for one JSON body gets it assembled here. An upstream failure never
becomes a 200: an answer that did not finish (no [DONE], an error event, a
choice without a finish reason) is resubmitted or is an error with its reason.

The supernode hands its own requests on through here too when it yields
(``Handoff``): what it already sent is the history the next supernode resumes.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web

from meshd.errors import NoCapacity
from meshd.serving.daemon import REQUEST_ID, TRACE, Upstream
from meshd.serving.guards import CLIENT_KEY
from meshd.serving.openai import (
    DONE,
    SSE_HEADERS,
    Assembler,
    MeshCode,
    completion_id,
    error_json,
    sse,
    sse_events,
)

log = structlog.get_logger()

# Resubmissions in a row that add no token before the proxy gives up. An attempt that
# got tokens out starts the count again: a long answer may live through several faults
# (a soak saw one stream meet five in 30 s, each time going on), and each further
# attempt still needs a token to be worth another.
MAX_RESUBMITS = 4
FINISHED = ("stop", "length", "tool_calls")


class _Answer(Assembler):
    """What the client has been sent so far, per choice (with, per choice, the leading
    tokens the client itself sent as meshd_resume, which are not answered back)."""

    def __init__(self, chat: bool):
        super().__init__(chat)
        self.resumed: dict[int, int] = {}  # choice -> tokens the client sent as its own meshd_resume
        self.skipped_tokens = 0  # of the choices already whole when the last resubmission went out

    def seed(self, index: int, ids: list[int]) -> None:
        """Choice ``index`` begins with these tokens, the client's own (meshd_resume)."""
        self.add({"choices": [{"index": index, "token_ids": ids, "text": ""}]})
        self.resumed[index] = len(ids)

    def take(self, sent: Assembler) -> None:
        """What a yielding supernode already sent of each choice (a Handoff)."""
        for i, p in sent.parts.items():
            self.add({"choices": [{"index": i, "token_ids": p["ids"], "text": "".join(p["text"]),
                                   "delta": {"content": "".join(p["text"])}, "finish_reason": p["finish"]}]})
            self.parts[i]["calls"], self.parts[i]["lp"] = copy.deepcopy(p["calls"]), copy.deepcopy(p["lp"])

    def tokens(self) -> int:
        """Tokens the client has of every choice (its own meshd_resume included)."""
        return sum(len(p["ids"]) for p in self.parts.values())

    @property
    def generated(self) -> bool:
        return any(len(p["ids"]) > self.resumed.get(i, 0) for i, p in self.parts.items())

    def resubmission(self, body: dict, several: bool) -> dict:
        """The upstream body that goes on where this answer stopped: each choice's history
        (``meshd_resume``; one list per choice where the request has ``several``) and the
        choices already whole (``meshd_finished``), which the next supernode does not run."""
        out = dict(body, stream=True, stream_options={"include_usage": True})
        if not several:
            if self.first_ids:
                out["meshd_resume"] = list(self.first_ids)
            return out
        if self.parts:
            out["meshd_resume"] = [list(self.parts[i]["ids"]) if i in self.parts else [] for i in range(max(self.parts) + 1)]
        done = sorted(i for i, p in self.parts.items() if p["finish"] in FINISHED)
        if done:
            out["meshd_finished"] = done
        self.skipped_tokens = sum(len(self.parts[i]["ids"]) for i in done)
        return out

    def counted(self, usage: dict) -> dict:
        """The upstream's usage, with the tokens of the choices it did not run again."""
        if not self.skipped_tokens or not isinstance(usage.get("completion_tokens"), int):
            return usage
        return dict(usage, completion_tokens=usage["completion_tokens"] + self.skipped_tokens,
                    total_tokens=usage.get("prompt_tokens", 0) + usage["completion_tokens"] + self.skipped_tokens)

    @property
    def finished(self) -> bool:
        return bool(self.parts) and all(p["finish"] in FINISHED for p in self.parts.values())

    def whole(self, cid: str) -> dict:
        answer = super().whole(cid)
        for choice in answer["choices"]:
            if cut := self.resumed.get(choice.get("index", 0)):
                choice["token_ids"] = choice["token_ids"][cut:]
        return answer


@dataclass
class Handoff:
    """A request the supernode began itself and hands on when it yields: the id the
    client knows, its response if streaming began, and what each choice was sent."""

    cid: str
    resp: web.StreamResponse | None
    sent: Assembler


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

    def __init__(self, request: web.Request, body: dict, resp: web.StreamResponse | None):
        self.request = request
        self.stream = body.get("stream") is True
        self.usage = bool((body.get("stream_options") or {}).get("include_usage")) if self.stream else True
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


async def proxy_completion(node: Upstream, request: web.Request, body, chat: bool,
                           handoff: Handoff | None = None) -> web.StreamResponse:
    """Relay a completion to the supernode (resubmitting it where one is lost or yields),
    and its answer to the client. A peer that stops waits for the relays it runs, up to its
    drain deadline (``ending``): one still open then ends with an error event and [DONE]
    (a 503 before the answer began), never a stream cut off without either."""
    if not isinstance(body, dict):  # let the supernode word the error
        body = {"_invalid": body}
    client = _Client(request, body, handoff.resp if handoff else None)
    with node.relaying() as ending:
        work = asyncio.ensure_future(_proxy_completion(node, client, body, chat, handoff))
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


async def _proxy_completion(node: Upstream, client: _Client, body: dict, chat: bool,
                            handoff: Handoff | None) -> web.StreamResponse:
    several = _several_choices(body)
    cid = handoff.cid if handoff else completion_id(chat)
    answer = _Answer(chat)
    resume = body.get("meshd_resume")
    if isinstance(resume, list) and resume:  # the client's own: the supernode checks them
        for i, ids in enumerate(resume if several else [resume]):
            if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                answer.seed(i, ids)
    if handoff is not None:
        answer.take(handoff.sent)
    resubmits = attempts = 0
    had = answer.tokens()
    while True:
        upstream_body = answer.resubmission(body, several) if attempts or handoff else \
            dict(body, stream=True, stream_options={"include_usage": True})
        mark = node.upstream_mark()
        try:
            refused = await _relay(node, upstream_body, answer, chat, cid, client)
            if refused is not None:
                if client.resp is None:
                    return web.Response(body=refused.payload, status=refused.status, content_type="application/json")
                return await client.end(refused.payload)
            if not answer.finished:
                raise _Retry("the supernode ended the answer without a finish reason", moved=False)
            if not client.stream:
                return web.json_response(answer.whole(cid))
            return await client.end()
        except (_Retry, aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
            # The supernode went away, yielded or stops mid-answer. Each choice goes on
            # from its token history; those already whole are not run again.
            attempts += 1
            resubmits = 1 if answer.tokens() > had else resubmits + 1
            had = answer.tokens()
            why = f"the supernode could not finish the request: {exc or type(exc).__name__}"
            if resubmits > MAX_RESUBMITS:
                log.warning("proxy_gave_up", error=str(exc), resubmits=resubmits, tokens_so_far=len(answer.first_ids))
                if client.resp is None:
                    raise NoCapacity(why) from None
                return await client.end(error_json(why, 503))
            log.warning("proxy_resubmit", error=str(exc), tokens_so_far=len(answer.first_ids), attempt=attempts,
                        without_progress=resubmits)
            try:
                if not isinstance(exc, _Retry) or exc.moved:
                    await node.wait_upstream_change(mark, same_again=not (isinstance(exc, _Retry) and exc.told))
                else:  # the same supernode, once it had a moment (a re-plan under way)
                    await asyncio.sleep(node.config.heartbeat_s)
            except NoCapacity as gone:
                log.warning("proxy_gave_up", error=str(gone), resubmits=resubmits, tokens_so_far=len(answer.first_ids))
                if client.resp is None:
                    raise
                return await client.end(error_json(f"{why}; {gone}", 503))
        except NoCapacity as exc:  # no supernode serves: the request cannot go on
            if client.resp is None:
                raise
            return await client.end(error_json(f"the mesh cannot serve now: {exc}", 503))


def _several_choices(body: dict) -> bool:
    """Whether the request asks for more than one choice (n > 1, or several prompts): its
    resubmission then names each choice's history."""
    n, prompt = body.get("n", 1), body.get("prompt")
    return (isinstance(n, int) and n > 1) or (isinstance(prompt, list) and len(prompt) > 1
                                               and all(isinstance(p, (str, list)) for p in prompt))


async def _relay(node: Upstream, upstream_body: dict, answer: _Answer, chat: bool, cid: str,
                 client: _Client) -> _Refused | None:
    """One upstream attempt: events go on to the client as they come (streaming) or into
    ``answer``. None once [DONE] came; the refusal; or _Retry (or a connection error)
    when this supernode cannot finish."""
    # The supernode streams at least a keepalive each second; silence for
    # as long as the heartbeat allows means it is hung or cut off.
    silence = aiohttp.ClientTimeout(total=None, sock_read=node.config.heartbeat_s * node.config.missed_beats + 1)
    # Over the sealed link (the client's own key goes along: the supernode's keys apply).
    request = client.request
    ctx = request.get(TRACE)
    async with node.supernode_post(request.path, upstream_body, request.headers.get("Authorization", ""), silence,
                                   client=request.get(CLIENT_KEY, ""), request_id=request.get(REQUEST_ID, ""),
                                   traceparent=ctx.header() if ctx is not None else "") as up:
        if up.status != 200:
            payload = await up.read()
            try:
                message, code = _error_of(json.loads(payload))
            except ValueError:
                message, code = payload[:200].decode("utf-8", "replace"), None
            if code is MeshCode.SUPERNODE_CHANGED:
                raise _Retry(message, told=True)
            return _Refused(up.status, payload)
        async for data in sse_events(up.content):
            if data == DONE:
                return None
            event = json.loads(data)
            if "error" in event:
                message, code = _error_of(event)
                if code is MeshCode.SUPERNODE_CHANGED:
                    raise _Retry(message, told=True)
                if answer.generated:  # mid-answer: the next attempt resumes from the history
                    raise _Retry(message, moved=False)
                # Refused before a token (a full KV budget): the client gets that, not a 200.
                return _Refused(503 if code is MeshCode.MESH_UNAVAILABLE else 500, json.dumps(event).encode())
            if "choices" in event or "usage" in event:
                event["id"] = cid
                if event.get("usage"):
                    event["usage"] = answer.counted(event["usage"])
                answer.add(event)
            if client.stream and (event.get("choices") or client.usage):
                resp = await client.prepared()
                await resp.write(sse(event))
    raise _Retry("the supernode ended the stream without [DONE]")
