"""Wire messages between peers: frozen, slotted dataclasses and one union.

Schema evolution follows msgspec's rules: a new field always gets a default,
no field ever changes type, and decoders ignore keys they do not know. Each
type's wire tag is its ``tag`` class variable; ``protocol.codec`` is the only
place that turns these into bytes and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NewType

import torch

from shards.span import Span

NodeId = NewType("NodeId", str)
SessionId = NewType("SessionId", str)

PROTOCOL_VERSION = 1


# -- nested structures (not frames of their own) ---------------------------------


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a peer offers, sent inside its Hello."""

    vram: int  # bytes of accelerator memory, 0 on a CPU box
    ram: int  # bytes of host memory
    device: str  # "cuda" | "mps" | "cpu"
    api_port: int  # its HTTP API (also serves shard files to peers)
    mem_budget: int  # bytes it will spend on layers
    layer_ms: float  # measured decode time of one layer, ms
    models: tuple[str, ...] = ()  # models it has complete locally


@dataclass(frozen=True, slots=True)
class Assignment:
    """One stage of a plan: ``node`` runs layers ``span``."""

    node: NodeId
    span: Span


# -- handshake and liveness ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    tag: ClassVar[str] = "hello"
    version: int
    node_id: NodeId
    mesh: str
    name: str
    nonce: bytes  # the challenge the other side must MAC
    caps: Capabilities


@dataclass(frozen=True, slots=True)
class Auth:
    tag: ClassVar[str] = "auth"
    mac: bytes  # HMAC-SHA256 over the peer's nonce, see docs/architecture.md


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


@dataclass(frozen=True, slots=True)
class Bye:
    tag: ClassVar[str] = "bye"
    reason: str


# -- plan negotiation ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    tag: ClassVar[str] = "plan"
    term: int
    supernode: NodeId
    model: str
    manifest_digest: str  # sha256 of manifest.json, so every peer loads the same model
    assignments: tuple[Assignment, ...]  # in layer order
    sources: tuple[NodeId, ...] = ()  # peers that hold the full model, to fetch from


@dataclass(frozen=True, slots=True)
class Accept:
    tag: ClassVar[str] = "accept"
    term: int
    span: Span


@dataclass(frozen=True, slots=True)
class Reject:
    tag: ClassVar[str] = "reject"
    term: int
    reason: str
    capacity: int = 0  # bytes it could hold instead, 0 if unknown


@dataclass(frozen=True, slots=True)
class Commit:
    tag: ClassVar[str] = "commit"
    term: int


# -- forwarding ------------------------------------------------------------------
# These carry tensors, so equality is identity (eq=False): comparing two
# tensors with == gives a tensor, not a bool.


@dataclass(frozen=True, slots=True, eq=False)
class Forward:
    tag: ClassVar[str] = "forward"
    term: int
    session: SessionId
    req: int  # request number, echoed in Result / Fail
    start: int  # position of hidden's first row
    hidden: torch.Tensor  # [T, H]


@dataclass(frozen=True, slots=True, eq=False)
class Result:
    tag: ClassVar[str] = "result"
    term: int
    session: SessionId
    req: int
    hidden: torch.Tensor  # [T, H]


@dataclass(frozen=True, slots=True)
class Fail:
    tag: ClassVar[str] = "fail"
    term: int
    req: int
    reason: str


@dataclass(frozen=True, slots=True)
class Segment:
    """One session's rows inside a batched frame (nested)."""

    session: SessionId
    start: int  # position of the segment's first row
    rows: int


@dataclass(frozen=True, slots=True, eq=False)
class ForwardBatch:
    """Many sessions in one frame: ``hidden`` is their rows one after another,
    in ``segments`` order (a decode row per running session, prefill chunks)."""

    tag: ClassVar[str] = "fwdb"
    term: int
    req: int
    segments: tuple[Segment, ...]
    hidden: torch.Tensor  # [sum(rows), H]


@dataclass(frozen=True, slots=True, eq=False)
class ResultBatch:
    tag: ClassVar[str] = "resb"
    term: int
    req: int
    hidden: torch.Tensor  # [sum(rows), H], same row order


@dataclass(frozen=True, slots=True)
class Drop:
    tag: ClassVar[str] = "drop"
    term: int
    session: SessionId


Message = (
    Hello | Auth | Ping | Pong | Bye | Plan | Accept | Reject | Commit | Forward | Result | Fail | Drop
    | ForwardBatch | ResultBatch
)

MESSAGE_TYPES: tuple[type, ...] = Message.__args__
