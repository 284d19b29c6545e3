"""Tool calls in the supported families' formats: parsed back into OpenAI calls (whole and as
a stream goes), and forced by a grammar whose every sentence parses as a valid call."""

from __future__ import annotations

import json

import pytest
import torch

from meshd.serving import toolcalls
from meshd.serving.toolcalls import HERMES, LLAMA3, MISTRAL, CallParser, call_grammar, parse_calls, tool_format
from shards.grammar import Constraint
from shards.sampling import Sampler, SamplingParams
from shards.tokenizer import MeshTokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}}, "required": ["city"]}}}


@pytest.mark.parametrize("fmt, text", [
    (HERMES, 'I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
])
def test_each_format_parses_to_an_openai_call(fmt, text):
    content, calls = parse_calls(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content.strip() in ("", "I will look.")
    # streamed in small pieces: the same call, and no tag leaks into the content
    parser, got, text_out = CallParser(fmt), [], ""
    for i in range(0, len(text), 3):
        piece, more = parser.push(text[i:i + 3])
        text_out, got = text_out + piece, got + more
    piece, more = parser.end()
    assert [c.name for c in got + more] == ["get_weather"] and "<tool_call>" not in text_out + piece


def test_plain_text_stays_content():
    for fmt in (HERMES, LLAMA3, MISTRAL):
        assert parse_calls(fmt, "Paris is sunny {really}.") == ("Paris is sunny {really}.", [])
    assert parse_calls(HERMES, "<tool_call>\nnot json\n</tool_call>")[1] == []


@pytest.mark.parametrize("fmt, text", [
    pytest.param(HERMES, "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>", id="hermes-call"),
    pytest.param(HERMES, '<tool_call>\n{"name": "f", "arguments": "' + "[" * 100_000 + '"}\n</tool_call>',
                 id="hermes-arguments-string"),
    pytest.param(LLAMA3, "[" * 100_000, id="llama3"),
    pytest.param(MISTRAL, "[TOOL_CALLS]" + "[" * 100_000, id="mistral"),
])
def test_brackets_past_the_parsers_depth_are_text_not_a_crash(fmt, text):
    """A model (or a client's resume) that writes more brackets than Python's JSON parser
    recurses through: no call, the text stays content, streamed or whole."""
    content, calls = parse_calls(fmt, text)
    assert calls == [] and "[[[" in content
    parser = CallParser(fmt)
    streamed = [parser.push(text[i:i + 4096]) for i in range(0, len(text), 4096)] + [parser.end()]
    assert [c for _, more in streamed for c in more] == [] and "[[[" in "".join(t for t, _ in streamed)


def test_format_comes_from_the_template():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert tool_format("[TOOL_CALLS]") == MISTRAL
    assert tool_format("<|python_tag|>") == LLAMA3
    assert tool_format(None) == HERMES


def test_forced_call_grammar_makes_random_logits_a_valid_call(tiny_model_dir):
    tok = MeshTokenizer.load(tiny_model_dir)
    g = call_grammar(HERMES, [TOOL], parallel=False)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=4, grammar=g), Constraint(tok, g), tok.eos_ids)
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(200):
        t = sampler.next(torch.randn(tok.vocab_size, generator=gen) * 3, step)
        if t in tok.eos_ids:
            break
        out.append(t)
    content, calls = parse_calls(HERMES, tok.decode(out))
    assert len(calls) == 1 and json.loads(calls[0].arguments)["city"] in ("Paris", "Lima"), tok.decode(out)


def test_forced_call_schemas_are_closed_where_they_say_nothing():
    """A forced call holds the declared parameters: objects that list properties and say
    nothing of others are closed (a 135M model under an open mask invented keys until
    max_tokens, and LangChain's function_calling got None); explicit choices stand."""
    params = {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {}, "additionalProperties": True},
    }, "$defs": {"D": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    out = toolcalls.closed(params)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["extra"]["additionalProperties"] is True
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in params  # the client's schema is left as it was
