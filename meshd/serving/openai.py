"""The OpenAI-compatible request and response shapes: validation of what a
client sends, the JSON objects we send back, and their server-sent-event framing
(one helper each: ``error_json``, ``sse``/``sse_events``)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from meshd.errors import BadRequest, ModelError
from meshd.serving.scheduler import Priority
from shards.sampling import SamplingParams
from shards.tokenizer import MeshTokenizer

MAX_CHOICES = 8
MAX_STOPS = 4


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stream: bool
    # meshd extension: tokens already generated (a resubmission after a supernode loss).
    resume: tuple[int, ...] = ()
    include_usage: bool = False
    # meshd extension: "batch" for a batch job's line, which interactive requests go ahead of.
    priority: Priority = Priority.INTERACTIVE


def _number(body: dict, key: str, default: float, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"{key} must be {kind}", param=key)
    if value < lo or value > hi or (lo_open and value == lo):
        low = f"> {lo}" if lo_open else f">= {lo}"
        raise BadRequest(f"{key} must be {low} and <= {hi}, got {value}", param=key)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS}", param="stop")
    return tuple(stop)


def _chat_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages is required: a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}] needs a role of system, user or assistant", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # the content-parts form: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(
    body: Any, *, chat: bool, model: str, tokenizer: MeshTokenizer, context: int, max_tokens_limit: int
) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    asked = body.get("model", model)
    if asked != model:
        raise BadRequest(f"model {asked!r} is not served here; this mesh serves {model!r}", status=404, param="model")
    if chat:  # the model's template writes BOS itself where it has one
        try:
            prompt_ids = tokenizer.encode_chat(_chat_messages(body))
        except ModelError as exc:  # the template refuses these messages (say, a system turn for Gemma)
            raise BadRequest(str(exc), param="messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt is required: a non-empty string", param="prompt")
        prompt_ids = tokenizer.encode_prompt(prompt)  # with BOS where the model wants one
    default_max = min(16 if not chat else 256, max_tokens_limit)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _number(body, key, default_max, 1, max_tokens_limit, integer=True)
    resume = body.get("meshd_resume") or []
    if not isinstance(resume, list) or not all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in resume):
        raise BadRequest("meshd_resume must be a list of token ids", param="meshd_resume")
    if len(prompt_ids) + max_tokens > context:
        raise BadRequest(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context window of {context}",
            param="max_tokens",
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", param="stream")
    params = SamplingParams(
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
        seed=seed,
        max_tokens=max_tokens,
        stop=_stops(body),
    )
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    if resume and n != 1:
        raise BadRequest("meshd_resume needs n = 1", param="meshd_resume")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage")) and stream
    priority = body.get("meshd_priority", "interactive")
    if priority not in ("interactive", "batch"):
        raise BadRequest('meshd_priority must be "interactive" or "batch"', param="meshd_priority")
    return CompletionRequest(chat, model, prompt_ids, params, n, stream, tuple(resume), include_usage,
                             Priority[priority.upper()])


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def choice_json(chat: bool, index: int, text: str, token_ids: list[int], finish: str | None) -> dict:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "token_ids": token_ids,
        }
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}


def response_json(req: CompletionRequest, cid: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return completion_json(req.chat, cid, req.model, choices, usage)


def completion_json(chat: bool, cid: str, model: str | None, choices: list[dict], usage: dict | None) -> dict:
    return {
        "id": cid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chunk_json(
    req: CompletionRequest, cid: str, index: int, text: str | None, token_ids: list[int], finish: str | None,
    *, first: bool = False,
) -> dict:
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish, "token_ids": token_ids}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
        kind = "text_completion"
    return {"id": cid, "object": kind, "created": int(time.time()), "model": req.model, "choices": [choice]}


# The code of a 503 that an entry peer answers by asking the next supernode (this
# one yielded or stops); a client that gets it (it came straight here) retries elsewhere.
SUPERNODE_CHANGED = "supernode_changed"


def error_json(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape, as a body or as an event of a stream that fails."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = code or {404: "model_not_found" if param == "model" else "not_found", 409: "conflict",
                    413: "request_too_large", 503: "mesh_unavailable", 507: "storage_full"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# -- server-sent events ---------------------------------------------------------------

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# A comment, not an event: keeps a stream (and whoever proxies it) alive during a long prefill.
SSE_KEEPALIVE = b": keepalive\n\n"
DONE = "[DONE]"


def sse(data: dict | str) -> bytes:
    """One event: a JSON object, or a raw payload such as ``[DONE]``."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return b"data: " + payload.encode() + b"\n\n"


async def sse_events(content: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The data payloads of a server-sent event stream (line by line)."""
    async for raw in content:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data:"):
            yield line[5:].strip()
