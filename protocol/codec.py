"""The one codec: ``encode(msg) -> bytes`` and ``decode(data) -> Message``.

A frame is a msgpack map ``{"t": tag, field: value, ...}``. Keys a decoder does
not know are ignored; a missing key with a default takes it; anything else that
is off (wrong type, missing key, unknown tag, bad span or tensor, trailing bytes,
oversize) is a ``ProtocolError`` naming what and where, and closes that one link.
Spans travel as ``[start, stop]``, tensors as ``{dtype, shape, data}`` through
``pack_tensor`` / ``unpack_tensor``. The codec checks shape, not meaning: whether
a plan covers the model is ``meshd.control.placement.validate``'s job, and whether a
Hello's version is ours is the handshake's.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Callable

import msgpack
import torch

from meshd.errors import ProtocolError
from shards.span import Span

from .messages import (
    MESSAGE_TYPES,
    Accept,
    Assignment,
    Auth,
    Bye,
    Capabilities,
    Commit,
    Drop,
    Fail,
    Forward,
    ForwardBatch,
    Hello,
    Message,
    NodeId,
    Ping,
    Plan,
    Pong,
    Reject,
    Result,
    ResultBatch,
    Segment,
    SessionId,
)

DEFAULT_MAX_FRAME = 64 * 2**20  # a 2048x4096 fp16 prefill chunk is 16 MiB
MAX_NDIM = 8
# Bounds for everything that is not tensor data, so a hostile frame cannot make
# the unpacker allocate much before we look at it.
MAX_STR = 64 * 1024  # names, reasons, digests
MAX_ARRAY = 4096  # plan assignments, model lists, shapes
MAX_MAP = 64  # fields of one message

# Allowed tensor dtypes by wire name. bfloat16 has no numpy type; it travels
# as raw 2-byte words, which torch.frombuffer reads back bit for bit. Byte
# order is little-endian, as on every host torch runs on.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_WIRE_NAME = {dtype: name for name, dtype in DTYPES.items()}


# -- tensors ---------------------------------------------------------------------


def pack_tensor(t: torch.Tensor) -> dict[str, Any]:
    """``{dtype, shape, data}`` for a tensor on any device.

    At most one copy before msgpack's own: a gather into contiguous memory on
    the tensor's device, or the device-to-host transfer (never both for a
    contiguous CUDA tensor). ``data`` is a memoryview over that memory.
    """
    name = _WIRE_NAME.get(t.dtype)
    if name is None:
        raise TypeError(f"cannot send dtype {t.dtype}; allowed: {', '.join(DTYPES)}")
    host = t.detach().contiguous().cpu()
    data = memoryview(host.reshape(-1).view(torch.uint8).numpy())
    return {"dtype": name, "shape": list(host.shape), "data": data}


def unpack_tensor(d: object, max_elements: int = DEFAULT_MAX_FRAME) -> torch.Tensor:
    """The tensor a ``pack_tensor`` dict describes, checked before any allocation.

    The result owns its memory (copied once from ``data``), so it is safe to
    write to and does not pin the frame.
    """
    if not isinstance(d, dict):
        raise ProtocolError(f"tensor must be a map, got {type(d).__name__}")
    name, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"tensor dtype {name!r} not allowed; allowed: {', '.join(DTYPES)}")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise ProtocolError(f"tensor shape must be a list of at most {MAX_NDIM} sizes")
    if not all(_is_int(n) and 0 <= n <= max_elements for n in shape):
        raise ProtocolError(f"tensor shape {shape!r}: sizes must be ints in 0..{max_elements}")
    count = math.prod(shape)
    if count > max_elements:
        raise ProtocolError(f"tensor of {count} elements exceeds {max_elements}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"tensor data must be bytes, got {type(data).__name__}")
    want = count * dtype.itemsize
    if len(data) != want:
        raise ProtocolError(f"tensor data is {len(data)} bytes, {name}{shape} needs {want}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# -- encode ----------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """One frame for one message."""
    if type(msg) not in MESSAGE_TYPES:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    frame = {"t": msg.tag, **_to_wire(msg)}
    return msgpack.packb(frame, use_bin_type=True, datetime=False)


def _to_wire(value: object) -> object:
    match value:
        case torch.Tensor():
            return pack_tensor(value)
        case Span():
            return value.to_list()
        case tuple():
            return [_to_wire(v) for v in value]
        case _ if hasattr(value, "__dataclass_fields__"):
            return {f.name: _to_wire(getattr(value, f.name)) for f in fields(value)}
        case _:
            return value


# -- decode ----------------------------------------------------------------------


def decode(data: bytes, max_size: int = DEFAULT_MAX_FRAME) -> Message:
    """The message in one frame, or ``ProtocolError`` saying what is wrong with it."""
    f = _Fields(_unpack(data, max_size), "frame", max_size)
    tag = f.frame.get("t")
    f.where = str(tag)
    match tag:
        case Hello.tag:
            return Hello(
                version=f.int("version"),
                node_id=f.node("node_id"),
                mesh=f.str("mesh"),
                name=f.str("name"),
                nonce=f.bytes("nonce"),
                caps=_capabilities(f.map("caps")),
            )
        case Auth.tag:
            return Auth(mac=f.bytes("mac"))
        case Ping.tag:
            return Ping(seq=f.int("seq"), sent=f.float("sent"))
        case Pong.tag:
            return Pong(seq=f.int("seq"), sent=f.float("sent"))
        case Bye.tag:
            return Bye(reason=f.str("reason"))
        case Plan.tag:
            return Plan(
                term=f.int("term"),
                supernode=f.node("supernode"),
                model=f.str("model"),
                manifest_digest=f.str("manifest_digest"),
                assignments=f.list("assignments", lambda g: _assignment(g.as_map())),
                sources=f.list("sources", lambda g: g.as_node(), default=()),
            )
        case Accept.tag:
            return Accept(term=f.int("term"), span=f.span("span"))
        case Reject.tag:
            return Reject(term=f.int("term"), reason=f.str("reason"), capacity=f.int("capacity", 0))
        case Commit.tag:
            return Commit(term=f.int("term"))
        case Forward.tag:
            return Forward(
                term=f.int("term"),
                session=f.session("session"),
                req=f.int("req"),
                start=f.int("start"),
                hidden=f.tensor("hidden"),
            )
        case Result.tag:
            return Result(
                term=f.int("term"),
                session=f.session("session"),
                req=f.int("req"),
                hidden=f.tensor("hidden"),
            )
        case ForwardBatch.tag:
            batch = ForwardBatch(
                term=f.int("term"),
                req=f.int("req"),
                segments=f.list("segments", lambda g: _segment(g.as_map())),
                hidden=f.tensor("hidden"),
            )
            rows = sum(s.rows for s in batch.segments)
            if batch.hidden.dim() != 2 or batch.hidden.shape[0] != rows:
                raise ProtocolError(f"fwdb: hidden {tuple(batch.hidden.shape)} does not hold the {rows} rows "
                                    "its segments name")
            return batch
        case ResultBatch.tag:
            return ResultBatch(term=f.int("term"), req=f.int("req"), hidden=f.tensor("hidden"))
        case Fail.tag:
            return Fail(term=f.int("term"), req=f.int("req"), reason=f.str("reason"))
        case Drop.tag:
            return Drop(term=f.int("term"), session=f.session("session"))
        case None:
            raise ProtocolError("frame has no 't' tag")
        case str():
            raise ProtocolError(f"unknown message tag {tag!r}")
        case _:
            raise ProtocolError(f"message tag must be a string, got {type(tag).__name__}")


def _capabilities(f: _Fields) -> Capabilities:
    return Capabilities(
        vram=f.int("vram"),
        ram=f.int("ram"),
        device=f.str("device"),
        api_port=f.int("api_port", hi=65535),
        mem_budget=f.int("mem_budget"),
        layer_ms=f.float("layer_ms"),
        models=f.list("models", lambda g: g.as_str(), default=()),
    )


def _segment(f: _Fields) -> Segment:
    rows = f.int("rows")
    if rows < 1:
        raise ProtocolError(f"{f.where}: a segment needs at least one row")
    return Segment(session=f.session("session"), start=f.int("start"), rows=rows)


def _assignment(f: _Fields) -> Assignment:
    return Assignment(node=f.node("node"), span=f.span("span"))


def _unpack(data: bytes, max_size: int) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be binary, got {type(data).__name__}")
    # The size check up front is msgpack's max_buffer_size for a one-shot unpack:
    # nothing is parsed from a frame over the limit.
    if len(data) > max_size:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {max_size}-byte limit")
    try:
        frame = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,  # keys are strings; no hashing of hostile containers
            use_list=True,
            max_str_len=MAX_STR,
            max_bin_len=max_size,
            max_array_len=MAX_ARRAY,
            max_map_len=MAX_MAP,
            max_ext_len=0,  # no extension types on this wire
        )
    except ValueError as e:  # msgpack's errors (truncated, extra data, limits) are ValueErrors
        raise ProtocolError(f"bad msgpack frame: {e or type(e).__name__}") from e
    if not isinstance(frame, dict):
        raise ProtocolError(f"frame must be a map, got {type(frame).__name__}")
    return frame


_REQUIRED: Any = object()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Fields:
    """Typed reads from one map (or one value) of a frame; every miss or mismatch
    is a ProtocolError that names the field, e.g. ``plan.assignments[2].span``."""

    __slots__ = ("frame", "where", "max_size")

    def __init__(self, frame: object, where: str, max_size: int):
        self.frame, self.where, self.max_size = frame, where, max_size

    def _at(self, key: str, default: Any) -> _Fields | None:
        if key not in self.frame:
            if default is _REQUIRED:
                raise ProtocolError(f"{self.where}: missing field {key!r}")
            return None
        return _Fields(self.frame[key], f"{self.where}.{key}", self.max_size)

    def _wrong(self, want: str) -> ProtocolError:
        return ProtocolError(f"{self.where}: expected {want}, got {type(self.frame).__name__}")

    # One value, as a type. All integers on this wire are non-negative.
    def as_int(self, hi: int = 2**63 - 1) -> int:
        v = self.frame
        if not _is_int(v):
            raise self._wrong("int")
        if not 0 <= v <= hi:
            raise ProtocolError(f"{self.where}: {v} is outside 0..{hi}")
        return v

    def as_float(self) -> float:
        v = self.frame  # an int is a fine float (msgspec's rule); NaN and inf are not
        if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
            raise self._wrong("finite float")
        return float(v)

    def as_str(self) -> str:
        if not isinstance(self.frame, str):
            raise self._wrong("str")
        return self.frame

    def as_node(self) -> NodeId:
        if not self.as_str():
            raise ProtocolError(f"{self.where}: empty id")
        return NodeId(self.frame)

    def as_bytes(self) -> bytes:
        if not isinstance(self.frame, bytes):
            raise self._wrong("bytes")
        return self.frame

    def as_map(self) -> _Fields:
        if not isinstance(self.frame, dict):
            raise self._wrong("map")
        return self

    def as_span(self) -> Span:
        v = self.frame
        if not (isinstance(v, list) and len(v) == 2 and all(_is_int(n) for n in v)):
            raise ProtocolError(f"{self.where}: span must be [start, stop] ints, got {v!r:.60}")
        try:
            return Span(v[0], v[1])
        except ValueError as e:
            raise ProtocolError(f"{self.where}: {e}") from e

    # Fields of this map, by key.
    def int(self, key: str, default: Any = _REQUIRED, hi: int = 2**63 - 1) -> int:
        v = self._at(key, default)
        return default if v is None else v.as_int(hi)

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        v = self._at(key, default)
        return default if v is None else v.as_float()

    def str(self, key: str, default: Any = _REQUIRED) -> str:
        v = self._at(key, default)
        return default if v is None else v.as_str()

    def bytes(self, key: str, default: Any = _REQUIRED) -> bytes:
        v = self._at(key, default)
        return default if v is None else v.as_bytes()

    def node(self, key: str) -> NodeId:
        return self._at(key, _REQUIRED).as_node()

    def session(self, key: str) -> SessionId:
        return SessionId(self._at(key, _REQUIRED).as_node())

    def span(self, key: str) -> Span:
        return self._at(key, _REQUIRED).as_span()

    def map(self, key: str) -> _Fields:
        return self._at(key, _REQUIRED).as_map()

    def tensor(self, key: str) -> torch.Tensor:
        v = self._at(key, _REQUIRED)
        try:
            return unpack_tensor(v.frame, max_elements=self.max_size)
        except ProtocolError as e:
            raise ProtocolError(f"{v.where}: {e}") from e

    def list(self, key: str, item: Callable[[_Fields], Any], default: Any = _REQUIRED) -> tuple:
        v = self._at(key, default)
        if v is None:
            return default
        if not isinstance(v.frame, list):
            raise v._wrong("list")
        return tuple(item(_Fields(x, f"{v.where}[{i}]", self.max_size)) for i, x in enumerate(v.frame))
