"""Tool calls in the model's own words: which format its family writes them in, the
grammar that forces a call (tool_choice "required" or a named function), and the parser
that turns generated text back into OpenAI ``tool_calls`` (whole, or as a stream goes).

Formats (picked from the chat template's text):
- hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen 2.5/3,
  Hermes, and the fallback for templates that never read ``tools``: then the tools are
  described in a system message and past calls and results written as text, as
  llama.cpp's generic handler does);
- llama3: one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1+), maybe after
  ``<|python_tag|>``;
- mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shards.grammar import json_lark, lark_grammar, lark_string

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG, _MISTRAL_TAG, _MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"


def tool_format(template_source: str | None) -> str:
    src = template_source or ""
    if _MISTRAL_TAG in src:
        return MISTRAL
    if _OPEN in src:
        return HERMES
    if _PYTHON_TAG in src or '"parameters": dictionary of argument name' in src:
        return LLAMA3
    return HERMES


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def json(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call_from(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _json_prefix(text: str):
    """The JSON value at the start of ``text`` (after spaces) and the rest, or (None, text)."""
    stripped = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except (ValueError, RecursionError):  # a model (or a resume) may write brackets past the parser's depth
        return None, text
    return value, stripped[end:]


# -- the fallback prompt (templates that never read ``tools``) --------------------------

def fallback_messages(messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> list[dict]:
    """Messages for a template without tools: the tool list in a system message, past calls
    as ``<tool_call>`` text, results as user turns in ``<tool_response>``."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f"{_OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": _args(c["function"])},
                                          ensure_ascii=False) + f"\n{_CLOSE}" for c in m["tool_calls"])
            m = {"role": "assistant", "content": "\n".join(x for x in (m.get("content") or "", calls) if x)}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = ("You may call these functions:\n<tools>\n" + listing + "\n</tools>\nTo call one, answer\n"
                  f'{_OPEN}\n{{"name": <name>, "arguments": <object>}}\n{_CLOSE}')
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _args(fn: Mapping):
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


# -- forcing a call -------------------------------------------------------------------

def closed(schema):
    """``schema`` with every object that lists its properties and says nothing of others
    closed to others (``additionalProperties: false``), as OpenAI's strict mode reads a
    schema: a forced call holds the parameters the function declares. Left open, a small
    model under the mask tends to invent property after property until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = frozenset({"items", "anyOf", "oneOf", "allOf", "not", "prefixItems", "additionalProperties",
                         "if", "then", "else", "contains"})


def call_grammar(fmt: str, tools: Sequence[Mapping], parallel: bool, special_id=None) -> str:
    """A grammar whose every sentence is one call (or several, if ``parallel``) of one of
    ``tools`` (OpenAI function definitions), in ``fmt``, the arguments matching each schema."""
    args_key = "parameters" if fmt == LLAMA3 else "arguments"
    rules = []
    for i, t in enumerate(tools):
        fn = t["function"]
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                                   args_key: closed(fn.get("parameters") or {"type": "object"})},
                  "required": ["name", args_key], "additionalProperties": False}
        rules.append(f"fn{i}: {json_lark(schema)}")
    alts = " | ".join(f"fn{i}" for i in range(len(tools)))
    if fmt == HERMES:
        head = f"call: {lark_string(_OPEN + chr(10))} ({alts}) {lark_string(chr(10) + _CLOSE)}"
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    elif fmt == MISTRAL:
        tag = f"<[{special_id}]>" if special_id is not None else lark_string(_MISTRAL_TAG)
        head = f"call: {alts}"
        start = f'start: {tag} "[" call ("," call)* "]"' if parallel else f'start: {tag} "[" call "]"'
    else:  # llama3: one object
        head = f"call: {alts}"
        start = "start: call"
    return lark_grammar("\n".join([start, head, *rules]))


# -- reading calls back ---------------------------------------------------------------

class CallParser:
    """Splits generated text into content and tool calls, as it streams: ``push`` gives
    the text that is surely content and the calls completed so far; ``end`` the rest."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.buf = ""
        self.calls = 0
        self.capturing = False
        self.plain = False  # llama3/mistral: the answer did not start as a call

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        if self.fmt == HERMES:
            return self._hermes(final=False)
        return self._whole(final=False)

    def end(self) -> tuple[str, list[ToolCall]]:
        if self.fmt == HERMES:
            return self._hermes(final=True)
        return self._whole(final=True)

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            if not self.capturing:
                at = self.buf.find(_OPEN)
                if at < 0:
                    keep = 0 if final else _partial(self.buf, _OPEN)
                    content.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.buf[:at])
                self.buf, self.capturing = self.buf[at + len(_OPEN):], True
            close = self.buf.find(_CLOSE)
            body = self.buf if close < 0 else self.buf[:close]
            if close < 0 and not final:
                break
            value, _ = _json_prefix(body)
            call = _call_from(value, "arguments")
            if call is None:  # not a call after all: give it back as text
                content.append(_OPEN + body + (_CLOSE if close >= 0 else ""))
            else:
                calls.append(call)
            self.buf = "" if close < 0 else self.buf[close + len(_CLOSE):]
            self.capturing = False
            if close < 0:
                break
        self.calls += len(calls)
        return "".join(content), calls

    def _whole(self, final: bool) -> tuple[str, list[ToolCall]]:
        """llama3/mistral: a call is the whole answer, told by how it starts."""
        head = self.buf.lstrip()
        if self.plain:
            text, self.buf = self.buf, ""
            return text, []
        if not self.capturing:
            if not head:
                return "", []
            marks = (_PYTHON_TAG, "{") if self.fmt == LLAMA3 else (_MISTRAL_TAG,)
            if any(head.startswith(m) or m.startswith(head) for m in marks):
                self.capturing = True
            else:
                text, self.buf, self.plain = self.buf, "", True
                return text, []
        if not final:
            return "", []
        text, self.buf = self.buf, ""
        calls = self._read_calls(text.lstrip())
        if calls is None:
            return text, []
        self.calls += len(calls)
        return "", calls

    def _read_calls(self, text: str) -> list[ToolCall] | None:
        if self.fmt == LLAMA3:
            text = text.removeprefix(_PYTHON_TAG)
            calls = []
            for part in text.split(";"):  # several calls come separated by ";"
                value, rest = _json_prefix(part)
                call = _call_from(value, "parameters")
                if call is None or rest.strip():
                    return None
                calls.append(call)
            return calls
        text = text.removeprefix(_MISTRAL_TAG)
        value, rest = _json_prefix(text)
        if isinstance(value, list) and not rest.strip():
            found = [c for v in value if (c := _call_from(v, "arguments")) is not None]
            return found if found and len(found) == len(value) else None  # every item a call, or none
        calls = []  # v11: name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in text.split(_MISTRAL_TAG):
            name, sep, args = part.partition(_MISTRAL_ARGS)
            value, rest = _json_prefix(args)
            if not sep or not isinstance(value, dict) or rest.strip():
                return None
            calls.append(ToolCall(name.strip(), json.dumps(value, ensure_ascii=False), new_call_id()))
        return calls or None


def _partial(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_calls(fmt: str, text: str) -> tuple[str, list[ToolCall]]:
    """Content and calls of a whole answer."""
    parser = CallParser(fmt)
    a, calls = parser.push(text)
    b, more = parser.end()
    return a + b, calls + more
