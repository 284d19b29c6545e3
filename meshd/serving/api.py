"""HTTP API on every peer: the OpenAI-compatible endpoints, /status, /healthz, /metrics, the dashboard.

The handler is one of the three places errors are caught: a MeshError (or the model
side's ShardsError) becomes a 4xx/5xx JSON body, and the daemon goes on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import re
import secrets

import structlog
from aiohttp import web

from meshd.control.tunnel import ENTRY_HEADER, FRAMES_TYPE, GENERATE, TUNNEL_HEADER
from meshd.errors import KNOWN_ERRORS, BadRequest, InvalidParams, NoCapacity, ProtocolError, StorageFull, SupernodeChanged
from meshd.serving import dashboard, generation
from meshd.serving.daemon import NODE, REQUEST_ID, TRACE, Daemon
from meshd.serving.guards import (CLIENT_KEY, bearer_key, check_prompt_size, client_id, control_guard, parse_json,
                                  prompt_chars)
from meshd.serving.metrics import CLIENT_CLOSED, CLIENT_GONE
from meshd.serving.observe import Observe
from meshd.serving.edge import Edge
from meshd.serving.openai import (
    DONE,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    CompletionRequest,
    MeshCode,
    completion_id,
    error_json,
    find_surrogate,
    prepare,
    read_request,
    request_chars,
    tokenize_chat,
    sse,
)
from meshd.serving.proxy import Handoff, proxy_completion
from meshd.serving.traces import TraceContext
from protocol import generate as gen
from protocol.codec import DEFAULT_MAX_FRAME, decode_of, encode
from protocol.messages import NO_CHAT
from shards import grammar
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()

LOCAL_HEADER = "X-Meshd-Local"  # Daemon.local_auth: this process calling its own API


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> web.Response:
    return web.json_response(error_json(message, status, param, code), status=status)


def _code(exc: BaseException) -> MeshCode | None:
    """SUPERNODE_CHANGED for a request the next supernode can take (an entry peer resubmits it)."""
    return MeshCode.SUPERNODE_CHANGED if isinstance(exc, SupernodeChanged) else None


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(str(exc), exc.status, exc.param, exc.code)
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


_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    """x-request-id: the client's (if it is a plain token) or a new one, on the answer and the logs;
    the W3C trace context: the client's ``traceparent`` (if valid) or a new trace, with this peer's span."""
    given = request.headers.get("X-Request-Id", "")
    rid = given if _REQUEST_ID_OK.fullmatch(given) else "req_" + secrets.token_hex(12)
    request[REQUEST_ID] = rid
    request[TRACE] = TraceContext.from_headers(request.headers.get("traceparent"), request.headers.get("tracestate"))
    with structlog.contextvars.bound_contextvars(request_id=rid):
        return await handler(request)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """On every answer, streamed ones too (their headers go out at prepare)."""
    rid = request.get(REQUEST_ID)
    if rid:
        response.headers["X-Request-Id"] = rid
    if (ctx := request.get(TRACE)) is not None:  # the caller's trace id, with this peer's span
        response.headers["traceparent"] = ctx.header()
        if ctx.state:
            response.headers["tracestate"] = ctx.state
    origin = _cors_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, traceparent"
        response.headers.add("Vary", "Origin")


def _cors_origin(request: web.Request) -> str | None:
    """The Access-Control-Allow-Origin this request gets, or None."""
    origin = request.headers.get("Origin")
    if not origin:
        return None
    config = request.app[NODE].config
    allowed = config.cors_mesh_origins if request.path.startswith("/v1/mesh/") else config.cors_origins
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


@web.middleware
async def cors_middleware(request: web.Request, handler):
    """CORS preflight (OPTIONS) answered before auth: browsers send it without credentials."""
    if request.method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
        if _cors_origin(request) is None:
            return error_response("this origin may not call this API (see cors_origins)", 403)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                "Authorization, Content-Type"),
            "Access-Control-Max-Age": "600"})
    return await handler(request)


_bearer = bearer_key


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
    if request.path.startswith("/v1/") or request.path in TOKENIZER_PATHS or request.path == GENERATE:
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


COMPLETIONS_PATH, CHAT_PATH = "/v1/completions", "/v1/chat/completions"


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


def _status_of(exc: BaseException) -> int:
    """The status the errors middleware gives an error (for the request's timeline)."""
    match exc:
        case BadRequest():
            return exc.status
        case InvalidParams():
            return 400
        case NoCapacity():
            return 503
        case StorageFull():
            return 507
        case web.HTTPException():
            return exc.status
        case asyncio.CancelledError():
            return CLIENT_CLOSED
    return 500


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    """One completion request, with its timeline (``node.traces``) from arrival to the answer's end."""
    node = request.app[NODE]
    entry = request.headers.get(ENTRY_HEADER) if _mesh_peer(request) else None
    trace = node.traces.begin(request[REQUEST_ID], request[TRACE], request.path, entry)
    try:
        resp = await _complete_traced(request, chat, trace)
    except BaseException as exc:
        node.traces.finish(trace, _status_of(exc))
        raise
    node.traces.finish(trace, CLIENT_CLOSED if request.get(CLIENT_GONE) else resp.status)
    return resp


async def _complete_traced(request: web.Request, chat: bool, trace) -> web.StreamResponse:
    node = request.app[NODE]
    if node.stopping:
        raise SupernodeChanged("this peer is shutting down; send the request to another peer")
    body = await read_json(request)
    client = request[CLIENT_KEY] = client_id(request, False, _bearer(request))
    # Read and checked here, at the edge (building a response_format's grammar takes a
    # moment: off the loop); tokenized where the tokenizer is, the supernode.
    msg = await asyncio.get_running_loop().run_in_executor(_tokenize_pool(), functools.partial(
        read_request, body, chat=chat, model=node.model_name))
    if not node.view.is_supernode:
        trace.proxied, trace.supernode = True, node.view.supernode  # its timeline is the supernode's
        return await proxy_completion(node, request, msg)
    req, tokenizer = await _prepared(node, msg)
    if req.stream and node.pipeline.plan is None:  # fail before the 200 goes out when the mesh cannot serve
        raise NoCapacity(node.uplink.unavailable_reason())
    cid = completion_id(req.chat)
    async with _opened(node, req, client, cid, trace) as sessions:
        # Counted from here to the last byte, so that a stop waits for it also between its
        # sessions ending here (the lead handed on) and its relay to the next supernode.
        with node.relaying():
            return await _answer(request, node, req, sessions, tokenizer, msg, cid)


async def _prepared(node: Daemon, msg: gen.Generate) -> tuple[CompletionRequest, MeshTokenizer]:
    """The request made ready to run with the supernode's tokenizer, context and template."""
    engine_ready = await node.serving_parts_soon()
    if engine_ready is None:
        raise NoCapacity(node.uplink.unavailable_reason())
    tokenizer, context = engine_ready
    check_prompt_size(request_chars(msg.request), "messages" if msg.request.chat else "prompt", context,
                      tokenizer.max_token_chars)
    # Tokenizing (and rendering a chat template) takes a while on a long prompt: on a
    # thread of its own, so heartbeats and other requests go on meanwhile.
    req = await asyncio.get_running_loop().run_in_executor(_tokenize_pool(), functools.partial(
        prepare, msg, model=node.model_name, tokenizer=tokenizer, context=context,
        max_tokens_limit=node.config.max_tokens_limit))
    if req.params.grammar is not None or req.params.logprobs is not None:
        await asyncio.to_thread(grammar.grammar_tokenizer, tokenizer)  # built once (~1 s), off the loop
    return req, tokenizer


@contextlib.asynccontextmanager
async def _opened(node: Daemon, req: CompletionRequest, client: str, cid: str, trace):
    """Every choice admitted (a session each) before any answer goes out: a full KV budget
    is a 503, not a 200 whose stream then says so. Closed however the answer ends."""
    sessions = trace.sessions = []
    trace.admit()
    try:
        runs = req.to_run()  # a resubmission does not run again the choices already whole
        for i in runs:
            sessions.append(node.scheduler.open(req.prompt_of(i), req.params_for(i), list(req.resume_of(i)),
                                                req.priority, client, cid, trace=trace if i == runs[0] else None))
        yield dict(zip(runs, sessions))
    finally:
        for s in sessions:
            await node.scheduler.close(s)  # any that never got to stream


TOKENIZE_THREADS = 4


@functools.cache
def _tokenize_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Prompts are tokenized (and chat templates rendered) off the event loop, a few at a
    time: a render waits on its worker process (shards/template_sandbox.py) up to its time
    limit, and a bad template's render must not hold up every other prompt meanwhile."""
    return concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="meshd-tokenize")


