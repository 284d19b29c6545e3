"""The entry peer's side of a completion: forward it to the supernode, stream
the answer back, and keep the token history, so that if the supernode is lost
mid-stream the request is resubmitted to the next one and the stream goes on
where it stopped (no duplicate, no missing token).

Upstream is always a stream (with usage), whatever the client asked; a client
that asked for one JSON body gets it assembled here.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import structlog
from aiohttp import web

from meshd.errors import NoCapacity
from meshd.serving.daemon import Upstream
from meshd.serving.guards import CLIENT_KEY
from meshd.serving.openai import (
    DONE,
    SSE_HEADERS,
    choice_json,
    completion_id,
    completion_json,
    error_json,
    sse,
    sse_events,
)

log = structlog.get_logger()

MAX_RESUBMITS = 3


class _Answer:
    """What the client has been sent so far, per choice."""

    def __init__(self, n: int):
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.text: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.usage: dict | None = None
        self.model: str | None = None

    def add(self, data: dict, chat: bool) -> None:
        self.model = data.get("model", self.model)
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices", []):
            i = choice.get("index", 0)
            if not 0 <= i < len(self.ids):
                continue
            self.ids[i].extend(choice.get("token_ids", []))
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                self.text[i].append(piece)
            if choice.get("finish_reason"):
                self.finish[i] = choice["finish_reason"]

    def whole(self, cid: str, chat: bool) -> dict:
        choices = [choice_json(chat, i, "".join(text), ids, finish)
                   for i, (ids, text, finish) in enumerate(zip(self.ids, self.text, self.finish))]
        return completion_json(chat, cid, self.model, choices, self.usage)


async def proxy_completion(node: Upstream, request: web.Request, body, chat: bool) -> web.StreamResponse:
    if not isinstance(body, dict):  # let the supernode word the error
        body = {"_invalid": body}
    wants_stream = body.get("stream") is True
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if wants_stream else True
    n = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
    cid = completion_id(chat)
    answer = _Answer(max(1, min(n, 8)))
    resp: web.StreamResponse | None = None
    resubmits = 0
    while True:
        upstream_body = dict(body, stream=True, stream_options={"include_usage": True})
        if resubmits:
            upstream_body["meshd_resume"] = answer.ids[0]
        term = node.current_term()
        # The supernode streams at least a keepalive each second; silence for
        # as long as the heartbeat allows means it is hung or cut off.
        silence = aiohttp.ClientTimeout(total=None, sock_read=node.config.heartbeat_s * node.config.missed_beats + 1)
        try:
            # Over the sealed link (the client's own key goes along: the supernode's keys apply).
            async with node.supernode_post(request.path, upstream_body, request.headers.get("Authorization", ""),
                                           silence, client=request.get(CLIENT_KEY, "")) as up:
                if up.status != 200:
                    # A refusal (4xx, 503): pass it through as it is, if nothing was sent yet.
                    payload = await up.read()
                    if resp is None:
                        return web.Response(body=payload, status=up.status, content_type="application/json")
                    await resp.write(sse(payload.decode("utf-8", "replace")))
                    break
                async for data in sse_events(up.content):
                    if data == DONE:
                        if wants_stream:
                            resp = await _prepared(resp, request)
                            await resp.write(sse(DONE))
                            await resp.write_eof()
                            return resp
                        return web.json_response(answer.whole(cid, chat))
                    event = json.loads(data)
                    if "error" in event and resp is None:
                        # Refused or failed after the supernode's 200 (it admits a stream's
                        # sessions once the stream is open: a full KV budget, a client over
                        # its share). Nothing has gone to the client: it gets the error with
                        # its status, never a 200 holding an empty or cut-short answer.
                        return web.json_response(event, status=_error_status(event))
                    if "choices" in event or "usage" in event:
                        event["id"] = cid
                        answer.add(event, chat)
                    if wants_stream and (event.get("choices") or wants_usage or "error" in event):
                        resp = await _prepared(resp, request)
                        await resp.write(sse(event))
            raise aiohttp.ClientPayloadError("the supernode ended the stream without [DONE]")
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
            # The supernode went away mid-answer. One choice can be resumed from
            # its token history; several only if nothing was generated yet.
            resubmits += 1
            started = any(answer.ids)
            if resubmits > MAX_RESUBMITS or (n > 1 and started):
                log.warning("proxy_gave_up", error=str(exc), resubmits=resubmits)
                if resp is None:
                    raise NoCapacity(f"lost the supernode mid-request: {exc}") from None
                await resp.write(sse(error_json(f"lost the supernode: {exc}", 503)))
                break
            log.warning("proxy_resubmit", error=str(exc), tokens_so_far=len(answer.ids[0]), attempt=resubmits)
            await node.wait_new_term(term)
    resp = await _prepared(resp, request)
    await resp.write(sse(DONE))
    await resp.write_eof()
    return resp


def _error_status(event: dict) -> int:
    """The HTTP status of an error event of the supernode's stream (``error_json``'s shape)."""
    error = event.get("error")
    if not isinstance(error, dict):
        return 500
    if error.get("code") == "mesh_unavailable":
        return 503
    return 400 if error.get("type") == "invalid_request_error" else 500


async def _prepared(resp: web.StreamResponse | None, request: web.Request) -> web.StreamResponse:
    if resp is None:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
    return resp

