"""Wire messages between peers: frozen, slotted dataclasses and one union.

Schema evolution follows msgspec's rules: a new field always gets a default,
no field ever changes type, and decoders ignore keys they do not know. Each
type's wire tag is its ``tag`` class variable; ``protocol.codec`` is the only
place that turns these into bytes and back, and it reads each message's fields
(names, types, defaults) from the class itself: this file is the one place a
message's fields are listed. A field's ``metadata`` may bound it (``max``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, NewType

from .span import Span

NodeId = NewType("NodeId", str)
SessionId = NewType("SessionId", str)
# A model's name: a plain name (it becomes a directory under the state dir), never a
# path; the codec refuses ``../x``, ``a/b``, ``.hidden`` and control characters.
ModelName = NewType("ModelName", str)
Digest = NewType("Digest", str)  # a sha256, 64 lowercase hex digits

# 2: the Noise handshake (Hello inside it, no Auth), frames sealed, the API tunnel.
# 3: completions through the tunnel as ``protocol.generate`` frames, not OpenAI's HTTP.
PROTOCOL_VERSION = 3

# Terms grow by one per re-plan, so no honest term comes near this; the bound keeps
# ``term + 1`` (and a term a Reject names) encodable as msgpack's uint64 everywhere.
MAX_TERM = 2**62
TERM = {"max": MAX_TERM}
MAX_POSITION = 2**31  # a session position (a segment's start)
MAX_MEMORY = 2**56  # bytes of memory a peer may say it uses
NO_CHAT = "none"  # Plan.chat_template of a supernode that has no chat template
MAX_ORIGIN = 256  # Plan.chat_template's length
MAX_CALL_S = 3600.0  # the most seconds a stage may say one call took


# -- nested structures (not frames of their own) ---------------------------------


# A tensor's element type by wire name, and its size in bytes. bfloat16 travels as raw
# 2-byte words; byte order is little-endian, as on every host torch runs on.
WIRE_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1,
                               "uint8": 1}


@dataclass(frozen=True, slots=True, eq=False)
class WireTensor:
    """A tensor as it travels: its dtype's wire name, its shape, and its elements' bytes in
    row-major order. The codec checks that the three agree; the side that owns tensors turns
    one into a tensor and back (``shards.wire``), so this layer needs no torch."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Measured:
    """What one model's real parts cost on a peer, ms per decode step (0: not measured):
    a layer and the head (final norm, lm_head, picking the token) at one row and at
    ``batch`` rows. Placement balances stages on these rather than on the synthetic probe."""

    model: str = ""  # the model's name these figures are of
    layer_ms: float = 0.0
    layer_ms_batch: float = 0.0
    head_ms: float = 0.0
    head_ms_batch: float = 0.0
    batch: int = field(default=1, metadata={"max": 4096})

    def has_layers(self, model: str) -> bool:
        """Whether this times ``model``'s layers (a stage that holds no head times no head)."""
        return self.model == model and min(self.layer_ms, self.layer_ms_batch) > 0

    def has_head(self, model: str) -> bool:
        return self.model == model and min(self.head_ms, self.head_ms_batch) > 0


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a peer offers, sent inside its Hello."""

    vram: int  # bytes of accelerator memory, 0 on a CPU box
    ram: int  # bytes of host memory
    device: str  # "cuda" | "mps" | "cpu"
    api_port: int = field(metadata={"max": 65535})  # its HTTP API (also serves shard files to peers)
    mem_budget: int  # bytes it will spend on layers
    layer_ms: float  # measured decode time of one layer, ms
    models: tuple[ModelName, ...] = ()  # models it has complete locally
    measured: Measured = Measured()  # its configured model's real parts, timed (an older peer sends none)


@dataclass(frozen=True, slots=True)
class Assignment:
    """One stage of a plan: ``node`` runs layers ``span``."""

    node: NodeId
    span: Span


# -- handshake and liveness ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """Who a peer is: sent only inside the Noise handshake (encrypted), see meshd/control/secure.py."""

    tag: ClassVar[str] = "hello"
    version: int
    node_id: NodeId
    mesh: str
    name: str
    caps: Capabilities
    plaintext: int = field(default=0, metadata={"max": 1})  # 1: this peer runs --debug-plaintext-links


@dataclass(frozen=True, slots=True)
class Ping:
    tag: ClassVar[str] = "ping"
    seq: int
    sent: float  # sender's monotonic clock, echoed back in Pong


@dataclass(frozen=True, slots=True)
class Pong:
    tag: ClassVar[str] = "pong"
    seq: int
    sent: float
    # The answering peer's resident memory now, bytes (0: an older peer, not known): every
    # peer's /status shows it beside the total of its Hello, fresh to a heartbeat.
    ram_used: int = field(default=0, metadata={"max": MAX_MEMORY})


@dataclass(frozen=True, slots=True)
class Bye:
    tag: ClassVar[str] = "bye"
    reason: str


@dataclass(frozen=True, slots=True)
class Leaving:
    """The sender is stopping: leave it out of the election from now on. It stays linked
    while it hands its work on (a supernode's sessions go on at the one elected without
    it, at once, not after it is gone), then says Bye."""

    tag: ClassVar[str] = "leaving"
    reason: str


# -- plan negotiation ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    tag: ClassVar[str] = "plan"
    term: int = field(metadata=TERM)
    supernode: NodeId
    model: ModelName
    manifest_digest: Digest  # sha256 of manifest.json, so every peer loads the same model
    assignments: tuple[Assignment, ...]  # in layer order
    sources: tuple[NodeId, ...] = ()  # peers that hold the full model, to fetch from
    # Where the supernode's chat template comes from ("model", a built-in name, "file:NAME",
    # "chatml-fallback"), NO_CHAT when it has none: members answer /v1/models with it. ""
    # from an older supernode: not known.
    chat_template: str = ""


@dataclass(frozen=True, slots=True)
class Accept:
    tag: ClassVar[str] = "accept"
    term: int = field(metadata=TERM)
    span: Span
    # Its span's real layer, timed once loaded, where its Hello had no timing of this model
    # (it fetched the weights since): the supernode may rebalance on it.
    measured: Measured = Measured()


class RejectCode(IntEnum):
    """Why a peer rejects a plan, for the supernode to act on (the reason text is for people)."""

    OTHER = 0  # see the reason; also what a Reject from a peer that sends no code reads as
    NOT_MY_SUPERNODE = 1  # its view lags: ask again shortly
    STALE_TERM = 2  # it holds a higher term (``held_term``): ask again above it
    CANNOT_LOAD = 3  # it could not load (or fetch) its span

    @classmethod
    def _missing_(cls, value: object) -> RejectCode:
        return cls.OTHER  # a code from a newer peer


@dataclass(frozen=True, slots=True)
class Reject:
    tag: ClassVar[str] = "reject"
    term: int = field(metadata=TERM)
    reason: str
    capacity: int = 0  # bytes it could hold instead, 0 if unknown
    code: RejectCode = RejectCode.OTHER
    held_term: int = field(default=0, metadata=TERM)  # with STALE_TERM: the term this peer holds


@dataclass(frozen=True, slots=True)
class Commit:
    tag: ClassVar[str] = "commit"
    term: int = field(metadata=TERM)


# -- forwarding ------------------------------------------------------------------
# The supernode sends every hop: a ForwardBatch to each stage in turn, answered by
# a ResultBatch (or Fail). Frames with tensors compare by identity (eq=False):
# comparing two tensors with == gives a tensor, not a bool.


@dataclass(frozen=True, slots=True)
class Segment:
    """One session's rows inside a batched frame (nested)."""

    session: SessionId
    start: int = field(metadata={"max": MAX_POSITION})  # position of the segment's first row
    rows: int


