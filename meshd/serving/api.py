"""HTTP API on every peer: the OpenAI-compatible endpoints, /status, /healthz, /metrics, the dashboard.

The handler is one of the three places errors are caught: a MeshError (or the model
side's ShardsError) becomes a 4xx/5xx JSON body, and the daemon goes on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac

import structlog
from aiohttp import web

from meshd.errors import KNOWN_ERRORS, BadRequest, InvalidParams, NoCapacity, StorageFull, SupernodeChanged
from meshd.serving import dashboard
from meshd.control.tunnel import TUNNEL_HEADER
from meshd.serving.daemon import NODE, Daemon
from meshd.serving.guards import CLIENT_KEY, check_prompt_size, client_id, control_guard, parse_json
from meshd.serving.openai import (
    DONE,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    SUPERNODE_CHANGED,
    CompletionRequest,
    choice_json,
    chunk_json,
    completion_id,
    error_json,
    parse_request,
    response_json,
    sse,
)
from meshd.serving.proxy import Handoff, proxy_completion
from meshd.serving.scheduler import Usage

log = structlog.get_logger()

LOCAL_HEADER = "X-Meshd-Local"  # Daemon.local_auth: this process calling its own API

KEEPALIVE_S = 1.0


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_json(message, status, param, code), status=status)


def _code(exc: BaseException) -> str | None:
    """SUPERNODE_CHANGED for a request the next supernode can take (an entry peer resubmits it)."""
    return SUPERNODE_CHANGED if isinstance(exc, SupernodeChanged) else None


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(str(exc), exc.status, exc.param)
    except InvalidParams as exc:  # the model side's own check of sampling parameters
        return error_response(str(exc), 400, exc.param)
    except NoCapacity as exc:
        return error_response(f"the mesh cannot serve now: {exc}", 503, code=_code(exc))
    except StorageFull as exc:
        return error_response(str(exc), 507)
    except web.HTTPRequestEntityTooLarge:
        # aiohttp's exception keeps no size attribute; the limit is ours.
        limit = request.app[NODE].config.max_body_bytes
        return error_response(f"request body too large (limit {limit} bytes)", 413)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            return error_response(exc.reason, exc.status)
        raise
    except KNOWN_ERRORS as exc:
        log.warning("request_failed", path=request.path, error=str(exc))
        return error_response(str(exc), 500)


def _bearer(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def _same(given: str, want: str) -> bool:
    # as bytes: compare_digest refuses str with non-ASCII (a 500 for a stray header)
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want.encode())


def _own_call(request: web.Request) -> bool:
    """A call this very process made to its own API (``Daemon.local_auth``)."""
    given = request.headers.get(LOCAL_HEADER)
    return given is not None and _same(given, request.app[NODE].local_token)


def _mesh_peer(request: web.Request) -> bool:
    """A request a member handed over the sealed link (the tunnel marks it with this
    process's own token), for a client that member authenticated itself."""
    given = request.headers.get(TUNNEL_HEADER)
    return given is not None and _same(given, request.app[NODE].local_token)


def _control_keys(request: web.Request):
    node = request.app[NODE]
    return node.control_keys or node.api_keys


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """Bearer keys for /v1 (control keys for /v1/mesh) when configured;
    /healthz, /status, /metrics and the dashboard stay open and read-only."""
    node = request.app[NODE]
    if request.path.startswith("/v1/"):
        keys = node.api_keys
        if request.path.startswith("/v1/mesh/"):
            keys = node.control_keys or node.api_keys
        if keys and not _own_call(request):
            given = _bearer(request)
            if given is None:
                return error_response("this endpoint needs an API key: Authorization: Bearer KEY", 401)
            if not any(_same(given, k) for k in keys):
                return error_response("invalid API key", 403 if request.path.startswith("/v1/mesh/") else 401)
    return await handler(request)


async def read_json(request: web.Request):
    try:  # a body that trickles in holds its connection busy: it gets as long as an idle one
        async with asyncio.timeout(request.app[NODE].config.http_idle_s):
            raw = await request.read()
    except TimeoutError:
        raise BadRequest("request body not received in time", 408) from None
    return parse_json(raw)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    node = request.app[NODE]
    if node.stopping:
        raise SupernodeChanged("this peer is shutting down; send the request to another peer")
    body = await read_json(request)
    client = request[CLIENT_KEY] = client_id(request, _mesh_peer(request), _bearer(request))
    if not node.view.is_supernode:
        if _mesh_peer(request):  # a peer took this one for the supernode: not a chain of proxies
            raise SupernodeChanged(f"this peer is not the supernode (it follows {node.view.supernode})")
        return await proxy_completion(node, request, body, chat)
    engine_ready = await node.serving_parts_soon()
    if engine_ready is None:
        raise NoCapacity(node.unavailable_reason())
    tokenizer, context = engine_ready
    check_prompt_size(body, context, tokenizer.max_token_chars)
    # Tokenizing (and rendering a chat template) takes a while on a long prompt: on a
    # thread of its own, so heartbeats and other requests go on meanwhile.
    req = await asyncio.get_running_loop().run_in_executor(_tokenize_pool(), functools.partial(
        parse_request, body, chat=chat, model=node.model_name, tokenizer=tokenizer, context=context,
        max_tokens_limit=node.config.max_tokens_limit,
    ))
    if req.stream:
        return await _stream(request, node, req, body, client)
    return await _whole(request, node, req, body, client)


@functools.cache
def _tokenize_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One thread: prompts are tokenized one at a time, off the event loop."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshd-tokenize")