def _hands_on(node: Daemon, failure: BaseException | None) -> bool:
    """Whether a request this supernode began for its own client goes on at the next one:
    it yielded (also when it stops: it handed the lead on first, and waits for what it
    relays; not if it still leads, alone). Every choice goes on from what it was sent."""
    return isinstance(failure, SupernodeChanged) and not (node.stopping and node.view.is_supernode)


async def _answer(request: web.Request, node: Daemon, req: CompletionRequest, sessions: dict, tokenizer,
                  msg: gen.Generate, cid: str) -> web.StreamResponse:
    """This supernode's own client's answer: the generation's frames through the edge, as
    a stream or one body."""
    edge = Edge(req.chat, cid)
    for i in range(req.choices):
        if resume := req.resume_of(i):
            edge.seed(i, list(resume))
    resp: web.StreamResponse | None = None
    if req.stream:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)

    async def emit(frame: gen.Output) -> None:
        match frame:
            case gen.Begin():
                edge.begin(frame)
            case gen.Delta():
                chunk = edge.delta(frame)
                if resp is not None and chunk is not None:
                    await resp.write(sse(chunk))
            case gen.Keepalive() if resp is not None:
                # An SSE comment while a long prefill runs: tells the client (and any proxy) we are alive.
                await resp.write(SSE_KEEPALIVE)
            case gen.Usage():
                final = edge.usage_chunk(frame)
                if resp is not None and req.include_usage:
                    await resp.write(sse(final))

    # A client that goes away makes a write raise, the generations are cancelled, and
    # their sessions are freed on every stage.
    failure: BaseException | None = None
    try:
        await generation.run(node.scheduler, node.metrics.observe, req, sessions, tokenizer, emit)
    except ConnectionResetError:  # an ordinary event, not a server error: nobody is left to tell
        request[CLIENT_GONE] = True
        log.info("client_gone", path=request.path)
        return resp if resp is not None else web.Response(status=CLIENT_CLOSED)
    except KNOWN_ERRORS as exc:
        failure = exc
    if _hands_on(node, failure):
        log.info("session_handed_on", tokens=len(edge.first_ids), choices=len(sessions), reason=str(failure))
        return await proxy_completion(node, request, msg, Handoff(edge, resp))
    if resp is None:
        if failure is not None:
            raise failure
        return web.json_response(edge.whole())
    if failure is not None:
        log.warning("stream_failed", error=str(failure))
        f = generation.failure_of(failure, during=True)
        await resp.write(sse(error_json(f.message, f.status, f.param or None, f.code or None)))
    await resp.write(sse(DONE))
    await resp.write_eof()
    return resp


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /mesh/generate, for the tunnel only: a completion an entry peer hands over, as a
    ``Generate``; its answer is a stream of frames, a ``Failure`` among them if it fails."""
    node = request.app[NODE]
    if not _mesh_peer(request):
        raise web.HTTPNotFound()
    # A resubmission's history (every choice's tokens so far) may pass the client's body limit:
    # bounded by what one link frame carries.
    raw = await request.clone(client_max_size=DEFAULT_MAX_FRAME).read()
    resp = web.StreamResponse(headers={"Content-Type": FRAMES_TYPE})
    await resp.prepare(request)
    begun = False

    async def emit(frame: gen.Output) -> None:
        nonlocal begun
        begun = begun or isinstance(frame, gen.Begin)
        await resp.write(gen.frame(encode(frame, gen.OUTPUT_TYPES)))

    try:
        msg: gen.Generate = decode_of(raw, gen.REQUEST_TYPES, DEFAULT_MAX_FRAME)
    except ProtocolError as exc:
        await emit(gen.Failure(gen.Act.FAIL, 400, f"malformed request frame: {exc}"))
        return resp
    chat = bool(msg.request.chat)
    trace = node.traces.begin(request[REQUEST_ID], request[TRACE], CHAT_PATH if chat else COMPLETIONS_PATH,
                              request.headers.get(ENTRY_HEADER))
    status = 200
    try:
        if node.stopping or not node.view.is_supernode:  # a peer took this one for the supernode
            raise SupernodeChanged(f"this peer is not the supernode (it follows {node.view.supernode})"
                                   if not node.view.is_supernode else "this peer is shutting down")
        client = request[CLIENT_KEY] = client_id(request, True, _bearer(request))
        req, tokenizer = await _prepared(node, msg)
        async with _opened(node, req, client, completion_id(chat), trace) as sessions:
            with node.relaying():
                await generation.run(node.scheduler, node.metrics.observe, req, sessions, tokenizer, emit)
    except ConnectionResetError:
        status = CLIENT_CLOSED  # the entry peer went away: nobody to answer
    except KNOWN_ERRORS as exc:
        if begun:
            log.warning("stream_failed", error=str(exc))
        failure = generation.failure_of(exc, during=begun)
        status = failure.status
        with contextlib.suppress(ConnectionResetError):
            await emit(failure)
    except Exception as exc:  # a bug of ours: the entry peer gets a 500 it passes on, not a cut answer it retries
        log.exception("generate_failed", error=repr(exc))
        status = 500
        with contextlib.suppress(ConnectionResetError):
            await emit(gen.Failure(gen.Act.FAIL, 500, f"the supernode failed: {exc!r}"[:1000]))
    except BaseException as exc:
        node.traces.finish(trace, _status_of(exc))
        raise
    node.traces.finish(trace, status)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def _model_json(node: Daemon) -> dict:
    manifest = node.store.manifest
    context = manifest.config.max_position if manifest is not None else None
    return {"id": node.model_name, "object": "model", "owned_by": "meshd", "created": 0,
            "context_length": context, "max_model_len": context, **_chat_json(node)}


def _chat_json(node: Daemon) -> dict:
    """Whether /v1/chat/completions works, and with which template (meshd's fields): the
    supernode renders chats, so its own tokenizer's, else what its plan said; null: not
    known yet (no plan)."""
    tokenizer = node.scheduler.tokenizer if node.view.is_supernode else None
    plan = node.view.plan
    if tokenizer is not None:
        origin = tokenizer.template.origin
    elif plan is not None and plan.chat_template:
        origin = None if plan.chat_template == NO_CHAT else plan.chat_template
    else:
        return {"chat": None, "chat_template": None}
    return {"chat": origin is not None, "chat_template": origin}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_json(request.app[NODE])]})


async def model(request: web.Request) -> web.Response:
    node = request.app[NODE]
    if request.match_info["model"] != node.model_name:
        raise BadRequest(f"model {request.match_info['model']!r} is not served here", status=404, param="model")
    return web.json_response(_model_json(node))


async def health(request: web.Request) -> web.Response:
    """GET /health (what OpenAI-compatible servers answer for load balancers): 200 when this peer serves."""
    node = request.app[NODE]
    if node.uplink.serves() and not node.stopping:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable", "reason": node.uplink.unavailable_reason()}, status=503)


TOKENIZER_PATHS = ("/tokenize", "/detokenize")


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize {"prompt": TEXT} or {"messages": [...]} (vLLM's shape): the token ids the
    model would see; POST /detokenize {"tokens": [...]}: their text. Run by the supernode (a
    member hands it over the sealed link), after the prompt bound, off the event loop."""
    node = request.app[NODE]
    body = await read_json(request)
    if not node.view.is_supernode:
        if _mesh_peer(request):  # a peer took this one for the supernode: not a chain of hand-overs
            raise SupernodeChanged(f"this peer is not the supernode (it follows {node.view.supernode})")
        async with node.uplink.post(request.path, body, request.headers.get("Authorization", ""),
                                       client=client_id(request, False, _bearer(request)),
                                       request_id=request.get(REQUEST_ID, "")) as up:
            return web.Response(body=await up.read(), status=up.status, content_type="application/json")
    parts = await node.serving_parts_soon()
    if parts is None:
        raise NoCapacity(node.uplink.unavailable_reason())
    tokenizer, context = parts
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    bad = find_surrogate(body)
    if bad is not None:
        raise BadRequest(f"{bad} holds a lone UTF-16 surrogate: not valid Unicode", param=bad)
    run = functools.partial(asyncio.get_running_loop().run_in_executor, _tokenize_pool())
    if request.path == "/detokenize":
        given = body.get("tokens")
        if not isinstance(given, list) or not all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in given):
            raise BadRequest("tokens must be a list of token ids of this model", param="tokens")
        return web.json_response({"prompt": await run(tokenizer.decode, given)})
    check_prompt_size(prompt_chars(body), "messages" if "messages" in body else "prompt", context,
                      tokenizer.max_token_chars)
    if isinstance(body.get("prompt"), str):
        special = body.get("add_special_tokens", True) is not False
        ids = await run(tokenizer.encode, body["prompt"], special)
    elif body.get("messages") is not None:
        ids = await run(tokenize_chat, body, tokenizer, context)
    else:
        raise BadRequest("tokenize takes a prompt (a string) or messages", param="prompt")
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": context})


