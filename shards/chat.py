"""Chat prompts: the model's own Jinja chat template, rendered in a sandbox.

Templates come with the model file, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` with what transformers' ``apply_chat_template`` gives
them, so that a template renders here as it does there: ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the special tokens (``bos_token``,
``eos_token`` ...), ``raise_exception``, ``strftime_now``, a ``tojson`` that does not
escape HTML, loop controls, and any extra variable a caller passes (``enable_thinking``).

Which template (``pick_template``): one the operator gives (``--chat-template``, a built-in
name or a file: shards/chat_templates.py) over the model's own; a model without one gets
ChatML only where its vocabulary has ChatML's markers as tokens (SmolLM2's does), else it
has none, and a chat is refused rather than rendered in a format the model never saw.

Messages are OpenAI's shapes, made what templates expect by ``template_messages``: a
tool call's ``arguments`` JSON string becomes an object, a null ``content`` an empty text,
other keys whose value is None are dropped, and reasoning is given under each name
templates read it by.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shards import template_sandbox
from shards.chat_templates import CHATML, GivenTemplate
from shards.errors import ModelError

_REASONING = ("reasoning_content", "thinking", "reasoning")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML and sorts keys; prompts want neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that stores no underscore names (no way to CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*`` and ``**`` checked before they run: a string or list made
    longer than the render's output bound, or a power past ``MAX_POW``, is refused rather
    than built (``'x' * 10**10`` would take the worker's memory, ``9**9**9`` its time)."""

    intercepted_binops = frozenset(["*", "**"])
    max_chars = template_sandbox.MAX_RENDER_CHARS

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > self.max_chars:
                    raise template_sandbox.TemplateLimit(
                        f"chat template: a repetition of {len(seq)} x {times} passes the rendered prompt's limit of "
                        f"{self.max_chars} characters", template_sandbox.OUTPUT_LIMIT)
        elif isinstance(right, (int, float)) and abs(right) > template_sandbox.MAX_POW:
            raise template_sandbox.TemplateLimit(
                f"chat template: an exponent of {right} is past its limit of {template_sandbox.MAX_POW}",
                template_sandbox.OUTPUT_LIMIT)
        return super().call_binop(context, operator, left, right)


def _environment(max_chars: int | None = None) -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    if max_chars is not None:
        env.max_chars = max_chars
    env.filters["tojson"] = _tojson
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now,
                    "namespace": _Namespace, "dict": lambda *a, **k: dict(*a, **k)}
    return env


def bounded_environment(max_chars: int) -> ImmutableSandboxedEnvironment:
    """The environment a render worker compiles templates in (shards/template_sandbox.py)."""
    return _environment(max_chars)


def _plain(value):
    """Only JSON types reach a template (no objects with methods the sandbox does not know)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ModelError(f"a chat message holds a {type(value).__name__}, not JSON data")


def template_messages(messages: Sequence[Mapping]) -> list[dict]:
    """OpenAI-shaped messages as chat templates read them.

    system/user/assistant/tool messages with ``content`` a string, None or a list of parts
    (kept as is); an assistant's ``tool_calls`` as ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]`` with ``arguments`` a JSON string (OpenAI) or an
    object; a tool result as ``{"role": "tool", "tool_call_id", "content"}``.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ModelError(f"chat message {i} needs a string role")
        msg = {k: _plain(v) for k, v in m.items() if v is not None}
        if "content" in m and m["content"] is None:  # OpenAI's null beside tool calls: no text (templates read it)
            msg["content"] = ""
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ModelError(f"chat message {i}: each tool call needs a function with a name")
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                except ValueError:
                    raise ModelError(f"chat message {i}: tool call arguments are not JSON") from None
        reasoning = next((msg[k] for k in _REASONING if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
CHATML_FALLBACK = "chatml-fallback"


class ChatTemplate:
    """The template chats render with (``source``; None: none, so no chat), where it came
    from (``origin``: "model", a built-in name, "file:NAME", "chatml-fallback"; None with
    no template), and the special tokens it names."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None,
                 origin: str | None = "model"):
        self.source = source or None
        self.origin = origin if self.source else None
        self.special_tokens = dict(special_tokens or {})
        self._inspected: frozenset[str] | ModelError | None = None

    @property
    def available(self) -> bool:
        return self.source is not None

    @property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its caller; ModelError where it does not
        compile. Found in a render worker (shards/template_sandbox.py): Jinja evaluates
        constant expressions as it compiles, so compiling is running the template's code.
        Found once: a failure is kept too (a template that passes the compile bound would
        cost every chat that bound again)."""
        if not self.source:
            return frozenset()
        if self._inspected is None:
            try:
                self._inspected = template_sandbox.inspect(self.source)
            except template_sandbox.WorkerUnavailable:
                raise  # not the template's doing: tried again next time
            except template_sandbox.TemplateLimit as e:
                self._inspected = e
            except ModelError as e:
                self._inspected = ModelError(f"the chat template ({self.origin}) does not compile: "
                                             f"{str(e).removeprefix('the chat template does not compile: ')}")
        if isinstance(self._inspected, ModelError):
            raise self._inspected.with_traceback(None)  # the same error each time, not a growing traceback
        return self._inspected

    def check(self) -> None:
        """ModelError now, rather than at the first chat, where the template does not compile."""
        self.variables  # noqa: B018 (found once, kept)

    @property
    def supports_tools(self) -> bool:
        """Whether tool definitions reach the prompt (a template that never reads ``tools``
        would silently drop them)."""
        return "tools" in self.variables

    def render(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True, documents: Sequence[Mapping] | None = None,
               max_chars: int | None = None, **extra) -> str:
        """The prompt text, rendered in a worker process within the bounds of
        shards/template_sandbox.py (time, memory, ``max_chars`` of output): a
        TemplateLimit (a ModelError) names the one a render passed."""
        if not self.source:
            raise ModelError("this model has no chat template")
        self.variables  # noqa: B018 (a template that does not compile: ModelError here, as before)
        context = {**self.special_tokens, **_plain(extra), "messages": template_messages(messages),
                   "tools": _plain(tools), "documents": _plain(documents),
                   "add_generation_prompt": add_generation_prompt}
        return template_sandbox.render(self.source, context, max_chars)


def pick_template(own: str | None, given: GivenTemplate | None, has_chatml: bool,
                  special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
    """The template a model's chats render with: the one given (``--chat-template``), else
    the model's own, else ChatML where the vocabulary has ``<|im_start|>`` and ``<|im_end|>``
    as tokens, else none."""
    if given is not None:
        return ChatTemplate(given.source, special_tokens, given.origin)
    if own:
        return ChatTemplate(own, special_tokens, "model")
    if has_chatml:
        return ChatTemplate(CHATML, special_tokens, CHATML_FALLBACK)
    return ChatTemplate(None, special_tokens, None)