def _choice_params(req: CompletionRequest, index: int):
    if req.params.seed is None or index == 0:
        return req.params
    return dataclasses.replace(req.params, seed=req.params.seed + index)


def _hands_on(request: web.Request, node: Daemon, req: CompletionRequest, failure: BaseException | None) -> bool:
    """Whether a request this supernode began goes on at the next one: it yielded
    (not stopping: then no next one is named until it is gone), one choice ran, and
    a client sent it here (an entry peer that forwarded it resubmits it itself)."""
    return (isinstance(failure, SupernodeChanged) and req.n == 1 and not node.stopping
            and not _mesh_peer(request))


async def _whole(request: web.Request, node: Daemon, req: CompletionRequest, body: dict,
                 client: str | None = None) -> web.StreamResponse:
    cid = completion_id(req.chat)
    usage = Usage()
    texts: list[list[str]] = [[] for _ in range(req.n)]
    ids: list[list[int]] = [[] for _ in range(req.n)]

    async def one(index: int) -> dict:
        finish = None
        async for chunk in node.metrics.observe(node.scheduler.generate(
            req.prompt_ids, _choice_params(req, index), usage, history=list(req.resume), priority=req.priority,
            client=client, request=cid,
        )):
            texts[index].append(chunk.text)
            ids[index].extend(chunk.token_ids)
            finish = chunk.finish_reason or finish
        return choice_json(req.chat, index, "".join(texts[index]), ids[index], finish)

    try:
        choices = await asyncio.gather(*(one(i) for i in range(req.n)))
    except SupernodeChanged as exc:
        if not _hands_on(request, node, req, exc):
            raise
        log.info("session_handed_on", tokens=len(ids[0]), reason=str(exc))
        return await proxy_completion(node, request, body, req.chat,
                                      Handoff(cid, None, ids[0], "".join(texts[0])))
    return web.json_response(response_json(req, cid, list(choices), len(req.prompt_ids), usage.completion_tokens))


