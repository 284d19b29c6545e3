"""The one codec: ``encode(msg) -> bytes`` and ``decode(data) -> Message``.

A frame is a msgpack map ``{"t": tag, field: value, ...}``. Keys a decoder does
not know are ignored; a missing key with a default takes it; anything else that
is off (wrong type, missing key, unknown tag, bad span or tensor, trailing bytes,
oversize) is a ``ProtocolError`` naming what and where, and closes that one link.
Both directions are derived from the message classes (their fields' names, types
and defaults), so a field is listed once, in ``protocol.messages``; the few checks
a type cannot say (a segment has rows, a batch's rows are its hidden's) are in
``_CHECKS`` here. Every value is bounded here, once, before any part of meshd uses
it: integers and durations by their field's ``max`` (terms by ``MAX_TERM``), ids and model names as
plain names (a model name becomes a directory: ``../x`` is refused), digests as
sha256 hex, spans within ``MAX_LAYERS``, floats finite. Spans travel as ``[start, stop]``, enums as ints, tensors as
``{dtype, shape, data}`` through ``pack_tensor`` / ``unpack_tensor`` (a ``WireTensor`` whose bytes agree with its
dtype and shape; ``shards.wire`` makes torch tensors of them, so this layer imports no torch). The codec checks shape, not meaning: whether
a plan covers the model is ``meshd.control.placement.validate``'s job, and whether a
Hello's version is ours is the handshake's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from enum import IntEnum
from functools import cache
from typing import Any, Callable, TypeGuard, TypeVar, cast, get_args, get_origin, get_type_hints

import msgpack

from .errors import ProtocolError
from .messages import (
    MESSAGE_TYPES,
    WIRE_DTYPES,
    Capabilities,
    Digest,
    ForwardBatch,
    MAX_ORIGIN,
    Measured,
    Message,
    ModelName,
    NodeId,
    Plan,
    Segment,
    SessionId,
    WireTensor,
)
from .names import is_plain_name
from .span import Span

DEFAULT_MAX_FRAME = 64 * 2**20  # a 2048x4096 fp16 prefill chunk is 16 MiB
MAX_NDIM = 8
# Bounds for everything that is not tensor data, so a hostile frame cannot make
# the unpacker allocate much before we look at it.
MAX_STR = 64 * 1024  # names, reasons, digests
MAX_ARRAY = 4096  # plan assignments, model lists, shapes
MAX_MAP = 64  # fields of one message
MAX_ID = 128  # node and session ids
MAX_LAYERS = 1 << 16  # span ends
MAX_LAYER_MS = 1e6
_HEX = frozenset("0123456789abcdef")
_ORIGIN = re.compile(r"[A-Za-z0-9._:-]*")  # Plan.chat_template

DTYPES = WIRE_DTYPES  # allowed tensor dtypes by wire name -> bytes per element


# -- tensors ---------------------------------------------------------------------


def pack_tensor(t: WireTensor) -> dict[str, Any]:
    """``{dtype, shape, data}``: the map a tensor travels as (``data`` as it is, no copy)."""
    return {"dtype": t.dtype, "shape": list(t.shape), "data": t.data}


def unpack_tensor(d: object, max_elements: int = DEFAULT_MAX_FRAME) -> WireTensor:
    """The tensor a ``pack_tensor`` map describes, checked: an allowed dtype, at most
    ``MAX_NDIM`` sizes of at most ``max_elements`` elements in all, and exactly the bytes
    they need."""
    if not isinstance(d, dict):
        raise ProtocolError(f"tensor must be a map, got {type(d).__name__}")
    name, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"tensor dtype {name!r} not allowed; allowed: {', '.join(DTYPES)}")
    itemsize = DTYPES[name]
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise ProtocolError(f"tensor shape must be a list of at most {MAX_NDIM} sizes")
    if not all(_is_int(n) and 0 <= n <= max_elements for n in shape):
        raise ProtocolError(f"tensor shape {shape!r}: sizes must be ints in 0..{max_elements}")
    count = math.prod(shape)
    if count > max_elements:
        raise ProtocolError(f"tensor of {count} elements exceeds {max_elements}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"tensor data must be bytes, got {type(data).__name__}")
    want = count * itemsize
    if len(data) != want:
        raise ProtocolError(f"tensor data is {len(data)} bytes, {name}{shape} needs {want}")
    return WireTensor(name, tuple(shape), data)


# -- encode ----------------------------------------------------------------------


def encode(msg: Any, types: tuple[type, ...] = MESSAGE_TYPES) -> bytes:
    """One frame for one message (of ``types``: the link's messages unless told)."""
    if type(msg) not in types:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    frame = {"t": msg.tag}
    _put_fields(msg, frame)
    return msgpack.packb(frame, use_bin_type=True, datetime=False)


Writer = Callable[[Any], Any]


def _put_fields(obj: object, out: dict) -> dict:
    cls: type = type(obj)  # (mypy finds ``type[object]``, what ``type(obj)`` gives, not hashable for @cache)
    for name, write in _field_writers(cls):
        value = getattr(obj, name)
        out[name] = value if write is None else write(value)
    return out


@cache
def _field_writers(cls: type) -> tuple[tuple[str, Writer | None], ...]:
    """Per field of ``cls``: its name and how its value goes on the wire (None: as it is)."""
    hints = get_type_hints(cls)
    return tuple((f.name, _value_writer(hints[f.name])) for f in dataclasses.fields(cls))


def _value_writer(hint: Any) -> Writer | None:
    if hint is WireTensor:
        return pack_tensor
    if hint is Span:
        return Span.to_list
    if isinstance(hint, type) and issubclass(hint, IntEnum):
        return int
    if get_origin(hint) is tuple:
        item = _value_writer(get_args(hint)[0])
        return list if item is None else (lambda values: [item(v) for v in values])
    if dataclasses.is_dataclass(hint):
        return lambda value: _put_fields(value, {})
    return None  # int, float, str, bytes and ids travel as they are


# -- decode ----------------------------------------------------------------------

@cache
def _by_tag(types: tuple[type, ...]) -> dict[str, type]:
    return {cls.tag: cls for cls in types}  # type: ignore[attr-defined]


def decode(data: bytes, max_size: int = DEFAULT_MAX_FRAME) -> Message:
    """The message in one frame, or ``ProtocolError`` saying what is wrong with it."""
    return decode_of(data, MESSAGE_TYPES, max_size)


def decode_of(data: bytes, types: tuple[type, ...], max_size: int = DEFAULT_MAX_FRAME) -> Any:
    """The message in one frame, one of ``types`` (another family of tagged messages, such
    as ``protocol.generate``'s), or ``ProtocolError``. Another family's strings and lists
    are bounded by ``max_size`` alone, not by the link messages' MAX_STR and MAX_ARRAY: a
    completion's history, echoed prompt and its logprobs run to the model's context."""
    frame = _unpack(data, max_size, sized=types is not MESSAGE_TYPES)
    tag = frame.get("t")
    f = _Fields(frame, max_size, str(tag))
    by_tag = _by_tag(types)
    match tag:
        case str() if tag in by_tag:
            return _read(by_tag[tag], f)
        case None:
            raise ProtocolError("frame has no 't' tag")
        case str():
            raise ProtocolError(f"unknown message tag {tag!r}")
        case _:
            raise ProtocolError(f"message tag must be a string, got {type(tag).__name__}")


def _read(cls: type, f: _Fields) -> Any:
    """An instance of dataclass ``cls`` from the map ``f``, field by field."""
    obj = cls(*[read(f) for read in _field_readers(cls)])
    if check := _CHECKS.get(cls):
        check(obj, f)
    return obj


Reader = Callable[["_Fields"], Any]
E = TypeVar("E", bound=IntEnum)


@cache
def _field_readers(cls: type) -> tuple[Reader, ...]:
    """One reader per field of ``cls``, in order: the value at its key, or its default."""
    hints = get_type_hints(cls)
    readers = []
    for fld in dataclasses.fields(cls):
        default = _REQUIRED if fld.default is dataclasses.MISSING else fld.default
        hint = hints[fld.name]
        readers.append(_keyed(fld.name, default, _value_reader(hint, fld.metadata), _plain(hint, fld.metadata)))
    return tuple(readers)


def _plain(hint: Any, meta: Any) -> Callable[[object], bool] | None:
    """A quick test that a value is already fine as it is (most are): only what fails
    it goes through the checked reader, which then says what is wrong."""
    if hint is int:
        hi, lo = (meta or {}).get("max", _MAX_INT), (meta or {}).get("min", 0)
        return lambda v: type(v) is int and lo <= v <= hi
    if hint is str:
        return lambda v: type(v) is str
    if hint in (NodeId, SessionId):
        return lambda v: type(v) is str and len(v) <= MAX_ID and is_plain_name(v)
    return None


def _keyed(key: str, default: Any, read: Reader, plain: Callable[[object], bool] | None) -> Reader:
    def at_key(f: _Fields) -> Any:
        # ``f`` is always a map here: decode's frame (``_unpack`` checked it) or ``as_map``'s.
        if plain is not None and plain(v := cast(dict, f.frame).get(key, _REQUIRED)):
            return v
        v = f.at(key, default)
        return default if v is None else read(v)
    return at_key


def _value_reader(hint: Any, meta: Any = None) -> Reader:
    """How to read one value of type ``hint`` (the wire types messages may use)."""
    if hint is int:
        hi, lo = (meta or {}).get("max", _MAX_INT), (meta or {}).get("min", 0)
        return lambda v: v.as_int(hi, lo)
    if hint is float and meta and "max" in meta:  # a bounded duration: 0..max
        hi = meta["max"]
        return lambda v: v.as_float(hi)
    if hint is NodeId:
        return _Fields.as_node
    if hint is SessionId:
        return lambda v: SessionId(v.as_node())
    if hint is ModelName:
        return _Fields.as_name
    if hint is Digest:
        return _Fields.as_digest
    simple: dict[object, Reader] = {float: _Fields.as_float, str: _Fields.as_str, bytes: _Fields.as_bytes,
                                    Span: _Fields.as_span, WireTensor: _Fields.as_tensor}
    if hint in simple:
        return simple[hint]
    if isinstance(hint, type) and issubclass(hint, IntEnum):
        return lambda v: v.as_enum(hint)
    if get_origin(hint) is tuple:
        item, more = get_args(hint)
        assert more is Ellipsis, f"only tuple[X, ...] travels, not {hint}"
        read_item = _value_reader(item)
        return lambda v: v.as_list(read_item)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a class, not an instance
        return lambda v: _read(hint, v.as_map())
    raise TypeError(f"no wire form for {hint!r}")


def _check_segment(s: Segment, f: _Fields) -> None:
    if s.rows < 1:
        raise ProtocolError(f"{f.where}: a segment needs at least one row")


def _check_batch(batch: ForwardBatch, f: _Fields) -> None:
    rows = sum(s.rows for s in batch.segments)
    if len(batch.hidden.shape) != 2 or batch.hidden.shape[0] != rows:
        raise ProtocolError(f"fwdb: hidden {batch.hidden.shape} does not hold the {rows} rows "
                            "its segments name")


def _check_caps(c: Capabilities, f: _Fields) -> None:
    if not 0.0 <= c.layer_ms <= MAX_LAYER_MS:
        raise ProtocolError(f"{f.where}: layer_ms {c.layer_ms} is outside 0..{MAX_LAYER_MS:g}")


def _check_measured(m: Measured, f: _Fields) -> None:
    # Finite is the reader's check; 0 means "not measured", anything else must be a time.
    for name in ("layer_ms", "layer_ms_batch", "head_ms", "head_ms_batch"):
        if not 0.0 <= (v := getattr(m, name)) <= MAX_LAYER_MS:
            raise ProtocolError(f"{f.where}: {name} {v} is outside 0..{MAX_LAYER_MS:g}")
    if m.batch < 1:
        raise ProtocolError(f"{f.where}: batch must be at least 1")
    if len(m.model) > MAX_ID:
        raise ProtocolError(f"{f.where}: model name longer than {MAX_ID}")


def _check_plan(p: Plan, f: _Fields) -> None:
    # A label a member shows (/v1/models), never a path: letters, digits and ._:- only.
    if len(p.chat_template) > MAX_ORIGIN or not _ORIGIN.fullmatch(p.chat_template):
        raise ProtocolError(f"{f.where}: chat_template must be a label of at most {MAX_ORIGIN} of [A-Za-z0-9._:-]")


_CHECKS: dict[type, Callable[[Any, _Fields], None]] = {Segment: _check_segment, ForwardBatch: _check_batch,
                                                       Capabilities: _check_caps, Measured: _check_measured,
                                                       Plan: _check_plan}


def _unpack(data: bytes, max_size: int, sized: bool = False) -> dict:
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
            max_str_len=max_size if sized else MAX_STR,
            max_bin_len=max_size,
            max_array_len=max_size if sized else MAX_ARRAY,
            max_map_len=MAX_MAP,
            max_ext_len=0,  # no extension types on this wire
        )
    except ValueError as e:  # msgpack's errors (truncated, extra data, limits) are ValueErrors
        raise ProtocolError(f"bad msgpack frame: {e or type(e).__name__}") from e
    if not isinstance(frame, dict):
        raise ProtocolError(f"frame must be a map, got {type(frame).__name__}")
    return frame