@dataclass(frozen=True, slots=True, eq=False)
class ForwardBatch:
    """Many sessions in one frame: ``hidden`` is their rows one after another,
    in ``segments`` order (a decode row per running session, prefill chunks)."""

    tag: ClassVar[str] = "fwdb"
    term: int = field(metadata=TERM)
    req: int  # request number, echoed in ResultBatch / Fail
    segments: tuple[Segment, ...]
    hidden: WireTensor  # [sum(rows), H]
    # 1: a step that gives new sessions their first token; the stage runs it before the
    # decode batches queued there (an older peer ignores it and runs it in turn).
    urgent: int = field(default=0, metadata={"max": 1})


@dataclass(frozen=True, slots=True, eq=False)
class ResultBatch:
    tag: ClassVar[str] = "resb"
    term: int = field(metadata=TERM)
    req: int
    hidden: WireTensor  # [sum(rows), H], same row order
    # The stage's share of the call, for the supernode's request timelines and live figures
    # (an older peer sends neither: its whole call then reads as the hop): the seconds of
    # its forward, and those it waited for its engine (other calls ahead of this one).
    seconds: float = field(default=0.0, metadata={"max": MAX_CALL_S})
    queued: float = field(default=0.0, metadata={"max": MAX_CALL_S})


class FailCode(IntEnum):
    """Why a stage failed a step, for the supernode to act on (the reason text is for people)."""

    OTHER = 0  # see the reason: a new plan, then a replay; also what an older peer's Fail reads as
    KV_FULL = 1  # its caches would pass its own limit: the step's sessions end (no re-plan)

    @classmethod
    def _missing_(cls, value: object) -> FailCode:
        return cls.OTHER  # a code from a newer peer


@dataclass(frozen=True, slots=True)
class Fail:
    tag: ClassVar[str] = "fail"
    term: int = field(metadata=TERM)
    req: int
    reason: str
    code: FailCode = FailCode.OTHER


@dataclass(frozen=True, slots=True)
class Drop:
    """Free a session's KV caches on a stage."""

    tag: ClassVar[str] = "drop"
    term: int = field(metadata=TERM)
    session: SessionId


# -- the API tunnel ---------------------------------------------------------------
# An entry peer hands a client's request to the supernode over the (sealed) link
# rather than over plain HTTP, so prompts and answers never cross the LAN in clear.


@dataclass(frozen=True, slots=True)
class ApiRequest:
    tag: ClassVar[str] = "apireq"
    req: int  # echoed in every ApiReply
    method: str
    path: str
    body: bytes
    authorization: str = ""  # the client's Authorization header: the supernode checks its own keys
    client: str = ""  # who the entry peer serves this for (KV fairness counts per client)
    request_id: str = ""  # the client's x-request-id, for the supernode's logs and its request timeline
    traceparent: str = ""  # W3C trace context: the entry peer's span, the parent of the supernode's


@dataclass(frozen=True, slots=True)
class ApiReply:
    """One piece of the answer: ``status`` on every piece, the body in order, ``end`` on the last."""

    tag: ClassVar[str] = "apirep"
    req: int
    status: int = field(metadata={"max": 599})
    data: bytes
    end: int = field(default=0, metadata={"max": 1})


@dataclass(frozen=True, slots=True)
class ApiCancel:
    """The client went away: stop the request (its sessions are freed)."""

    tag: ClassVar[str] = "apicancel"
    req: int


Message = (Hello | Ping | Pong | Bye | Leaving | Plan | Accept | Reject | Commit | ForwardBatch | ResultBatch | Fail | Drop
           | ApiRequest | ApiReply | ApiCancel)

MESSAGE_TYPES: tuple[type[Message], ...] = Message.__args__
