"""A completion between the peer a client talks to (the entry peer) and the supernode,
as typed frames: OpenAI's JSON and server-sent events exist only at the HTTP edge of
the entry peer (``meshd.serving.openai.read_request`` in, ``meshd.serving.edge`` out),
never inside the mesh.

The entry peer sends one ``Generate``: the client's ``Request`` as its edge read and
checked it (every field that needs no tokenizer), and each choice's history (the
client's own ``meshd_resume``, or a resubmission's) with the choices already whole.
The supernode checks again what a peer could have sent out of bounds, and what needs
its tokenizer, context and chat template (``openai.prepare``). It answers with a stream
of frames: ``Begin``, then ``Delta`` per choice as tokens come (``Keepalive`` while none
do), then ``Usage`` and ``End``; or a ``Failure`` at any point, whose ``act`` says what
the entry peer does (give it to the client, or ask the next supernode). An answer
without ``End`` or ``Failure`` was cut off. The frames ride the sealed link's API
tunnel one after the other, each behind its length (``frame`` / ``read_frames``),
encoded by ``protocol.codec`` like any wire message (the same bounds and checks on the
way in; strings and lists bounded by the frame's size).
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

from .errors import ProtocolError

MAX_STATUS = {"max": 599}
FLAG = {"max": 1}


class Finish(IntEnum):
    """Why a choice ended (NONE: it goes on). Names are OpenAI's finish reasons."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    TOOL_CALLS = 3

    @property
    def reason(self) -> str | None:
        return None if self is Finish.NONE else self.name.lower()

    @classmethod
    def of(cls, reason: str | None) -> Finish:
        return cls.NONE if reason is None else cls[reason.upper()]


class Act(IntEnum):
    """What the entry peer does with a ``Failure``."""

    FAIL = 0  # the client gets it as it is (a 4xx, or a 5xx this supernode would give again)
    MOVED = 1  # this supernode yielded or stops: the next one takes the request on
    UNAVAILABLE = 2  # nothing can serve it now (a full KV budget, no plan): a 503


@dataclass(frozen=True, slots=True)
class History:
    """One choice's tokens so far (a resubmission goes on after them)."""

    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Call:
    """A tool call an assistant turn made (its arguments: JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Turn:
    """One chat message, as the chat template reads it."""

    role: str
    content: str = ""
    no_content: int = field(default=0, metadata=FLAG)  # an assistant turn of tool calls alone (content null)
    name: str = ""
    named: int = field(default=0, metadata=FLAG)
    tool_calls: tuple[Call, ...] = ()
    calls: int = field(default=0, metadata=FLAG)  # ``tool_calls`` given (an empty list too)
    tool_call_id: str = ""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One completion prompt: text, or token ids."""

    text: str = ""
    ids: tuple[int, ...] = ()
    given_ids: int = field(default=0, metadata=FLAG)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: str  # a JSON schema, as JSON text


@dataclass(frozen=True, slots=True)
class Bias:
    token: int
    value: float


# A signed field: the client's number as it came (its range is checked where it is known).
SIGNED = {"min": -2**63, "max": 2**63 - 1}


@dataclass(frozen=True, slots=True)
class Request:
    """A client's completion as the edge of the peer it came to read it: every field
    checked that needs no tokenizer; what does (token ids against the vocabulary, the
    context, the chat template, a grammar against the tokens) the supernode checks."""

    chat: int = field(metadata=FLAG)
    model: str = ""  # as asked ("": any)
    messages: tuple[Turn, ...] = ()
    prompts: tuple[Prompt, ...] = ()
    tools: tuple[Tool, ...] = ()
    tool_choice: str = ""  # none | auto | required | function ("": no tools)
    tool_name: str = ""  # the function tool_choice names
    parallel_tools: int = field(default=0, metadata=FLAG)
    response_format: str = ""  # "" (free text) | json_object | json_schema
    schema: str = ""  # json_schema's schema, as JSON text
    n: int = field(default=1, metadata=SIGNED)
    stream: int = field(default=0, metadata=FLAG)
    echo: int = field(default=0, metadata=FLAG)
    include_usage: int = field(default=0, metadata=FLAG)
    max_tokens: int = field(default=0, metadata=SIGNED)
    max_tokens_given: int = field(default=0, metadata=FLAG)
    max_tokens_key: str = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = field(default=0, metadata=SIGNED)  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = field(default=0, metadata=SIGNED)
    seeded: int = field(default=0, metadata=FLAG)
    stop: tuple[str, ...] = ()
    logit_bias: tuple[Bias, ...] = ()
    logprobs: int = field(default=0, metadata=SIGNED)
    logprobs_on: int = field(default=0, metadata=FLAG)
    min_tokens: int = field(default=0, metadata=SIGNED)
    ignore_eos: int = field(default=0, metadata=FLAG)
    batch: int = field(default=0, metadata=FLAG)  # meshd_priority "batch"


