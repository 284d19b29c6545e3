"""Tools and structured output through a stage peer of a namespaced mesh: the entry peer
proxies to the supernode, whose scheduler applies the grammar's mask where it samples.
The tiny random model writes nonsense, so only the mask makes its answers valid."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.test_openai_clients import ANSWER_SCHEMA

pytestmark = [pytest.mark.netns, pytest.mark.xdist_group("tiny_mesh")]  # one four-daemon mesh for all three

# Small: the tiny model's context is 512 tokens of a byte-level vocabulary.
WEATHER = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"c": {"enum": ["P", "L"]}}, "required": ["c"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Sky in P?"}]


def test_forced_tool_call_and_json_schema_through_a_stage_peer(tiny_mesh):
    view = tiny_mesh.daemons[2].status()
    entry = next(d for d in tiny_mesh.daemons[1:] if d.node_id != view["supernode"])
    client = openai.OpenAI(base_url=entry.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "wx"}}
    # No max_tokens: the rest of the context; the grammar ends the answer after the call.
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                       temperature=0.9, seed=5, logprobs=True)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "wx" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens

    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                            temperature=0.9, seed=5, stream=True)
    args = "".join(d.function.arguments or "" for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ())
    assert json.loads(args) == json.loads(call.function.arguments)  # same seed: the same call, streamed

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=model, messages=ASK, response_format=fmt, temperature=0.9,
                                           seed=7)
    jsonschema.validate(json.loads(whole.choices[0].message.content), ANSWER_SCHEMA)
    stream = client.chat.completions.create(model=model, messages=ASK, response_format=fmt, temperature=0.9,
                                            seed=7, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
