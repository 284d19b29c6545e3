"""A completion between the peer a client talks to (the entry peer) and the supernode,
as typed frames: OpenAI's JSON and server-sent events exist only at the HTTP edge of
the entry peer (``meshd.serving.edge``), never inside the mesh.

The entry peer sends one ``Generate``; the supernode answers with a stream of frames:
``Begin``, then ``Delta`` per choice as tokens come (``Keepalive`` while none do), then
``Usage`` and ``End``; or a ``Failure`` at any point, whose ``act`` says what the entry
peer does (give it to the client, or ask the next supernode). An answer without ``End``
or ``Failure`` was cut off. The frames ride the sealed link's API tunnel one after the
other, each behind its length (``frame`` / ``read_frames``), encoded by ``protocol.codec``
like any wire message (the same bounds and checks on the way in).

The request's content (prompt or messages, sampling fields, tools, response format)
travels as the client's JSON body: it is read once, by the supernode, with its
tokenizer and chat template, which no other peer holds. Everything the mesh itself
decides (each choice's history on a resubmission, the choices already whole) is typed.
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
class Generate:
    tag: ClassVar[str] = "gen"
    chat: int = field(metadata=FLAG)
    body: bytes  # the client's request, as JSON: the supernode validates and tokenizes it
    # On a resubmission: each choice's history (one entry per choice, in order), and
    # the choices already whole, which the next supernode does not run again.
    resume: tuple[History, ...] = ()
    finished: tuple[int, ...] = ()
    resumed: int = field(default=0, metadata=FLAG)  # 1: ``resume`` stands, whatever the body says


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