async def healthz(request: web.Request) -> web.Response:
    node = request.app[NODE]
    serving = node.uplink.serves()
    return web.json_response({"ok": serving, "node": node.node_id}, status=200 if serving else 503)


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].status())


async def drain(request: web.Request) -> web.Response:
    """POST /v1/mesh/drain {"node": ID}: move that peer's span away (any peer; the supernode acts)."""
    node = request.app[NODE]
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("node"), str):
        raise BadRequest('the body must be {"node": NODE_ID}', param="node")
    if not node.view.is_supernode:  # with the caller's key: the supernode checks its own
        async with node.uplink.post(request.path, body, request.headers.get("Authorization", "")) as up:
            return web.Response(body=await up.read(), status=up.status, content_type="application/json")
    return web.json_response(await node.drain_peer(body["node"]))


def make_app(node: Daemon) -> web.Application:
    """The HTTP app of a peer: these routes, and the node's own (``/mesh/...``) added by it."""
    app = web.Application(client_max_size=node.config.max_body_bytes,
                          # outermost first: the count sees the status the client gets
                          middlewares=[node.metrics.count_requests, request_id_middleware, cors_middleware,
                                       control_guard(_control_keys, _mesh_peer, node.config.allowed_hosts),
                                       auth_middleware, errors_middleware])
    app[NODE] = node
    app.router.add_get("/metrics", node.metrics.handle)
    dashboard.add_routes(app)
    Observe(_mesh_peer).add_routes(app)  # /live, /traces, /metrics/targets
    app.router.add_post("/v1/mesh/drain", drain)
    app.router.add_post(COMPLETIONS_PATH, completions)
    app.router.add_post(CHAT_PATH, chat_completions)
    app.router.add_post(GENERATE, generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    for path in TOKENIZER_PATHS:
        app.router.add_post(path, tokenize)
    app.on_response_prepare.append(_add_request_id)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/status", status)
    return app