_REQUIRED: Any = object()
_MAX_INT = 2**63 - 1


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


class _Fields:
    """Typed reads from one map (or one value) of a frame; every miss or mismatch
    is a ProtocolError that names the field, e.g. ``plan.assignments[2].span``."""

    __slots__ = ("frame", "max_size", "_name", "_parent")

    def __init__(self, frame: object, max_size: int, name: str, parent: _Fields | None = None):
        self.frame, self.max_size = frame, max_size
        self._name, self._parent = name, parent  # the path is spelled out only for an error

    @property
    def where(self) -> str:
        if self._parent is None:
            return self._name
        return self._parent.where + self._name

    def at(self, key: str, default: Any = _REQUIRED) -> _Fields | None:
        """The value at ``key`` of this map; None when it is absent and has a default."""
        frame = self.frame
        if not isinstance(frame, dict):  # never: fields are read from decode's frame or as_map()'s
            raise self._wrong("map")
        if key not in frame:
            if default is _REQUIRED:
                raise ProtocolError(f"{self.where}: missing field {key!r}")
            return None
        return _Fields(frame[key], self.max_size, "." + key, self)

    def _wrong(self, want: str) -> ProtocolError:
        return ProtocolError(f"{self.where}: expected {want}, got {type(self.frame).__name__}")

    # One value, as a type. Integers on this wire are non-negative unless a field's
    # ``min`` says otherwise (a sampling seed).
    def as_int(self, hi: int = _MAX_INT, lo: int = 0) -> int:
        v = self.frame
        if not _is_int(v):
            raise self._wrong("int")
        if not lo <= v <= hi:
            raise ProtocolError(f"{self.where}: {v} is outside {lo}..{hi}")
        return v

    def as_float(self, hi: float | None = None) -> float:
        v = self.frame  # an int is a fine float (msgspec's rule); NaN and inf are not
        if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
            raise self._wrong("finite float")
        if hi is not None and not 0.0 <= v <= hi:
            raise ProtocolError(f"{self.where}: {v} is outside 0..{hi:g}")
        return float(v)

    def as_enum(self, kind: type[E]) -> E:
        n = self.as_int()
        try:
            return kind(n)
        except ValueError:
            raise ProtocolError(f"{self.where}: {n} is no {kind.__name__} member") from None

    def as_str(self) -> str:
        if not isinstance(self.frame, str):
            raise self._wrong("str")
        return self.frame

    def as_node(self) -> NodeId:
        v = self.as_str()
        if len(v) > MAX_ID or not is_plain_name(v):
            raise ProtocolError(f"{self.where}: empty id" if not v else
                                f"{self.where}: an id is a plain name of 1..{MAX_ID} characters, got {v[:40]!r}")
        return NodeId(v)

    def as_name(self) -> ModelName:
        v = self.as_str()
        if not is_plain_name(v):
            raise ProtocolError(f"{self.where}: {v[:80]!r} is not a plain model name")
        return ModelName(v)

    def as_digest(self) -> Digest:
        v = self.as_str()
        if len(v) != 64 or not _HEX.issuperset(v):
            raise ProtocolError(f"{self.where}: a digest is 64 lowercase hex digits, got {v[:80]!r}")
        return Digest(v)

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
            span = Span(v[0], v[1])
        except ValueError as e:
            raise ProtocolError(f"{self.where}: {e}") from e
        if span.stop > MAX_LAYERS:
            raise ProtocolError(f"{self.where}: span {span} ends past {MAX_LAYERS} layers")
        return span

    def as_tensor(self) -> WireTensor:
        try:
            return unpack_tensor(self.frame, max_elements=self.max_size)
        except ProtocolError as e:
            raise ProtocolError(f"{self.where}: {e}") from e

    def as_list(self, item: Reader) -> tuple:
        if not isinstance(self.frame, list):
            raise self._wrong("list")
        return tuple([item(_Fields(x, self.max_size, f"[{i}]", self)) for i, x in enumerate(self.frame)])
