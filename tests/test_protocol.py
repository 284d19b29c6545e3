"""The codec: a round trip for every message and dtype, and every malformed
class of frame rejected with ProtocolError (never another exception)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from meshd.control.peers import step_error
from meshd.errors import NoCapacity, PeerLost, ProtocolError, StageFailed
from protocol import codec
from protocol.codec import decode, encode, pack_tensor, unpack_tensor
from protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Accept,
    ApiCancel,
    ApiReply,
    ApiRequest,
    Assignment,
    Bye,
    Capabilities,
    Commit,
    Drop,
    Fail,
    FailCode,
    ForwardBatch,
    Hello,
    Leaving,
    NodeId,
    Ping,
    Plan,
    Pong,
    Reject,
    RejectCode,
    ResultBatch,
    Segment,
    SessionId,
    WireTensor,
)
from shards.span import Span
from shards.wire import TORCH_DTYPES, from_wire, to_wire

CAPS = Capabilities(
    vram=8 * 2**30, ram=32 * 2**30, device="cuda", api_port=8470,
    mem_budget=6 * 2**30, layer_ms=0.75, models=("smollm2-135m",),
)
HIDDEN = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))  # the same in every xdist worker

SAMPLES = [
    Hello(PROTOCOL_VERSION, NodeId("node-a"), "home", "box-a", CAPS, plaintext=1),
    ApiCancel(req=4),
    Ping(seq=7, sent=12345.678),
    Pong(seq=7, sent=12345.678, ram_used=412 * 2**20),
    Bye(reason="shutting down"),
    Plan(
        term=3, supernode=NodeId("a"), model="smollm2-135m", manifest_digest="ab" * 32,
        assignments=(Assignment(NodeId("a"), Span(0, 10)), Assignment(NodeId("b"), Span(10, 30))),
        sources=(NodeId("a"),), chat_template="gemma",
    ),
    Accept(term=3, span=Span(10, 30)),
    Reject(term=3, reason="stale term: this peer is at term 5", capacity=1024, code=RejectCode.STALE_TERM,
           held_term=5),
    Commit(term=3),
    ForwardBatch(term=3, req=10, segments=(Segment(SessionId("s1"), 17, 1), Segment(SessionId("s2"), 0, 2)),
                 hidden=to_wire(HIDDEN)),
    ResultBatch(term=3, req=10, hidden=to_wire(HIDDEN * 3), seconds=0.0125, queued=0.002),
    Fail(term=3, req=9, reason="engine error"),
    Drop(term=3, session=SessionId("s1")),
    ApiRequest(req=4, method="POST", path="/v1/completions", body=b'{"prompt": "hi"}', authorization="Bearer k",
               traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ApiReply(req=4, status=200, data=b"data: {}\n\n", end=1),
    Leaving(reason="shutting down"),
]


def frame(msg) -> dict:
    """The raw msgpack map of a message, to tamper with."""
    return msgpack.unpackb(encode(msg), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, WireTensor):
            assert (x.dtype, x.shape, bytes(x.data)) == (y.dtype, y.shape, bytes(y.data))
        else:
            assert x == y, f.name


# -- round trips ------------------------------------------------------------------


def test_every_message_type_has_a_sample_and_a_unique_tag():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)
    tags = [t.tag for t in MESSAGE_TYPES]
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert_same(decode(encode(msg)), msg)


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (0, 576), (1, 576), (2, 3, 4)], ids=str)
def test_tensor_round_trip(name, shape):
    dtype = TORCH_DTYPES[name]
    if dtype.is_floating_point:
        t = torch.randn(shape).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, shape, dtype=dtype)
    msg = ResultBatch(1, 0, to_wire(t))  # the frame that takes a tensor of any shape
    back = from_wire(decode(encode(msg)).hidden)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_bfloat16_travels_bit_for_bit():
    # Every 16-bit pattern, NaNs and infinities included.
    words = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = words.view(torch.bfloat16)
    d = pack_tensor(to_wire(t))
    assert d["dtype"] == "bfloat16" and len(d["data"]) == 2 * 2**16
    back = from_wire(decode(encode(ResultBatch(1, 0, to_wire(t)))).hidden)
    assert torch.equal(back.view(torch.int16), words)


def test_large_prefill_frame():
    t = torch.randn(2048, 4096, dtype=torch.float16)  # 16 MiB
    assert torch.equal(from_wire(decode(encode(ForwardBatch(1, 0, (Segment(SessionId("s"), 0, 2048),), to_wire(t)))).hidden), t)


def test_non_contiguous_and_grad_tensors_pack():
    t = torch.randn(4, 6, requires_grad=True)
    view = t.t()[1:3]
    assert torch.equal(from_wire(unpack_tensor(pack_tensor(to_wire(view)))), view.detach())


@pytest.mark.filterwarnings("error")
def test_unpacked_tensor_owns_writable_memory():
    data = bytearray(torch.ones(4).numpy().tobytes())
    t = from_wire(unpack_tensor({"dtype": "float32", "shape": [4], "data": data}))
    t += 1  # must not warn about a read-only buffer, nor write through to the frame
    assert data == bytearray(torch.ones(4).numpy().tobytes())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_packs():
    t = torch.randn(3, 5, device="cuda").half()
    assert torch.equal(from_wire(unpack_tensor(pack_tensor(to_wire(t)))), t.cpu())


# -- schema evolution -------------------------------------------------------------


def test_unknown_fields_are_ignored():
    f = frame(SAMPLES[0])
    f["future"] = {"anything": [1, 2]}
    f["caps"]["gpu_name"] = "RTX"
    assert_same(decode(pack(f)), SAMPLES[0])


def test_missing_fields_with_defaults_take_them():
    f = frame(Reject(term=2, reason="no"))
    del f["capacity"]
    assert decode(pack(f)) == Reject(term=2, reason="no")
    plan = dataclasses.replace(SAMPLES[5], sources=())
    f = frame(plan)
    del f["sources"]
    assert decode(pack(f)) == plan
    f = frame(SAMPLES[0])
    del f["caps"]["models"]
    assert decode(pack(f)).caps == dataclasses.replace(CAPS, models=())
    f = frame(SAMPLES[3])  # an older peer's Pong: its memory in use is not known
    del f["ram_used"]
    assert decode(pack(f)) == Pong(seq=7, sent=12345.678, ram_used=0)
    f = frame(SAMPLES[5])  # an older supernode's Plan: its chat template is not known
    del f["chat_template"]
    assert decode(pack(f)).chat_template == ""
    f = frame(SAMPLES[10])  # an older stage's result: its share of the step reads as 0
    del f["seconds"], f["queued"]
    assert (decode(pack(f)).seconds, decode(pack(f)).queued) == (0.0, 0.0)


def test_a_reject_without_a_code_or_with_an_unknown_one_reads_as_other():
    """An older peer sends no code; a newer one may send a code this peer does not know.
    Either way it is a plain Reject (the supernode leaves that peer out), never a
    protocol error that would close the link."""
    f = frame(SAMPLES[7])
    del f["code"], f["held_term"]
    assert decode(pack(f)) == Reject(term=3, reason=SAMPLES[7].reason, capacity=1024)
    f["code"] = 99
    assert decode(pack(f)).code is RejectCode.OTHER


def test_a_fail_says_whether_the_stage_is_full_and_an_older_or_newer_code_reads_as_other():
    """KV_FULL ends the step's sessions (NoCapacity, no new plan); any other Fail, an older
    peer's without a code, or a newer one's with a code this peer does not know, is a stage
    that failed (a new plan, then a replay)."""
    full = Fail(term=3, req=9, reason="past its limit", code=FailCode.KV_FULL)
    assert decode(encode(full)) == full
    assert isinstance(step_error("b", full), NoCapacity) and not isinstance(step_error("b", full), PeerLost)
    f = frame(full)
    for code in (None, 99):
        if code is None:
            del f["code"]
        else:
            f["code"] = code
        old = decode(pack(f))
        assert old.code is FailCode.OTHER and isinstance(step_error("b", old), StageFailed)


def test_an_int_is_accepted_as_a_float():
    f = frame(Ping(1, 2.0))
    f["sent"] = 2
    assert decode(pack(f)) == Ping(1, 2.0)


# -- rejection --------------------------------------------------------------------


def rejects(data: bytes, match: str = "") -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def tampered(msg, path: tuple, value) -> bytes:
    f = frame(msg)
    node = f
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return pack(f)


DELETE = object()
HELLO, PLAN, FWD, RESULT = SAMPLES[0], SAMPLES[5], SAMPLES[9], SAMPLES[10]


@pytest.mark.parametrize(
    "msg, path, value, match",
    [
        (HELLO, ("version",), "1", "hello.version: expected int"),
        (HELLO, ("version",), 1.0, "expected int"),
        (HELLO, ("version",), True, "expected int"),
        (HELLO, ("version",), -1, "outside"),
        (HELLO, ("node_id",), 5, "expected str"),
        (HELLO, ("node_id",), "", "empty id"),
        (HELLO, ("plaintext",), 2, "outside"),
        (HELLO, ("caps",), [1, 2], "expected map"),
        (HELLO, ("caps", "vram"), "big", "hello.caps.vram"),
        (HELLO, ("caps", "layer_ms"), "fast", "finite float"),
        (HELLO, ("caps", "layer_ms"), float("nan"), "finite float"),
        (HELLO, ("caps", "api_port"), 70000, "outside"),
        (HELLO, ("caps", "models"), "smollm2", "expected list"),
        (HELLO, ("caps", "models"), ["ok", 3], r"models\[1\]"),
        (HELLO, ("caps", "device"), DELETE, "missing field 'device'"),
        (HELLO, ("mesh",), DELETE, "missing field 'mesh'"),
        (PLAN, ("assignments",), {"a": 1}, "expected list"),
        (PLAN, ("assignments", 1), ["b", [10, 30]], r"assignments\[1\]: expected map"),
        (PLAN, ("assignments", 1, "span"), [30, 10], "bad span"),
        (PLAN, ("assignments", 1, "span"), [-1, 10], "bad span"),
        (PLAN, ("assignments", 1, "span"), [1, 2, 3], "span must be"),
        (PLAN, ("assignments", 1, "span"), [1.0, 2], "span must be"),
        (PLAN, ("assignments", 1, "span"), {"start": 1, "stop": 2}, "span must be"),
        (PLAN, ("assignments", 0, "node"), None, "expected str"),
        (PLAN, ("sources", 0), b"a", "expected str"),
        (SAMPLES[6], ("span",), [5, 5], "bad span"),
        (SAMPLES[7], ("capacity",), "lots", "expected int"),
        (SAMPLES[2], ("sent",), "now", "finite float"),
        (SAMPLES[3], ("ram_used",), -1, "outside"),
        (SAMPLES[3], ("ram_used",), 2**60, "outside"),
        (SAMPLES[3], ("ram_used",), "1 GiB", "expected int"),
        (PLAN, ("chat_template",), 7, "expected str"),
        (PLAN, ("chat_template",), "x" * 257, "chat_template must be a label"),
        (PLAN, ("chat_template",), "file:../../etc/passwd", "chat_template must be a label"),
        (PLAN, ("chat_template",), "gemma\n", "chat_template must be a label"),
        (FWD, ("hidden",), b"raw", "tensor must be a map"),
        (FWD, ("hidden", "dtype"), "float64", "dtype 'float64' not allowed"),
        (FWD, ("hidden", "dtype"), "bool", "not allowed"),
        (FWD, ("hidden", "dtype"), ["float32"], "not allowed"),
        (FWD, ("hidden", "shape"), [3, 575], "needs"),
        (FWD, ("hidden", "shape"), [3, -576], "sizes must be ints"),
        (FWD, ("hidden", "shape"), [3, 576.0], "sizes must be ints"),
        (FWD, ("hidden", "shape"), "3x576", "shape must be a list"),
        (FWD, ("hidden", "shape"), [1] * 9, "at most 8"),
        (FWD, ("hidden", "shape"), [2**40, 2**40, 0], "sizes must be ints"),
        (FWD, ("hidden", "data"), "text", "data must be bytes"),
        (FWD, ("hidden", "data"), b"\x00" * 7, "7 bytes"),
        (FWD, ("hidden",), DELETE, "missing field 'hidden'"),
        (FWD, ("segments", 0, "session"), 12, "expected str"),
        (RESULT, ("seconds",), -0.5, "outside 0..3600"),  # a stage's figures are bounded, not trusted
        (RESULT, ("seconds",), 1e9, "outside 0..3600"),
        (RESULT, ("queued",), float("inf"), "finite float"),
        (RESULT, ("queued",), "soon", "finite float"),
        (FWD, ("t",), "warp", "unknown message tag 'warp'"),
        (FWD, ("t",), 3, "tag must be a string"),
        (FWD, ("t",), DELETE, "no 't' tag"),
    ],
)
def test_malformed_field_is_rejected(msg, path, value, match):
    rejects(tampered(msg, path, value), match)


def test_too_many_elements_for_the_frame_limit():
    d = pack_tensor(to_wire(torch.zeros(4, 4)))
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack_tensor(d, max_elements=15)


@pytest.mark.parametrize(
    "data, match",
    [
        (pack([1, 2, 3]), "must be a map"),
        (pack("hello"), "must be a map"),
        (pack(None), "must be a map"),
        (b"", "bad msgpack"),
        (encode(SAMPLES[9])[:-5], "bad msgpack"),  # truncated
        (encode(SAMPLES[1])[:3], "bad msgpack"),
        (encode(SAMPLES[8]) + b"\x00", "bad msgpack"),  # trailing garbage
        (b"\xc1", "bad msgpack"),  # a reserved byte
        (pack({1: "int key"}), "bad msgpack"),  # strict_map_key
        (b"\x91" * 5000, "bad msgpack"),  # nesting deeper than the unpacker's stack
        (b"\xdd\xff\xff\xff\xff", "bad msgpack"),  # claims a 4G-element array
        (b"\xc6\x7f\xff\xff\xff", "bad msgpack"),  # claims a 2 GiB bin
        (b"\x81\xa1t\xd6\x01" + b"\x00" * 4, "bad msgpack"),  # an ext type
        (b"\x81\xa1t\xa2\xff\xfe", "bad msgpack"),  # invalid UTF-8
    ],
    # Short names: an id made of a frame's bytes is long and, were a frame random, differs
    # between xdist workers (which then refuse to run the suite).
    ids=["list", "str", "nil", "empty", "truncated", "cut-header", "trailing", "reserved", "int-key", "deep",
         "huge-array", "huge-bin", "ext", "bad-utf8"],
)
def test_malformed_frame_is_rejected(data, match):
    rejects(data, match)


def test_text_frame_is_rejected():
    with pytest.raises(ProtocolError, match="must be binary"):
        decode("{'t': 'ping'}")  # type: ignore[arg-type]


def test_oversize_frame_is_rejected_before_parsing():
    data = encode(ForwardBatch(1, 0, (Segment(SessionId("s"), 0, 64),), to_wire(torch.zeros(64, 64))))
    rejects_at = len(data) - 1
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(data, max_size=rejects_at)
    assert decode(data, max_size=len(data)).hidden.shape == (64, 64)


def test_long_strings_and_arrays_are_bounded():
    rejects(pack({"t": "bye", "reason": "x" * (codec.MAX_STR + 1)}), "bad msgpack")
    rejects(pack({"t": "plan", "sources": ["a"] * (codec.MAX_ARRAY + 1)}), "bad msgpack")


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(TypeError):
        encode(CAPS)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float64"):
        to_wire(torch.zeros(2, dtype=torch.float64))