@dataclass(frozen=True, slots=True)
class Generate:
    tag: ClassVar[str] = "gen"
    request: Request
    # Each choice's tokens so far (one entry per choice, in order; the client's own
    # meshd_resume, or the history of a resubmission) and the choices already whole,
    # which the supernode does not run again.
    resume: tuple[History, ...] = ()
    finished: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: int
    text: str
    raw: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability (with its text and bytes), and the most likely ones there.
    ``scored`` 0: the prompt's first token, which nothing scores."""

    token: int
    text: str
    raw: bytes
    logprob: float = 0.0
    top: tuple[TopLogprob, ...] = ()
    scored: int = field(default=1, metadata=FLAG)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class Begin:
    """The answer begins: who made it, and whether its choices carry logprobs."""

    tag: ClassVar[str] = "gbegin"
    model: str
    fingerprint: str
    logprobs: int = field(default=0, metadata=FLAG)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one choice adds: text, the token ids behind it, their logprobs, tool calls
    parsed out of the text, and its finish. The first of a choice may hold the prompt's
    echo and the prompt's logprobs."""

    tag: ClassVar[str] = "gdelta"
    choice: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish: Finish = Finish.NONE


@dataclass(frozen=True, slots=True)
class Usage:
    tag: ClassVar[str] = "gusage"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Failure:
    """The request failed here: OpenAI's error fields, and what the entry peer does."""

    tag: ClassVar[str] = "gfail"
    act: Act
    status: int = field(metadata=MAX_STATUS)
    message: str
    param: str = ""
    code: str = ""


@dataclass(frozen=True, slots=True)
class Keepalive:
    """Nothing to send yet (a long prefill): the supernode is alive."""

    tag: ClassVar[str] = "gkeep"


@dataclass(frozen=True, slots=True)
class End:
    tag: ClassVar[str] = "gend"


Output = Begin | Delta | Usage | Failure | Keepalive | End
OUTPUT_TYPES: tuple[type[Output], ...] = Output.__args__
REQUEST_TYPES: tuple[type[Generate]] = (Generate,)

# -- framing: each frame behind its length (a tunneled body arrives in arbitrary pieces) --

_LENGTH = struct.Struct(">I")
MAX_OUTPUT_FRAME = 16 * 2**20


def frame(encoded: bytes) -> bytes:
    """One encoded frame behind its length."""
    return _LENGTH.pack(len(encoded)) + encoded


async def read_frames(pieces: AsyncIterator[bytes], max_size: int = MAX_OUTPUT_FRAME) -> AsyncIterator[bytes]:
    """The encoded frames of a body that arrives in ``pieces`` (each whole, in order);
    ProtocolError for one longer than ``max_size`` or a body that ends inside one."""
    buf = bytearray()
    async for piece in pieces:
        buf += piece
        while len(buf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf)
            if size > max_size:
                raise ProtocolError(f"a frame of {size} bytes is over the limit of {max_size}")
            if len(buf) < _LENGTH.size + size:
                break
            yield bytes(buf[_LENGTH.size:_LENGTH.size + size])
            del buf[:_LENGTH.size + size]
    if buf:
        raise ProtocolError(f"the body ended inside a frame ({len(buf)} bytes left over)")
