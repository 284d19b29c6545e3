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
from meshd.serving.daemon import REQUEST_ID, Upstream
from meshd.serving.openai import DONE, SSE_HEADERS, Assembler, completion_id, error_json, sse, sse_events

log = structlog.get_logger()

MAX_RESUBMITS = 3


async def proxy_completion(node: Upstream, request: web.Request, body, chat: bool) -> web.StreamResponse:
    if not isinstance(body, dict):  # let the supernode word the error
        body = {"_invalid": body}
    wants_stream = body.get("stream") is True
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) if wants_stream else True
    n = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
    cid = completion_id(chat)
    answer = Assembler(chat)  # what the client has been sent so far, per choice
    resp: web.StreamResponse | None = None
    resubmits = 0
    while True:
        upstream_body = dict(body, stream=True, stream_options={"include_usage": True})
        if resubmits:
            upstream_body["meshd_resume"] = answer.first_ids
        term = node.current_term()
        url = await node.supernode_base_url() + request.path
        # The supernode streams at least a keepalive each second; silence for
        # as long as the heartbeat allows means it is hung or cut off.
        silence = aiohttp.ClientTimeout(total=None, sock_read=node.config.heartbeat_s * node.config.missed_beats + 1)
        try:
            headers = node.mesh_auth(request.path) | {"X-Request-Id": request.get(REQUEST_ID, "")}
            async with node.http.post(url, json=upstream_body, timeout=silence, headers=headers) as up:
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
                        return web.json_response(answer.whole(cid))
                    event = json.loads(data)
                    if "choices" in event or "usage" in event:
                        event["id"] = cid
                        answer.add(event)
                    if wants_stream and (event.get("choices") or wants_usage or "error" in event):
                        resp = await _prepared(resp, request)
                        await resp.write(sse(event))
            raise aiohttp.ClientPayloadError("the supernode ended the stream without [DONE]")
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
            # The supernode went away mid-answer. One choice can be resumed from
            # its token history; several only if nothing was generated yet.
            resubmits += 1
            started = answer.started
            if resubmits > MAX_RESUBMITS or ((n > 1 or len(answer.parts) > 1) and started):
                log.warning("proxy_gave_up", error=str(exc), resubmits=resubmits)
                if resp is None:
                    raise NoCapacity(f"lost the supernode mid-request: {exc}") from None
                await resp.write(sse(error_json(f"lost the supernode: {exc}", 503)))
                break
            log.warning("proxy_resubmit", error=str(exc), tokens_so_far=len(answer.first_ids), attempt=resubmits)
            await node.wait_new_term(term)
    resp = await _prepared(resp, request)
    await resp.write(sse(DONE))
    await resp.write_eof()
    return resp


async def _prepared(resp: web.StreamResponse | None, request: web.Request) -> web.StreamResponse:
    if resp is None:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
    return resp

