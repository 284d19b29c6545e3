"""The OpenAI API as real clients use it: the official ``openai`` SDK and ``langchain-openai``
against a real in-process server on the real model (SmolLM2-135M), every answer parsed by
the SDK's own types; then forced tool calls and json_schema answers through a stage peer
of a namespaced mesh (tiny model: the grammar alone makes its answers valid).

What is checked is what a user notices: a forced tool call and a structured answer
validate against their schemas, streamed and not; logit_bias -100 bans a token;
penalties change the output as documented; logprobs come in OpenAI's shapes; a field
meshd does not implement is a 400 naming it; a KV refusal is a 503 before any stream.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from shards.tokenizer import MeshTokenizer
from tests.fixtures.daemon import running_node

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.real_model]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ORIGIN = "https://app.example"


class Answer(BaseModel):
    city: str = Field(max_length=12)
    sunny: bool
    rating: int = Field(ge=1, le=5)


ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "sunny": {"type": "boolean"},
                                                  "mood": {"enum": ["good", "bad"]}},
                 "required": ["city", "sunny", "mood"], "additionalProperties": False}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(real_model_dir, tmp_path_factory):
    async with running_node(real_model_dir, tmp_path_factory.mktemp("clients"), cors_origins=(ORIGIN,)) as node:
        yield node


@pytest.fixture(scope="module")
def tok(real_model_dir) -> MeshTokenizer:
    return MeshTokenizer.load(real_model_dir)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def oa(served):
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _args_valid(call, schema: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


# -- tools ---------------------------------------------------------------------------------


async def test_forced_tool_call_validates_whole_and_streamed(oa):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = await oa.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice=named, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _args_valid(call, WEATHER["function"]["parameters"])

    # "required": some tool, streamed; the deltas put together make the same kind of call.
    stream = await oa.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER],
                                              tool_choice="required", temperature=0, max_tokens=60, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


async def test_tool_round_trip_and_tool_choice_none(oa):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = await oa.chat.completions.create(model="smollm2-135m", messages=history, tools=[WEATHER],
                                         tool_choice="none", temperature=0, max_tokens=4)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


async def test_langchain_bind_tools_and_structured_output(served):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=served.url + "/v1", api_key="none", model="smollm2-135m", temperature=0,
                     max_tokens=60, max_retries=0)
    msg = await llm.bind_tools([WEATHER], tool_choice="get_weather").ainvoke("Weather in Tokyo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER["function"]["parameters"])
    for method in ("json_schema", "function_calling"):  # the issue: function_calling returned None
        out = await llm.with_structured_output(Answer, method=method).ainvoke("Describe Lima's weather.")
        assert isinstance(out, Answer) and 1 <= out.rating <= 5, method


# -- structured output -----------------------------------------------------------------------


async def test_json_schema_and_json_object_validate(oa):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    r = await oa.chat.completions.create(model="smollm2-135m", messages=ASK, response_format=fmt,
                                         temperature=0.8, seed=3, max_tokens=60)
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER_SCHEMA)
    stream = await oa.chat.completions.create(model="smollm2-135m", messages=ASK, response_format=fmt,
                                              temperature=0.8, seed=3, max_tokens=60, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == r.choices[0].message.content  # same seed, same answer, streamed or not
    parsed = await oa.chat.completions.parse(model="smollm2-135m", messages=ASK, response_format=Answer,
                                             temperature=0, max_tokens=60)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    obj = await oa.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=40, temperature=0,
                                           response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)


# -- sampling fields ---------------------------------------------------------------------------


async def test_logprobs_in_openai_shapes(oa, tok):
    r = await oa.chat.completions.create(model="smollm2-135m", messages=ASK, logprobs=True, top_logprobs=3,
                                         temperature=0, max_tokens=6)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy takes the top one
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == r.choices[0].message.content

    c = await oa.completions.create(model="smollm2-135m", prompt="The capital of France is", logprobs=2,
                                    max_tokens=5, temperature=0, echo=False)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    stream = await oa.completions.create(model="smollm2-135m", prompt="The capital of France is", logprobs=2,
                                         max_tokens=5, temperature=0, stream=True)
    streamed = [t async for ch in stream for t in (ch.choices[0].logprobs.tokens if ch.choices and
                                                   ch.choices[0].logprobs else [])]
    assert streamed == lp.tokens


async def test_logit_bias_bans_a_token(oa, tok):
    prompt = "The capital of France is"
    plain = await oa.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0)
    first = plain.model_extra["choices"][0]["token_ids"][0] if plain.model_extra.get("choices") else None
    first = first if first is not None else tok.encode(plain.choices[0].text)[0]
    banned = await oa.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0,
                                         logit_bias={str(first): -100})
    assert tok.decode([first]) in plain.choices[0].text
    ids = tok.encode(banned.choices[0].text)
    assert first not in ids and banned.choices[0].text != plain.choices[0].text


async def test_penalties_change_output_as_documented(oa, tok):
    prompt = "one two one two one two one two"
    kw = dict(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0)
    plain = (await oa.completions.create(**kw)).choices[0].text
    freq = (await oa.completions.create(**kw, frequency_penalty=2.0)).choices[0].text
    rep = (await oa.completions.create(**kw, extra_body={"repetition_penalty": 1.5})).choices[0].text

    def most_repeated(text: str) -> int:
        ids = tok.encode(text)
        return max(ids.count(t) for t in set(ids))

    assert most_repeated(freq) < most_repeated(plain), (plain, freq)
    assert rep != plain
    # top_k 1 is greedy at any temperature; min_p 1 keeps only the top token too.
    greedy = plain
    assert (await oa.completions.create(**(kw | {"temperature": 1.5}), seed=1,
                                        extra_body={"top_k": 1})).choices[0].text == greedy
    assert (await oa.completions.create(**(kw | {"temperature": 1.5}), seed=2,
                                        extra_body={"min_p": 1.0})).choices[0].text == greedy


async def test_batch_prompts_with_n_and_echo(oa, tok):
    prompts = ["The capital of France is", "One, two,"]
    r = await oa.completions.create(model="smollm2-135m", prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.choices[0].text != r.choices[2].text
    assert r.usage.prompt_tokens == 2 * sum(len(tok.encode_prompt(p)) for p in prompts)
    ids = tok.encode_prompt(prompts[0])
    by_ids = await oa.completions.create(model="smollm2-135m", prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.choices[0].text] * 2
    single = await oa.completions.create(model="smollm2-135m", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert single.choices[0].text == prompts[0] + r.choices[0].text


# -- refusals --------------------------------------------------------------------------------------


async def test_unimplemented_fields_are_400s_naming_them(oa, served):
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    cases = [
        (dict(messages=image), "messages"),
        (dict(messages=ASK, audio={"voice": "alloy", "format": "wav"}), "audio"),
        (dict(messages=ASK, modalities=["text", "audio"]), "modalities"),
        (dict(messages=ASK, response_format={"type": "grammar"}), "response_format.type"),
        (dict(messages=ASK, extra_body={"frobnicate": 1}), "frobnicate"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            await oa.chat.completions.create(model="smollm2-135m", max_tokens=4, **kwargs)
        assert err.value.body["param"] == param, (param, err.value.body)
        assert param.split(".")[0] in err.value.body["message"] or "image_url" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        await oa.completions.create(model="smollm2-135m", prompt="word " * 9000)
    assert err.value.code == "context_length_exceeded"
    # nulls the spec allows; no max_tokens means the rest of the context (here: until the model ends).
    async with aiohttp.ClientSession() as http:
        body = {"model": None, "stream": None, "messages": ASK, "max_tokens": 3, "temperature": 0, "seed": None}
        async with http.post(served.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        raw = b'{"prompt": "hi \\ud800 there", "max_tokens": 2}'
        async with http.post(served.url + "/v1/completions", data=raw,
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"


async def test_kv_refusal_is_a_503_before_the_stream(oa, served):
    scheduler = served.node.scheduler
    budget = scheduler.kv_budget_tokens
    scheduler.kv_budget_tokens = 8
    try:
        with pytest.raises(openai.InternalServerError) as err:
            await oa.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4, stream=True)
        assert err.value.status_code == 503
    finally:
        scheduler.kv_budget_tokens = budget
    assert not scheduler.active and scheduler.reserved_tokens == 0


# -- the small endpoints, CORS, request ids, hang-ups --------------------------------------------


async def test_cors_health_tokenize_models_and_request_ids(oa, served, tok):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    async with aiohttp.ClientSession() as http:
        async with http.options(served.url + "/v1/chat/completions", headers=preflight) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "authorization" in r.headers["Access-Control-Allow-Headers"]
        async with http.options(served.url + "/v1/chat/completions",
                                headers=preflight | {"Origin": "https://evil.example"}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        async with http.options(served.url + "/v1/mesh/drain", headers=preflight) as r:
            assert r.status == 403  # control endpoints: no origin unless cors_mesh_origins says so
        async with http.get(served.url + "/health", headers={"Origin": ORIGIN, "X-Request-Id": "trace-42"}) as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
            assert r.headers["Access-Control-Allow-Origin"] == ORIGIN and r.headers["X-Request-Id"] == "trace-42"
        async with http.post(served.url + "/tokenize", json={"prompt": "Hello there"}) as r:
            data = await r.json()
            assert data["tokens"] == tok.encode_prompt("Hello there") and data["max_model_len"] == 8192
        async with http.post(served.url + "/detokenize", json={"tokens": data["tokens"]}) as r:
            assert "Hello there" in (await r.json())["prompt"]
        async with http.post(served.url + "/tokenize", json={"messages": ASK}) as r:
            assert (await r.json())["tokens"] == tok.encode_chat(ASK)
        # a client that hangs up mid-stream is counted as 499, not as a server error
        body = {"messages": ASK, "max_tokens": 200, "stream": True}
        async with http.post(served.url + "/v1/chat/completions", json=body) as r:
            await r.content.readline()
        for _ in range(100):
            async with http.get(served.url + "/metrics") as r:
                metrics = await r.text()
            if 'status="499"' in metrics:
                break
            await asyncio.sleep(0.1)
        assert 'status="499"' in metrics and 'status="500"' not in metrics
    m = await oa.models.retrieve("smollm2-135m")
    assert m.id == "smollm2-135m" and m.model_extra["context_length"] == 8192
    raw = await oa.chat.completions.with_raw_response.create(model="smollm2-135m", messages=ASK, max_tokens=1)
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.parse().system_fingerprint.startswith("fp_")
