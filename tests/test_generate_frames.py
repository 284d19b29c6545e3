"""The frames a completion travels in between the entry peer and the supernode
(``protocol.generate``): each comes back as it went, whatever pieces the body arrives
in, and anything off (a value out of bounds, an act nobody knows, a frame cut short or
announced too long) is a ProtocolError, never a value meshd goes on with."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest

from protocol import generate as gen
from protocol.codec import decode_of, encode
from protocol.errors import ProtocolError

LP = gen.TokenLogprob(17, " the", b" the", -0.25, (gen.TopLogprob(17, " the", b" the", -0.25),
                                                   gen.TopLogprob(9, "\ufffd", b"\xe2\x80", -3.5)))
OUTPUTS = [
    gen.Begin("smollm2-135m", "fp_0123456789ab", logprobs=1),
    gen.Delta(0, "Hello", (15496,), (LP,), (gen.TokenLogprob(1, "<s>", b"<s>", scored=0), LP),
              (gen.ToolCallDelta(0, "call_1", "get_weather", '{"city": "Oslo"}'),), gen.Finish.TOOL_CALLS),
    gen.Delta(3),
    gen.Usage(12, 40),
    gen.Failure(gen.Act.MOVED, 503, "this peer yielded", code="supernode_changed"),
    gen.Keepalive(),
    gen.End(),
]


def run(coro):
    return asyncio.run(coro)


async def _pieces(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def _frames(data: bytes, size: int, max_size: int = gen.MAX_OUTPUT_FRAME) -> list[bytes]:
    return [f async for f in gen.read_frames(_pieces(data, size), max_size)]


@pytest.mark.parametrize("piece", [1, 3, 7, 4096])
def test_frames_come_back_as_they_went_in_any_pieces(piece):
    body = b"".join(gen.frame(encode(f, gen.OUTPUT_TYPES)) for f in OUTPUTS)
    got = [decode_of(d, gen.OUTPUT_TYPES) for d in run(_frames(body, piece))]
    assert got == OUTPUTS


def test_a_request_with_its_history_comes_back_as_it_went():
    turns = (gen.Turn("system", "Be brief."), gen.Turn("assistant", no_content=1, calls=1,
                                                        tool_calls=(gen.Call("c1", "f", '{"x": 1}'),)),
             gen.Turn("tool", "42", tool_call_id="c1"))
    asked = gen.Request(1, "m", turns, tools=(gen.Tool("f", "", '{"type": "object"}'),), tool_choice="auto",
                        n=2, max_tokens=-3, top_k=-1, seed=-2**63, seeded=1, stop=("\n",),
                        logit_bias=(gen.Bias(5, -100.0),), temperature=0.5)
    req = gen.Generate(asked, (gen.History((1, 2, 3)), gen.History()), (1,))
    assert decode_of(encode(req, gen.REQUEST_TYPES), gen.REQUEST_TYPES) == req
    with pytest.raises(TypeError):  # an answer's frame is not a request
        encode(gen.End(), gen.REQUEST_TYPES)


def test_a_body_cut_inside_a_frame_or_a_frame_announced_too_long_is_refused():
    body = gen.frame(encode(OUTPUTS[1], gen.OUTPUT_TYPES))
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        run(_frames(body[:-1], 5))
    with pytest.raises(ProtocolError, match="over the limit"):  # refused on its length, before its bytes
        run(_frames(body[:4], 4, max_size=16))


def _tampered(frame: gen.Output, **changes) -> bytes:
    fields = msgpack.unpackb(encode(frame, gen.OUTPUT_TYPES))
    fields.update(changes)
    return msgpack.packb(fields)


@pytest.mark.parametrize("data, match", [
    (_tampered(gen.Failure(gen.Act.FAIL, 400, "x"), act=9), "no Act member"),
    (_tampered(gen.Failure(gen.Act.FAIL, 400, "x"), status=600), "outside"),
    (_tampered(gen.Delta(0), finish=7), "no Finish member"),
    (_tampered(gen.Delta(0), token_ids=[1, -2]), "outside"),
    (_tampered(gen.Delta(0), choice="0"), "expected int"),
    (_tampered(gen.Delta(0, logprobs=(LP,)), logprobs=[dict(msgpack.unpackb(encode(gen.Delta(0, logprobs=(LP,)),
                                                                                  gen.OUTPUT_TYPES))["logprobs"][0],
                                                          logprob=math.nan)]), "finite"),
    (_tampered(gen.End(), t="ping"), "unknown message tag"),  # a link message is not an answer's frame
])
def test_a_frame_out_of_bounds_is_a_protocol_error(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_of(data, gen.OUTPUT_TYPES)


def test_finish_reasons_are_openais():
    assert [f.reason for f in gen.Finish] == [None, "stop", "length", "tool_calls"]
    assert all(gen.Finish.of(f.reason) is f for f in gen.Finish)