async def _stream(request: web.Request, node: Daemon, req: CompletionRequest, body: dict,
                  client: str | None = None) -> web.StreamResponse:
    cid = completion_id(req.chat)
    # Fail before the 200 goes out when the mesh cannot serve at all.
    if node.pipeline.plan is None:
        raise NoCapacity(node.unavailable_reason())
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    queue: asyncio.Queue[tuple[dict, tuple[int, ...], str] | None] = asyncio.Queue()
    sent_ids, sent_text = [], []  # of choice 0, what the client has been sent

    usage = Usage()

    async def one(index: int) -> None:
        first = True
        try:
            async for chunk in node.metrics.observe(node.scheduler.generate(
                req.prompt_ids, _choice_params(req, index), usage, history=list(req.resume), priority=req.priority,
                client=client, request=cid,
            )):
                data = chunk_json(req, cid, index, chunk.text, list(chunk.token_ids), chunk.finish_reason, first=first)
                await queue.put((data, chunk.token_ids if index == 0 else (), chunk.text if index == 0 else ""))
                first = False
        finally:
            await queue.put(None)

    async def write_events() -> None:
        finished = 0
        while finished < req.n:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                # An SSE comment while a long prefill runs: tells the entry peer
                # (and any proxy) that this supernode is alive.
                await resp.write(SSE_KEEPALIVE)
                continue
            if item is None:
                finished += 1
            else:
                data, ids, text = item
                await resp.write(sse(data))
                sent_ids.extend(ids)
                sent_text.append(text)
        if req.include_usage:
            final = response_json(req, cid, [], len(req.prompt_ids), usage.completion_tokens)
            final["object"] = "chat.completion.chunk" if req.chat else "text_completion"
            await resp.write(sse(final))

    # A client that goes away makes write_events raise, the group cancels the
    # generations, and their sessions are freed on every stage.
    gone, failure = False, None
    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(req.n):
                tg.create_task(one(i))
            tg.create_task(write_events())
    except* ConnectionResetError:
        gone = True
    except* KNOWN_ERRORS as group:
        failure = group.exceptions[0]
    if gone:  # an ordinary event, not a server error: nobody is left to tell
        log.info("client_gone", path=request.path)
        return resp
    if _hands_on(request, node, req, failure):
        log.info("session_handed_on", tokens=len(sent_ids), reason=str(failure))
        return await proxy_completion(node, request, body, req.chat,
                                      Handoff(cid, resp, sent_ids, "".join(sent_text)))
    if failure is not None:
        log.warning("stream_failed", error=str(failure))
        status = 503 if isinstance(failure, NoCapacity) else 500
        await resp.write(sse(error_json(f"generation failed: {failure}", status, code=_code(failure))))
    await resp.write(sse(DONE))
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response(
        {"object": "list", "data": [{"id": node.model_name, "object": "model", "owned_by": "meshd", "created": 0}]}
    )


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    serving = node.serves()
    return web.json_response({"ok": serving, "node": node.node_id}, status=200 if serving else 503)


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status())


async def drain(request: web.Request) -> web.Response:
    """POST /v1/mesh/drain {"node": ID}: move that peer's span away (any peer; the supernode acts)."""
    node = request.app[NODE]
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("node"), str):
        raise BadRequest('the body must be {"node": NODE_ID}', param="node")
    if not node.view.is_supernode:
        async with node.supernode_post(request.path, body) as up:
            return web.Response(body=await up.read(), status=up.status, content_type="application/json")
    return web.json_response(await node.drain_peer(body["node"]))


def make_app(node: Daemon) -> web.Application:
    """The HTTP app of a peer: these routes, and the node's own (``/mesh/...``) added by it."""
    app = web.Application(client_max_size=node.config.max_body_bytes,
                          # outermost first: the count sees the status the client gets
                          middlewares=[node.metrics.count_requests, control_guard(_control_keys, _mesh_peer),
                                       auth_middleware, errors_middleware])
    app[NODE] = node
    app.router.add_get("/metrics", node.metrics.handle)
    dashboard.add_routes(app)
    app.router.add_post("/v1/mesh/drain", drain)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    return app
