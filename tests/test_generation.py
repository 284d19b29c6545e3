"""A choice's chunks as frames (``generation.ChoiceDeltas``) and the frames as the client's
answer (``edge.Edge``), on their own: an echoed long prompt's logprobs split over frames
the wire can carry and put back whole by the edge, and tool calls going on after a
resubmission's history (their index counting on, the finish still tool_calls)."""

from __future__ import annotations

from meshd.serving import toolcalls
from meshd.serving.edge import Edge
from meshd.serving.generation import PROMPT_LOGPROBS_PER_DELTA, ChoiceDeltas
from meshd.serving.openai import CompletionRequest, ToolSpec
from protocol import generate as gen
from protocol.codec import decode_of, encode
from shards.sampling import SamplingParams, TokenLogprobs


def text_of(token: int) -> tuple[str, bytes]:
    raw = f"t{token} ".encode()
    return raw.decode(), raw


def test_a_long_echoed_prompts_logprobs_travel_in_frames_the_wire_takes_and_come_out_whole():
    prompt = tuple(range(1, 2 * PROMPT_LOGPROBS_PER_DELTA + 300))
    req = CompletionRequest(False, "m", (prompt,), SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=2), 1,
                            True, echo=True, prompt_texts=("the prompt",))
    writer = ChoiceDeltas(req, 0, text_of, echo="the prompt")
    scores = [TokenLogprobs(t, -1.5, ((t, -1.5), (0, -2.0))) for t in prompt[1:]]
    frames = writer.deltas(" out", (7,), (TokenLogprobs(7, -0.5, ((7, -0.5),)),), None, scores)
    assert len(frames) == 3 and all(len(f.prompt_logprobs) <= PROMPT_LOGPROBS_PER_DELTA for f in frames)
    assert [f.text for f in frames] == ["", "", "the prompt out"] and frames[-1].token_ids == (7,)
    # each goes through the codec as the tunnel carries it, and the edge puts them together
    edge = Edge(chat=False, cid="cmpl-x")
    edge.begin(gen.Begin("m", "fp", logprobs=1))
    chunks = [edge.delta(decode_of(encode(f, gen.OUTPUT_TYPES), gen.OUTPUT_TYPES)) for f in frames]
    assert all(c is not None for c in chunks)
    choice = edge.whole()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "the prompt out" and choice["token_ids"] == [7]
    assert lp["tokens"] == [text_of(t)[0] for t in prompt] + ["t7 "]
    assert lp["token_logprobs"] == [None] + [-1.5] * (len(prompt) - 1) + [-0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"t2 ": -1.5, "t0 ": -2.0}
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_tool_calls_after_a_resubmissions_history_count_on_and_end_as_tool_calls():
    tools = ToolSpec(({"type": "function", "function": {"name": "f", "parameters": {}}},), "auto",
                     fmt=toolcalls.HERMES)
    req = CompletionRequest(True, "m", ((1, 2),), SamplingParams(max_tokens=64), 1, True, tools=tools)
    call = '<tool_call>{"name": "f", "arguments": {"x": %d}}</tool_call>'
    # The first supernode streamed one call before it was lost; the next one goes on.
    writer = ChoiceDeltas(req, 0, text_of, resumed_text=call % 1)
    d = writer.deltas(call % 2, (9,), (), None)[0]
    end = writer.deltas("", (), (), "stop")[0]
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [(1, "f", '{"x": 2}')]
    assert end.finish is gen.Finish.TOOL_CALLS
    # A history with a call and nothing more: the answer still ends as tool_calls.
    writer = ChoiceDeltas(req, 0, text_of, resumed_text=call % 1)
    assert writer.deltas("", (), (), "stop")[0].finish is gen.Finish.TOOL_CALLS


def test_a_history_and_an_echo_past_the_link_messages_bounds_travel():
    """Strings and lists of these frames are bounded by the frame's size, not by the link
    messages' 64 KiB and 4096 items: a long answer's history and a long echo go through."""
    history = gen.Generate(gen.Request(0, prompts=(gen.Prompt("x" * 100_000),)), (gen.History(tuple(range(50_000))),))
    assert decode_of(encode(history, gen.REQUEST_TYPES), gen.REQUEST_TYPES, 1 << 20) == history
    echo = gen.Delta(0, "x" * 300_000, tool_calls=(gen.ToolCallDelta(0, "c", "f", "y" * 100_000),))
    assert decode_of(encode(echo, gen.OUTPUT_TYPES), gen.OUTPUT_TYPES, gen.MAX_OUTPUT_FRAME) == echo
