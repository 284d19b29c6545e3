"""Whatever a client sends, the API answers as OpenAI's does: valid bodies with one value
replaced by any JSON (NaN, huge integers, deep lists, lone surrogates, wrong types), a
field dropped, or a field added. Never a 5xx; a 4xx has OpenAI's error shape; a 200 is
a whole answer (a stream ends with ``[DONE]``, every event JSON); and the node still
serves afterwards. Through a real in-process server on loopback (tiny model)."""

from __future__ import annotations

import json

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.api import PROMPT, assert_error_body, assert_still_serves
from tests.mutate import at, paths, replaced

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
COMPLETION = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 7, "stop": ["\n\n"],
              "n": 2, "logprobs": 2, "stream": False, "logit_bias": {"11": 5}, "presence_penalty": 0.5,
              "frequency_penalty": 0.1, "user": "fuzz", "min_tokens": 1, "echo": False}
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a mesh?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": "{\"city\": \"Lima\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                     {"role": "user", "content": [{"type": "text", "text": "And now?"}]}],
        "max_completion_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        "tools": [TOOL], "tool_choice": "auto", "logprobs": True, "top_logprobs": 2, "seed": 3,
        "n": 1, "stop": "zzz"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name"]}
CHAT_JSON = {"messages": [{"role": "user", "content": "A person, as JSON."}], "max_tokens": 6, "temperature": 0,
             "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
BODIES = {("/v1/completions", "plain"): COMPLETION, ("/v1/chat/completions", "tools"): CHAT,
          ("/v1/chat/completions", "schema"): CHAT_JSON,
          ("/tokenize", "prompt"): {"prompt": PROMPT, "add_special_tokens": False},
          ("/tokenize", "messages"): {"messages": CHAT["messages"], "tools": [TOOL]},
          ("/detokenize", "tokens"): {"tokens": [1, 2, 3]}}
BATCH_FILE = "FILE"  # the id of a file uploaded for the module's batches (``uploaded``)
CREATE = {"input_file_id": BATCH_FILE, "endpoint": "/v1/completions", "completion_window": "24h",
          "metadata": {"k": "v"}}
ANSWERS = ("/v1/completions", "/v1/chat/completions")  # whose 200 is a list of choices

# Values a parser or int() may choke on, and values of every JSON type.
AWKWARD = ["\ud800", "\u00b2", "1" * 5000, "", "0", "-1", "11", "NaN", "system", "user", "auto", "none", "json_object",
           "json_schema", "function", "text", "[" * 3000, '{"city": ' + "[" * 3000, None, True, 0, -1, 2**70, 1e308,
           float("nan"), float("inf"), [], {}, [[[]]], {"": None}]
keys = st.text(max_size=8) | st.sampled_from([k for k in AWKWARD if isinstance(k, str)])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
    | st.sampled_from(AWKWARD),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12)


@st.composite
def requests(draw) -> tuple[str, dict]:
    key = draw(st.sampled_from(sorted(BODIES)))
    path, body = key[0], BODIES[key]
    where = draw(st.sampled_from([p for p in paths(body) if p]))
    kind = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
    parent = at(body, where[:-1])
    if kind == "drop" and isinstance(parent, dict):
        return path, replaced(body, where[:-1], {k: v for k, v in parent.items() if k != where[-1]})
    if kind == "add" and isinstance(parent, dict):
        return path, replaced(body, where[:-1], parent | {draw(keys): draw(json_values)})
    return path, replaced(body, where, draw(json_values))


async def _problem(client, url: str, path: str, body: dict) -> str | None:
    """What is wrong with the answer to ``body``, or None."""
    raw = json.dumps(body).encode("utf-8", "surrogatepass")  # NaN, Infinity and lone surrogates as a client may send
    async with client.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as resp:
        text = await resp.text(errors="replace")
        if resp.status >= 500 and resp.status != 503:
            return f"HTTP {resp.status}: {text[:300]}"
        if resp.status != 200:
            try:
                assert_error_body(json.loads(text))
            except (AssertionError, ValueError):
                return f"HTTP {resp.status} without OpenAI's error shape: {text[:300]}"
            return None
        if resp.content_type == "text/event-stream":
            events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return f"a stream that does not end with [DONE]: {text[-300:]}"
            if any("error" in json.loads(e) for e in events[:-1]):
                return f"a 200 stream with an error in it: {text[-300:]}"  # a 200 is never a cut-short answer
            return None
        answer = json.loads(text)
        if path not in ANSWERS:
            return None
        if not answer["choices"] or any(c["finish_reason"] not in ("stop", "length", "tool_calls")
                                        for c in answer["choices"]):
            return f"a 200 that is not a whole answer: {text[:300]}"
        return None


def _variants(bodies: dict):
    """Each field of each body replaced by each awkward value, and each awkward key added to each object."""
    for (path, _), body in bodies.items():
        for where in paths(body):
            parent = at(body, where)
            if where:
                for value in AWKWARD:
                    yield path, replaced(body, where, value)
            if isinstance(parent, dict):
                for key in AWKWARD:
                    if isinstance(key, str):
                        yield path, replaced(body, where, parent | {key: 1})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def uploaded(tiny_node, client) -> dict:
    """BODIES and a batch's creation, on an input file of one short line uploaded here."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", json.dumps(line).encode() + b"\n", filename="in.jsonl")
    async with client.post(tiny_node.url + "/v1/files", data=form) as resp:
        assert resp.status == 200, await resp.text()
        file_id = (await resp.json())["id"]
    return BODIES | {("/v1/batches", "create"): CREATE | {"input_file_id": file_id}}


async def test_the_valid_bodies_are_served(tiny_node, client, uploaded):
    for (path, _), body in uploaded.items():
        async with client.post(tiny_node.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()


async def test_every_field_with_every_awkward_value_is_an_answer_or_an_openai_error(tiny_node, client, uploaded):
    problems = []
    for path, body in _variants(uploaded):
        if (problem := await _problem(client, tiny_node.url, path, body)) is not None:
            problems.append((problem, json.dumps(body)[:300]))
    assert not problems, f"{len(problems)} bad answers, the first: {problems[:5]}"


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests())
async def test_any_body_is_an_answer_or_an_openai_error_never_a_5xx(tiny_node, client, request):
    path, body = request
    assert await _problem(client, tiny_node.url, path, body) is None


async def test_the_node_still_serves_after_the_fuzzing(tiny_node, client):
    await assert_still_serves(client, tiny_node.url)
