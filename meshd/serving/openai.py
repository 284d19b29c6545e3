"""The OpenAI-compatible request and response shapes: a client's request read and
checked at the edge of the peer it came to (``read_request``: every field that needs no
tokenizer) into the mesh's typed ``protocol.generate.Request``, made ready on the
supernode (``prepare``: checked again, and against its tokenizer, context and chat
template; tokenized); the JSON objects we send back and their server-sent-event framing
(``error_json``, ``sse``), which only the HTTP edge uses (``meshd.serving.edge``)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from meshd.errors import BadRequest, ModelError
from meshd.serving import toolcalls
from meshd.serving.scheduler import Priority
from shards import grammar
from shards.chat_templates import BUILTIN
from shards.sampling import MAX_TOP_LOGPROBS, SamplingParams
from shards.template_sandbox import TemplateLimit, WorkerUnavailable
from protocol import generate as gen
from shards.tokenizer import MeshTokenizer

MAX_CHOICES = 8
MAX_STOPS = 4
MAX_PROMPTS = 16  # prompts of one batched completion request
MAX_OUTPUTS = 32  # prompts x n
MAX_LOGPROBS_COMPLETIONS = 5
MAX_TOOLS = 64

NO_TEMPLATE = ("this model has no chat template, so there is no telling how it expects a chat: start meshd "
               f"(the supernode) with --chat-template NAME|FILE ({', '.join(BUILTIN)}, or a Jinja file), "
               "or send a plain prompt to /v1/completions")

@dataclass(frozen=True, slots=True)
class _Range:
    """A sampling number taken as it is: its default and the range it must lie in."""

    default: float
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is out


# The sampling numbers a request carries as the client sent them: read by ``read_request``,
# checked again by ``prepare`` (a peer could send others), passed to ``SamplingParams`` under
# the same name. A new one is a line here, a field of ``gen.Request`` and one of SamplingParams.
SAMPLING_NUMBERS = {
    "temperature": _Range(1.0, 0.0, 2.0),
    "top_p": _Range(1.0, 0.0, 1.0, lo_open=True),
    "min_p": _Range(0.0, 0.0, 1.0),
    "presence_penalty": _Range(0.0, -2.0, 2.0),
    "frequency_penalty": _Range(0.0, -2.0, 2.0),
    "repetition_penalty": _Range(1.0, 0.0, 10.0, lo_open=True),
}
# What each endpoint implements. Any other field is a 400 naming it: nothing is silently dropped.
_COMMON = {"model", "max_tokens", "n", "stream", "stream_options", "seed", "stop", "logit_bias", "top_k",
           "meshd_resume", "meshd_finished", "meshd_priority", "min_tokens", "ignore_eos", *SAMPLING_NUMBERS}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
# Fields with no effect on the answer (who asks, caching hints), or accepted at their
# no-op value only: anything else asks for something meshd does not do.
_INERT_ANY = {"user", "safety_identifier", "prompt_cache_key"}
_INERT_VALUES: dict[str, tuple[object, ...]] = {"store": (False,), "service_tier": ("auto", "default"),
                                                "modalities": (["text"],), "metadata": ({},)}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The tools of a chat request and what the model must do with them."""

    tools: tuple[dict, ...]
    choice: str  # none | auto | required | function
    name: str | None = None  # the function tool_choice names
    parallel: bool = True
    fmt: str = toolcalls.HERMES


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    chat: bool
    model: str
    prompts: tuple[tuple[int, ...], ...]  # one per prompt (a chat has one)
    params: SamplingParams  # max_tokens: as asked, or the rest of the first prompt's context
    n: int
    stream: bool
    # meshd extension: each choice's tokens already generated, and the choices already
    # whole (a resubmission after a supernode change: see _resumes).
    resumes: tuple[tuple[int, ...], ...] = ()
    finished: frozenset[int] = frozenset()
    include_usage: bool = False
    echo: bool = False
    max_tokens_given: bool = True
    context: int = 0
    tools: ToolSpec | None = None
    prompt_texts: tuple[str, ...] = ()  # completions: each prompt as text (for echo)
    # meshd extension: "batch" for a batch job's line, which interactive requests go ahead of.
    priority: Priority = Priority.INTERACTIVE

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.prompts[0])

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def params_for(self, choice: int) -> SamplingParams:
        """Choice ``i`` is prompt ``i // n``'s ``(i % n)``-th sample (OpenAI's order); seeds
        step per choice so the n samples differ and each is reproducible."""
        prompt = self.prompts[choice // self.n]
        changes: dict[str, Any] = {}
        if not self.max_tokens_given:
            changes["max_tokens"] = self.context - len(prompt)
        if self.params.seed is not None and choice:
            changes["seed"] = self.params.seed + choice
        return dataclasses.replace(self.params, **changes) if changes else self.params

    def prompt_of(self, choice: int) -> list[int]:
        return list(self.prompts[choice // self.n])

    def resume_of(self, choice: int) -> tuple[int, ...]:
        """The tokens choice ``i`` already has (a resubmission goes on after them)."""
        return self.resumes[choice] if choice < len(self.resumes) else ()

    @property
    def resumed(self) -> bool:
        return any(self.resumes) or bool(self.finished)

    def to_run(self) -> list[int]:
        """The choices this request runs: all but those already whole."""
        return [i for i in range(self.choices) if i not in self.finished]


def _number(body: dict, key: str, default: float, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"{key} must be {kind}", param=key)
    return _in_range(value, key, lo, hi, lo_open)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false", param=key)
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


def check_fields(body: dict, chat: bool) -> None:
    """A 400 naming the first field meshd does not implement (null counts as absent)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key, value in body.items():
        if key in known or key in _INERT_ANY or value is None:
            continue
        if key in _INERT_VALUES and value in _INERT_VALUES[key]:
            continue
        what = "this value of " if key in _INERT_VALUES else ""
        raise BadRequest(f"{what}{key} is not implemented by meshd", param=key)


def find_surrogate(value: Any, path: str = "") -> str | None:
    """Where a lone UTF-16 surrogate (a ``\\ud800`` escape that pairs with nothing) sits in
    decoded JSON: no tokenizer can take it. Iterative (a deep body cannot recurse us out)."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in v.items())
            if any(isinstance(k, str) and find_surrogate(k) for k in v):
                return where or "body"
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def _text_content(content: Any, where: str) -> str:
    """A message's text: a string, or content parts of which only text is taken."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in ("image_url", "input_image", "input_audio", "file", "audio"):
                raise BadRequest(f"{where}[{j}] is {kind}: this model takes text only", param="messages")
            else:
                raise BadRequest(f"{where}[{j}] must be a text part", param="messages")
        return "".join(out)
    raise BadRequest(f"{where} must be a string or a list of text parts", param="messages")


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages is required: a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(f"{where} needs a role of system, developer, user, assistant or tool", param="messages")
        allowed = {"role", "content", "name"} | ({"tool_calls", "refusal"} if role == "assistant" else set()) \
            | ({"tool_call_id"} if role == "tool" else set())
        for key, value in m.items():
            if key not in allowed and value is not None:
                raise BadRequest(f"{where}.{key} is not implemented by meshd", param="messages")
        content = m.get("content")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if content is None and role == "assistant":
            msg["content"] = None
        else:
            msg["content"] = _text_content(content, f"{where}.content")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadRequest(f"{where}.tool_call_id must be a string", param="messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list", param="messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), str):
            raise BadRequest(f"{where}[{j}] needs function.name and function.arguments (a JSON string)",
                             param="messages")
        try:
            json.loads(fn.get("arguments") or "{}")
        except (ValueError, RecursionError):  # nested past the parser's depth inside the string
            raise BadRequest(f"{where}[{j}].function.arguments is not JSON", param="messages") from None
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments") or "{}"}})
    return out


def _tool_defs(body: dict) -> tuple[tuple[gen.Tool, ...], str, str, bool]:
    """A chat's tools, its tool_choice ("": no tools), the function it names, and whether
    calls may be parallel."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return (), "", "", False
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    clean: list[gen.Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function":
            raise BadRequest(f"tools[{i}].type must be function (meshd runs no built-in tools)", param=f"tools[{i}].type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}].function needs a name", param=f"tools[{i}].function")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                             param=f"tools[{i}].function.parameters")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise BadRequest(f"tools[{i}].function.description must be a string",
                             param=f"tools[{i}].function.description")
        clean.append(gen.Tool(fn["name"], description, json.dumps(params or {"type": "object", "properties": {}})))
    names = [t.name for t in clean]
    name = ""
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or fn.get("name") not in names:
            raise BadRequest(f"tool_choice must name one of the tools: {names}", param="tool_choice")
        choice, name = "function", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise BadRequest("tool_choice must be none, auto, required or {type: function, function: {name}}",
                         param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    return tuple(clean), choice, name, parallel is True


def _tools(req: gen.Request, template) -> ToolSpec | None:
    """The request's tools as the chat template and the call parser take them (in the
    template's tool-call format). Checked again here: they may come from a peer."""
    if not req.tool_choice:
        if req.tools:
            raise BadRequest("tools without a tool_choice", param="tools")
        return None
    if len(req.tools) > MAX_TOOLS or not all(t.name for t in req.tools):
        raise BadRequest(f"tools must be at most {MAX_TOOLS} named functions", param="tools")
    names = [t.name for t in req.tools]
    if req.tool_choice not in ("none", "auto", "required", "function") or \
            (req.tool_choice == "function") != (req.tool_name in names):
        raise BadRequest(f"tool_choice must name one of the tools: {names}", param="tool_choice")
    clean = []
    for i, t in enumerate(req.tools):
        try:
            params = json.loads(t.parameters)
        except (ValueError, RecursionError):
            params = None
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                             param=f"tools[{i}].function.parameters")
        clean.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": params}})
    # A forced call is one call unless several are asked for outright: a small model let
    # free after its call tends to call again until max_tokens.
    return ToolSpec(tuple(clean), req.tool_choice, req.tool_name or None, bool(req.parallel_tools),
                    toolcalls.tool_format(template.source))


def _response_format(body: dict) -> tuple[str, str]:
    """What a response_format asks for ("": free text; json_object; json_schema) and its
    schema as JSON text; the grammar is built here to check it (and again where it runs)."""
    rf = body.get("response_format")
    if rf is None:
        return "", ""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return "", ""
    if kind == "json_object":
        return kind, ""
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise BadRequest("response_format.json_schema needs a name (and a schema)", param="response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise BadRequest("response_format.json_schema.schema must be an object", param="response_format.json_schema")
        _format_grammar(kind, schema)
        return kind, json.dumps(schema)
    raise BadRequest(f"response_format.type {kind!r} is not implemented: text, json_object or json_schema",
                     param="response_format.type")


def _format_grammar(kind: str, schema: Any) -> str | None:
    """The grammar of a response format (None: free text)."""
    if kind == "json_object":
        return grammar.json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        grammar.check_patterns(schema, "response_format")
        return grammar.json_schema_grammar(schema, "response_format")
    if kind:
        raise BadRequest(f"response_format.type {kind!r} is not implemented: text, json_object or json_schema",
                         param="response_format.type")
    return None


def _schema(req: gen.Request) -> Any:
    if not req.schema:
        return {}
    try:
        return json.loads(req.schema)
    except (ValueError, RecursionError):
        raise BadRequest("response_format.json_schema.schema is not JSON", param="response_format") from None


def _check_fits(req: gen.Request, tools: ToolSpec | None, max_tokens: int, max_token_chars: int, key: str) -> None:
    """A schema (of the response, or of a forced tool call) whose shortest answer max_tokens
    cannot hold is a 400, not a generation that runs to max_tokens and ends unfinished
    (``minItems: 1000000000`` cost a minute of CPU)."""
    if tools is not None and tools.choice in ("required", "function"):
        chosen = [t["function"].get("parameters", {}) for t in tools.tools
                  if tools.choice == "required" or t["function"]["name"] == tools.name]
        grammar.check_fits({"anyOf": chosen}, "tools", max_tokens, max_token_chars, key)
        return
    if req.response_format == "json_schema":
        grammar.check_fits(_schema(req), "response_format", max_tokens, max_token_chars, key)


def _prompt_specs(body: dict) -> tuple[gen.Prompt, ...]:
    """A completion's prompts: a string, a list of strings, token ids, or lists of token ids."""
    prompt = body.get("prompt")
    need = "prompt is required: a string, a list of strings, a list of token ids or a list of such lists"
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(need, param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str) and p:
            out.append(gen.Prompt(text=p))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < 2**31 for t in p):
                raise BadRequest("prompt token ids must be token ids of this model", param="prompt")
            out.append(gen.Prompt(ids=tuple(p), given_ids=1))
        else:
            raise BadRequest(need, param="prompt")
    return tuple(out)


def _prompts(req: gen.Request, tokenizer: MeshTokenizer) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """The prompts' token ids (a text's with BOS where the model wants one) and texts (for echo)."""
    if not req.prompts or len(req.prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompt is required: at most {MAX_PROMPTS} prompts", param="prompt")
    out, texts = [], []
    for p in req.prompts:
        if p.given_ids:
            if not p.ids or not all(0 <= t < tokenizer.vocab_size for t in p.ids):
                raise BadRequest(f"prompt token ids must be within [0, {tokenizer.vocab_size})", param="prompt")
            out.append(p.ids)
            texts.append(tokenizer.decode(list(p.ids), skip_special=True))
        elif p.text:
            out.append(tuple(tokenizer.encode_prompt(p.text)))
            texts.append(p.text)
        else:
            raise BadRequest("a prompt is empty", param="prompt")
    return tuple(out), tuple(texts)


def _logit_bias(body: dict) -> tuple[gen.Bias, ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise BadRequest("logit_bias must be an object of at most 1024 token ids", param="logit_bias")
    out = []
    for key, value in bias.items():
        # ASCII digits only: "²".isdigit(), and int() refuses it (and past 4300 digits)
        if not (key.isascii() and key.isdigit()) or len(key) > 9:
            raise BadRequest(f"logit_bias key {key!r} is not a token id of this model", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest("logit_bias values must be numbers within [-100, 100]", param="logit_bias")
        out.append(gen.Bias(int(key), float(value)))
    return tuple(out)


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        top = body.get("top_logprobs")
        if not _flag(body, "logprobs"):
            if top not in (None, 0):
                raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return int(_number(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True))
    if body.get("logprobs") is None:
        return None
    return int(_number(body, "logprobs", 0, 0, MAX_LOGPROBS_COMPLETIONS, integer=True))


_INT64 = 2**63


def _integer(body: dict, key: str, default: int) -> int:
    """An integer field whose bounds only the supernode knows (the context, the vocabulary):
    its type here, its range there. One past 64 bits travels as the largest (its range check
    then refuses it)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer", param=key)
    return max(-_INT64, min(_INT64 - 1, value))


N = TypeVar("N", int, float)


def _in_range(value: N, key: str, lo: float, hi: float, lo_open: bool = False) -> N:
    if not lo <= value <= hi or (lo_open and value == lo):  # (NaN too: JSON may carry it)
        low = f"> {lo}" if lo_open else f">= {lo}"
        raise BadRequest(f"{key} must be {low} and <= {hi}, got {value}", param=key)
    return value


def read_request(body: Any, *, chat: bool, model: str) -> gen.Generate:
    """A client's completion as the mesh carries it: every field the API implements read
    and checked here, at the edge of the peer the client came to, in all that needs no
    tokenizer; ``prepare`` on the supernode does the rest. ``model``: the one this peer
    serves. The client's own ``meshd_resume`` / ``meshd_finished`` become the typed history."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    bad = find_surrogate(body)
    if bad is not None:
        raise BadRequest(f"{bad} holds a lone UTF-16 surrogate (\\ud800-\\udfff escape): not valid Unicode", param=bad)
    check_fields(body, chat)
    asked = body.get("model")
    if asked is not None and asked != model:
        raise BadRequest(f"model {asked!r} is not served here; this mesh serves {model!r}", status=404, param="model")
    stream = _flag(body, "stream")
    messages: tuple[gen.Turn, ...] = ()
    prompts: tuple[gen.Prompt, ...] = ()
    tools: tuple[gen.Tool, ...] = ()
    choice, name, parallel, response_format, schema = "", "", False, "", ""
    if chat:
        messages = tuple(_turn(m) for m in _chat_messages(body))
        tools, choice, name, parallel = _tool_defs(body)
        response_format, schema = _response_format(body)
        if choice not in ("", "none") and response_format:
            raise BadRequest("response_format with tools is not implemented: use one or the other",
                             param="response_format")
        if choice in ("required", "function"):
            grammar.check_patterns([json.loads(t.parameters) for t in tools if choice == "required" or t.name == name],
                                   "tools")
    else:
        prompts = _prompt_specs(body)
        if body.get("suffix") not in (None, ""):
            raise BadRequest("suffix is not implemented by meshd", param="suffix")
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    if not chat and body.get("best_of") not in (None, n):
        raise BadRequest("best_of is not implemented by meshd (only best_of = n)", param="best_of")
    choices = (1 if chat else len(prompts)) * n
    if choices > MAX_OUTPUTS:
        raise BadRequest(f"prompts x n must be at most {MAX_OUTPUTS}", param="n")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    echo = not chat and _flag(body, "echo")
    resume, finished = _resumes(body, choices)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed must be an integer", param="seed")
    logprobs = _logprobs(body, chat)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise BadRequest("stream_options must be an object with include_usage", param="stream_options")
    priority = body.get("meshd_priority", "interactive")
    if priority not in ("interactive", "batch"):
        raise BadRequest('meshd_priority must be "interactive" or "batch"', param="meshd_priority")
    request = gen.Request(
        int(chat), asked or "", messages, prompts, tools, choice, name, int(parallel), response_format, schema,
        n=n, stream=int(stream), echo=int(echo), include_usage=int(bool(options.get("include_usage")) and stream),
        max_tokens=_integer(body, key, 0), max_tokens_given=int(body.get(key) is not None), max_tokens_key=key,
        top_k=_integer(body, "top_k", 0),
        **{name: float(_number(body, name, r.default, r.lo, r.hi, lo_open=r.lo_open))
           for name, r in SAMPLING_NUMBERS.items()},
        # any integer is a seed: one past 64 bits travels as its value modulo 2^64
        seed=(seed + _INT64) % (2 * _INT64) - _INT64 if seed is not None else 0, seeded=int(seed is not None),
        stop=_stops(body), logit_bias=_logit_bias(body), logprobs=logprobs or 0, logprobs_on=int(logprobs is not None),
        min_tokens=_integer(body, "min_tokens", 0), ignore_eos=int(_flag(body, "ignore_eos")),
        batch=int(priority == "batch"))
    return gen.Generate(request, tuple(gen.History(ids) for ids in resume), tuple(sorted(finished)))


def prepare(msg: gen.Generate, *, model: str, tokenizer: MeshTokenizer, context: int,
            max_tokens_limit: int) -> CompletionRequest:
    """A request read at an edge (this peer's, or a member's over the link), made ready to
    run: its prompts tokenized (a chat through the template), and every value checked
    that needs the supernode's tokenizer, context or template, or that a peer could have
    sent out of bounds."""
    req = msg.request
    chat = bool(req.chat)
    if req.model and req.model != model:
        raise BadRequest(f"model {req.model!r} is not served here; this mesh serves {model!r}", status=404,
                         param="model")
    tools = None
    grammar_text: str | None = None
    texts: tuple[str, ...] = ()
    if chat:
        if not tokenizer.template.available:
            raise BadRequest(NO_TEMPLATE, code="chat_template_missing")
        messages = _chat_messages({"messages": [_turn_dict(t) for t in req.messages]})  # as a client's are checked
        tools = _tools(req, tokenizer.template)
        grammar_text = _format_grammar(req.response_format, _schema(req))
        if tools is not None and grammar_text is not None and tools.choice != "none":
            raise BadRequest("response_format with tools is not implemented: use one or the other",
                             param="response_format")
        if tools is not None and tools.choice in ("required", "function"):
            chosen = [t for t in tools.tools if tools.choice == "required" or t["function"]["name"] == tools.name]
            special = tokenizer.token_id(toolcalls._MISTRAL_TAG) if tools.fmt == toolcalls.MISTRAL else None
            grammar.check_patterns([t["function"].get("parameters", {}) for t in chosen], "tools")
            try:
                grammar_text = toolcalls.call_grammar(tools.fmt, chosen, tools.parallel and tools.choice == "required",
                                                      special)
            except (ValueError, TypeError) as exc:
                raise BadRequest(f"tools: a parameters schema is not usable: {exc}", param="tools") from None
        if grammar_text is not None:  # built here, off the event loop; a generation copies it
            grammar.check_grammar(grammar_text, "tools" if tools is not None else "response_format", tokenizer)
        prompts: tuple[tuple[int, ...], ...] = (tuple(_chat_ids(tokenizer, messages, tools, context)),)
    else:
        if req.response_format or req.tools:
            raise BadRequest("a completion takes no grammar or tools", param="prompt")
        prompts, texts = _prompts(req, tokenizer)
    n = _in_range(req.n, "n", 1, MAX_CHOICES)
    if len(prompts) * n > MAX_OUTPUTS:
        raise BadRequest(f"prompts x n must be at most {MAX_OUTPUTS}", param="n")
    key = req.max_tokens_key if req.max_tokens_key in ("max_tokens", "max_completion_tokens") else "max_tokens"
    given = bool(req.max_tokens_given)
    longest = max(len(p) for p in prompts)
    where = "messages" if chat else "prompt"
    if longest >= context:
        raise BadRequest(f"this model's context is {context} tokens; the {where} has {longest}",
                         param=where, code="context_length_exceeded")
    echo = not chat and bool(req.echo)
    # 0 with echo: the prompt alone (with its logprobs where asked), as OpenAI's legacy
    # completions and vLLM answer it
    max_tokens = _in_range(req.max_tokens if given else context - longest, key, 0 if echo else 1,
                           max(max_tokens_limit, context))
    if given and max_tokens > max_tokens_limit:
        raise BadRequest(f"{key} must be <= {max_tokens_limit}, got {max_tokens}", param=key)
    if longest + max_tokens > context:
        raise BadRequest(
            f"this model's context is {context} tokens; the {where} has {longest} and {key} asks {max_tokens} more",
            param=key, code="context_length_exceeded")
    if grammar_text is not None:
        _check_fits(req, tools, max_tokens, tokenizer.max_token_chars, key)
    resumes, finished = _history(tuple(h.token_ids for h in msg.resume), msg.finished, len(prompts) * n,
                                 tokenizer.vocab_size, context)
    resume = any(resumes) or finished
    limit = MAX_TOP_LOGPROBS if chat else MAX_LOGPROBS_COMPLETIONS
    logprobs = _in_range(req.logprobs, "top_logprobs" if chat else "logprobs", 0, limit) if req.logprobs_on else None
    min_tokens = _in_range(req.min_tokens, "min_tokens", 0, context)
    if min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({min_tokens}) must not exceed {key} ({max_tokens})", param="min_tokens")
    if len(req.stop) > MAX_STOPS or not all(req.stop):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS}", param="stop")
    if len(req.logit_bias) > 1024 or not all(0 <= b.token < tokenizer.vocab_size and -100 <= b.value <= 100
                                              for b in req.logit_bias):
        bad = next((b.token for b in req.logit_bias if not 0 <= b.token < tokenizer.vocab_size), None)
        raise BadRequest(f"logit_bias key {str(bad)!r} is not a token id of this model" if bad is not None else
                         "logit_bias must hold at most 1024 token ids, values within [-100, 100]", param="logit_bias")
    numbers = {name: getattr(req, name) for name in SAMPLING_NUMBERS}
    for name, r in SAMPLING_NUMBERS.items():  # as read_request holds a client's to them; a peer could send others
        _in_range(numbers[name], name, r.lo, r.hi, r.lo_open)
    params = SamplingParams(
        seed=req.seed if req.seeded else None, max_tokens=max_tokens, stop=req.stop,
        top_k=max(0, _in_range(req.top_k, "top_k", -1, tokenizer.vocab_size)),  # -1: off (vLLM's)
        **numbers,
        logit_bias=tuple((b.token, b.value) for b in req.logit_bias),
        logprobs=logprobs,
        grammar=grammar_text,
        min_tokens=min_tokens,
        ignore_eos=bool(req.ignore_eos),
        # a resubmission's client has its echo (and the prompt's logprobs) already
        prompt_logprobs=logprobs if echo and not resume else None,
    )
    return CompletionRequest(chat, model, prompts, params, n, bool(req.stream), resumes, finished,
                             bool(req.include_usage) and bool(req.stream), echo, given, context, tools, texts,
                             Priority.BATCH if req.batch else Priority.INTERACTIVE)


def request_chars(req: gen.Request) -> int:
    """Characters of the text a request has tokenized (``guards.prompt_chars`` of its body)."""
    return sum(len(p.text) for p in req.prompts) + sum(len(t.content) for t in req.messages)


def _turn(m: dict) -> gen.Turn:
    """A checked chat message (``_chat_messages``) as the mesh carries it."""
    calls = m.get("tool_calls")
    return gen.Turn(m["role"], m["content"] or "", int(m["content"] is None), m.get("name", ""), int("name" in m),
                    tuple(gen.Call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls or ()),
                    int(calls is not None), m.get("tool_call_id", ""))


def _turn_dict(t: gen.Turn) -> dict:
    """A carried chat message as a client would have sent it (checked again as one)."""
    m: dict[str, Any] = {"role": t.role, "content": None if t.no_content else t.content}
    if t.named:
        m["name"] = t.name
    if t.calls:
        m["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in t.tool_calls]
    if t.role == "tool":
        m["tool_call_id"] = t.tool_call_id
    return m


def _resumes(body: dict, choices: int) -> tuple[tuple[tuple[int, ...], ...], frozenset[int]]:
    """meshd's resumption fields, a client's own: ``meshd_resume``, the tokens each choice
    already has (one list of ids for a single choice, or one list per choice), and
    ``meshd_finished``, the choices already whole, which are not run again. Their ids are
    checked against the vocabulary on the supernode (``_history``)."""
    def ids(v: object) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                           for t in v)

    raw = body.get("meshd_resume") or []
    if ids(raw) and (choices == 1 or not raw):
        resumes: tuple[tuple[int, ...], ...] = (tuple(raw),) if raw else ()
    elif isinstance(raw, list) and len(raw) == choices and all(ids(v) for v in raw):
        resumes = tuple(tuple(v) for v in raw)
    else:
        raise BadRequest(f"meshd_resume must be a list of token ids, or one such list for each of the {choices} "
                         "choices", param="meshd_resume")
    done = body.get("meshd_finished") or []
    if (not isinstance(done, list) or len(set(done)) != len(done) or len(done) >= choices
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < choices for i in done)):
        raise BadRequest(f"meshd_finished must list distinct choice indices below {choices}, leaving one to run",
                         param="meshd_finished")
    return resumes, frozenset(done)


def _history(resume: tuple[tuple[int, ...], ...], finished: tuple[int, ...], choices: int,
             vocab_size: int, context: int) -> tuple[tuple[tuple[int, ...], ...], frozenset[int]]:
    """Each choice's tokens so far and the choices already whole (the client's own, or a
    resubmission's): at most one history per choice, token ids of this model, and the
    choices already whole distinct, leaving one to run."""
    if len(resume) > choices or not all(len(ids) < context and all(0 <= t < vocab_size for t in ids)
                                        for ids in resume):
        raise BadRequest(f"meshd_resume must hold token ids of this model (below {vocab_size}), fewer than the "
                         f"context's {context} in a list, at most one list for each of the {choices} choices",
                         param="meshd_resume")
    if len(set(finished)) != len(finished) or len(finished) >= choices or not all(i < choices for i in finished):
        raise BadRequest(f"meshd_finished must list distinct choice indices below {choices}, leaving one to run",
                         param="meshd_finished")
    return (resume if any(resume) else ()), frozenset(finished)


def tokenize_chat(body: dict, tokenizer: MeshTokenizer, context: int) -> list[int]:
    """/tokenize's ``messages``: the prompt ids a chat of them would have (no check against
    the context: /tokenize is how a client finds out how long a prompt is)."""
    if not tokenizer.template.available:
        raise BadRequest(NO_TEMPLATE, code="chat_template_missing")
    return _chat_ids(tokenizer, _chat_messages(body), None, context)


def _chat_ids(tokenizer: MeshTokenizer, messages: list[dict], tools: ToolSpec | None, context: int) -> list[int]:
    """A chat's prompt ids, or BadRequest: the template refuses these messages (say, a system
    turn for Gemma), it passed a render bound (shards/template_sandbox.py: the error's code
    names it), or it rendered nothing. The rendered text is bounded as a prompt is
    (guards.check_prompt_size): more than the context could hold is refused, not tokenized."""
    try:
        ids = _encode_chat(tokenizer, messages, tools, context * tokenizer.max_token_chars)
    except TemplateLimit as exc:
        raise BadRequest(str(exc), param="messages", code=exc.limit) from None
    except WorkerUnavailable:
        raise  # this peer's fault, not the request's: a 500
    except ModelError as exc:
        raise BadRequest(str(exc), param="messages") from None
    if not ids:
        raise BadRequest("the chat template rendered these messages as an empty prompt", param="messages")
    return ids


def _encode_chat(tokenizer: MeshTokenizer, messages: list[dict], tools: ToolSpec | None, max_chars: int) -> list[int]:
    """The chat's prompt through the model's own template; tools through it where it reads
    them, else described by meshd in the fallback (Hermes) format. ``max_chars``: the most
    text the template may render."""
    defs = list(tools.tools) if tools is not None else None
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if tokenizer.template.supports_tools or not (defs or has_tool_turns):
        return tokenizer.encode_chat(messages, tools=defs, max_chars=max_chars)
    plain = toolcalls.fallback_messages(messages, defs)
    return tokenizer.encode_chat([{"role": m["role"], "content": m.get("content") or ""} for m in plain],
                                 max_chars=max_chars)


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def completion_json(chat: bool, cid: str, model: str | None, choices: list[dict], usage: dict | None,
                    fingerprint: str | None = None) -> dict:
    return {
        "id": cid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage,
    }


class MeshCode(StrEnum):
    """The error codes an entry peer acts on in the supernode's answer, read once into this
    enum (``of``) and compared as members, never as text."""

    # A 503 that an entry peer answers by asking the next supernode (this one yielded or
    # stops); a client that gets it (it came straight here) retries elsewhere.
    SUPERNODE_CHANGED = "supernode_changed"
    # Nothing can serve the request now (a full KV budget, no plan): the client gets the 503.
    MESH_UNAVAILABLE = "mesh_unavailable"

    @classmethod
    def of(cls, value: object) -> MeshCode | None:
        """The member ``value`` names; None for any other code (or none)."""
        try:
            return cls(value) if isinstance(value, str) else None
        except ValueError:
            return None


class Assembler:
    """A whole answer put together from stream chunks (the supernode's own, or a proxied stream)."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.parts: dict[int, dict] = {}
        self.usage: dict | None = None
        self.model: str | None = None
        self.fingerprint: str | None = None

    def add(self, data: dict) -> None:
        self.model = data.get("model", self.model)
        self.fingerprint = data.get("system_fingerprint", self.fingerprint)
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices") or ():
            i = choice.get("index", 0)
            if not isinstance(i, int) or not 0 <= i < MAX_OUTPUTS:
                continue
            part = self.parts.setdefault(i, {"text": [], "ids": [], "calls": {}, "lp": None, "finish": None})
            part["ids"].extend(choice.get("token_ids") or ())
            delta = choice.get("delta") or {}
            piece = delta.get("content") if self.chat else choice.get("text")
            if piece:
                part["text"].append(piece)
            for call in delta.get("tool_calls") or ():
                slot = part["calls"].setdefault(call.get("index", 0), {"id": "", "type": "function",
                                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            lp = choice.get("logprobs")
            if lp:
                if part["lp"] is None:
                    part["lp"] = {"content": [], "refusal": None} if self.chat else \
                        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for key, values in lp.items():
                    if isinstance(values, list):
                        part["lp"][key].extend(values)
            if choice.get("finish_reason"):
                part["finish"] = choice["finish_reason"]

    @property
    def first_ids(self) -> list[int]:
        return self.parts[0]["ids"] if 0 in self.parts else []

    @property
    def first_text(self) -> str:
        return "".join(self.parts[0]["text"]) if 0 in self.parts else ""

    def choices(self) -> list[dict]:
        out = []
        for i in sorted(self.parts):
            p = self.parts[i]
            text = "".join(p["text"])
            if self.chat:
                calls = [p["calls"][k] for k in sorted(p["calls"])]
                message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None,
                                           "refusal": None}
                if calls:
                    message["tool_calls"] = calls
                out.append({"index": i, "message": message, "logprobs": p["lp"], "finish_reason": p["finish"],
                            "token_ids": p["ids"]})
            else:
                out.append({"index": i, "text": text, "logprobs": p["lp"], "finish_reason": p["finish"],
                            "token_ids": p["ids"]})
        return out

    def whole(self, cid: str) -> dict:
        return completion_json(self.chat, cid, self.model, self.choices(), self.usage, self.fingerprint)


def error_json(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape, as a body or as an event of a stream that fails."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    code = code or {404: "model_not_found" if param == "model" else "not_found", 409: "conflict",
                    413: "request_too_large", 503: MeshCode.MESH_UNAVAILABLE, 507: "storage_full"}.get(status)
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

