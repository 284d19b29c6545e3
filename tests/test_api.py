"""The HTTP API of a single-node meshd, through a real in-process server on loopback:
completions and chat, streamed and whole, n, seeds, stop strings, max_tokens, the models,
health and status endpoints, and sessions freed when a client goes. (What it refuses,
and how, is tests/test_api_validation.py.)

Single-node output is the reference of the whole project, so greedy answers are checked
token for token against ``shards.engine.generate_greedy`` run directly on the same model
directory. One server (tiny random model) serves the whole module; the real model gets
one test of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from shards.engine import StageEngine, generate_greedy
from shards.manifest import Manifest
from shards.model import load_stage
from shards.span import Span
from shards.tokenizer import MeshTokenizer
from tests.fixtures.api import PROMPT, assert_still_serves, complete, greedy, sse_events
from tests.fixtures.daemon import running_node

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [PROMPT, "Hello, world!", "Numbers 0123", "Café"]


# -- fixtures and helpers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> MeshTokenizer:
    return MeshTokenizer.load(tiny_model_dir)


@pytest.fixture(scope="module")
def n_layers(tiny_model_dir) -> int:
    return Manifest.load(tiny_model_dir).n_layers


@pytest.fixture(scope="module")
def reference(tiny_model_dir, n_layers):
    """The whole tiny model as one engine of its own, loaded apart from the server's."""
    engine = StageEngine.load(tiny_model_dir, Span(0, n_layers), True, True, "cpu", "float32")
    yield engine
    engine.close()


async def greedy_reference(engine: StageEngine, eos: frozenset[int], prompt_ids: list[int], n: int):
    """What the API should answer at temperature 0: tokens up to the first end-of-sequence
    (which is not sent), and the finish reason."""
    tokens = await asyncio.to_thread(engine.run_sync, lambda: generate_greedy(engine, prompt_ids, n))
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i], "stop"
    return tokens, "length"


# -- completions ---------------------------------------------------------------------------


async def test_completion_is_openai_shaped_and_equals_direct_greedy(tiny_node, client, tokenizer, reference):
    prompt_ids = tokenizer.encode(PROMPT)
    want, want_finish = await greedy_reference(reference, tokenizer.eos_ids, prompt_ids, 24)
    assert len(want) == 24, "the test prompt should run 24 tokens without an end-of-turn"

    before = int(time.time())
    data = await complete(client, tiny_node.url, greedy(max_tokens=24))

    assert data["id"].startswith("cmpl-")
    assert data["object"] == "text_completion"
    assert before - 1 <= data["created"] <= time.time() + 1
    assert data["model"] == tiny_node.node.model_name
    assert len(data["choices"]) == 1
    choice = data["choices"][0]
    assert choice["index"] == 0
    assert choice["token_ids"] == want
    assert choice["text"] == tokenizer.decode(want)
    assert choice["finish_reason"] == want_finish == "length"
    n_prompt = len(prompt_ids)
    assert data["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 24, "total_tokens": n_prompt + 24}


@pytest.mark.parametrize("prompt", PROMPTS[1:])
async def test_greedy_equals_direct_greedy_for_other_prompts(tiny_node, client, tokenizer, reference, prompt):
    want, want_finish = await greedy_reference(reference, tokenizer.eos_ids, tokenizer.encode(prompt), 40)
    choice = (await complete(client, tiny_node.url, greedy(prompt, 40)))["choices"][0]
    assert choice["token_ids"] == want
    assert choice["text"] == tokenizer.decode(want)
    assert choice["finish_reason"] == want_finish


async def test_prompt_as_one_element_list(tiny_node, client, tokenizer):
    a = await complete(client, tiny_node.url, greedy(max_tokens=8))
    b = await complete(client, tiny_node.url, greedy([PROMPT], 8))
    assert b["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]


async def test_chat_completion_uses_chatml_and_answers_as_assistant(tiny_node, client, tokenizer, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a mesh?"}]
    prompt = tokenizer.chat_prompt(messages)
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is a mesh?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    prompt_ids = tokenizer.encode(prompt)
    want, want_finish = await greedy_reference(reference, tokenizer.eos_ids, prompt_ids, 20)

    data = await complete(client, tiny_node.url, {"messages": messages, "max_tokens": 20, "temperature": 0},
                          path="/v1/chat/completions")

    assert data["id"].startswith("chatcmpl-")
    assert data["object"] == "chat.completion"
    assert data["model"] == tiny_node.node.model_name
    choice = data["choices"][0]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tokenizer.decode(want)
    assert choice["token_ids"] == want
    assert choice["finish_reason"] == want_finish
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert data["usage"]["completion_tokens"] == len(want)


async def test_chat_content_parts_form(tiny_node, client):
    plain = [{"role": "user", "content": "hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    body = {"max_tokens": 6, "temperature": 0}
    a = await complete(client, tiny_node.url, body | {"messages": plain}, path="/v1/chat/completions")
    b = await complete(client, tiny_node.url, body | {"messages": parts}, path="/v1/chat/completions")
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


# -- streaming ---------------------------------------------------------------------------


async def test_streamed_completion_equals_whole(tiny_node, client):
    whole = (await complete(client, tiny_node.url, greedy(max_tokens=30)))["choices"][0]
    events = await sse_events(client, tiny_node.url, greedy(max_tokens=30))

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1, "a stream should come in more than one chunk"
    assert "[DONE]" not in chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion"
        assert [ch["index"] for ch in c["choices"]] == [0]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert text == whole["text"]
    assert tokens == whole["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "length"


async def test_streamed_chat_equals_whole(tiny_node, client):
    body = {"messages": [{"role": "user", "content": "Tell me about meshes."}], "max_tokens": 30, "temperature": 0}
    whole = (await complete(client, tiny_node.url, body, path="/v1/chat/completions"))["choices"][0]
    events = await sse_events(client, tiny_node.url, body, path="/v1/chat/completions")

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["id"].startswith("chatcmpl-")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == whole["message"]["content"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


async def test_streamed_n_choices_interleave_and_each_equals_whole(tiny_node, client):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 11, "n": 2}
    whole = await complete(client, tiny_node.url, body)
    events = await sse_events(client, tiny_node.url, body)
    assert events[-1] == "[DONE]"
    for index in (0, 1):
        mine = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == index]
        assert "".join(ch["text"] for ch in mine) == whole["choices"][index]["text"]
        assert mine[-1]["finish_reason"] == whole["choices"][index]["finish_reason"]


# -- sampling ----------------------------------------------------------------------------


def sampled(seed: int | None, n: int = 1, max_tokens: int = 32) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.9, "n": n} | (
        {"seed": seed} if seed is not None else {})


def token_lists(data: dict) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(data["choices"], key=lambda c: c["index"])]


async def test_same_seed_same_answer_different_seed_different(tiny_node, client):
    a = await complete(client, tiny_node.url, sampled(7))
    b = await complete(client, tiny_node.url, sampled(7))
    c = await complete(client, tiny_node.url, sampled(8))
    assert a["choices"] == b["choices"]
    assert token_lists(a) != token_lists(c)


async def test_n_choices_with_seed_are_reproducible_and_distinct(tiny_node, client):
    a = await complete(client, tiny_node.url, sampled(7, n=3))
    b = await complete(client, tiny_node.url, sampled(7, n=3))
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert a["choices"] == b["choices"]
    lists = token_lists(a)
    assert len({tuple(t) for t in lists}) == 3, "three choices should not be the same sample"
    assert a["usage"]["completion_tokens"] == sum(len(t) for t in lists)
    other = await complete(client, tiny_node.url, sampled(1234, n=3))
    assert token_lists(other) != lists


async def test_unseeded_samples_differ(tiny_node, client):
    a = await complete(client, tiny_node.url, sampled(None))
    b = await complete(client, tiny_node.url, sampled(None))
    assert token_lists(a) != token_lists(b)


async def test_greedy_n_gives_identical_choices(tiny_node, client):
    data = await complete(client, tiny_node.url, greedy(max_tokens=10) | {"n": 2})
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["choices"][0]["token_ids"] == data["choices"][1]["token_ids"]


# -- stops and lengths -------------------------------------------------------------------


async def test_stop_string_cuts_text_before_it(tiny_node, client):
    whole = (await complete(client, tiny_node.url, greedy(max_tokens=40)))["choices"][0]["text"]
    # A stop string from the middle of the greedy text, made of plain characters.
    start = next(i for i in range(8, len(whole) - 3) if whole[i:i + 3].isprintable() and "\ufffd" not in whole[i:i + 3])
    stop = whole[start:start + 3]
    want = whole[: whole.find(stop)]

    for body in (greedy(max_tokens=40, stop=stop), greedy(max_tokens=40, stop=["zzzz-never", stop])):
        choice = (await complete(client, tiny_node.url, body))["choices"][0]
        assert choice["text"] == want
        assert stop not in choice["text"]
        assert choice["finish_reason"] == "stop"

    events = await sse_events(client, tiny_node.url, greedy(max_tokens=40, stop=stop))
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_stop_string_never_seen_runs_to_length(tiny_node, client):
    choice = (await complete(client, tiny_node.url, greedy(max_tokens=12, stop="zzzz-never")))["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 12


@pytest.mark.parametrize("max_tokens", [1, 5])
async def test_max_tokens_gives_length_with_exactly_that_many(tiny_node, client, max_tokens):
    data = await complete(client, tiny_node.url, greedy(max_tokens=max_tokens))
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == max_tokens
    assert data["usage"]["completion_tokens"] == max_tokens


async def test_end_of_turn_finishes_with_stop(tiny_node, client, tokenizer, reference):
    """A prompt whose greedy continuation hits <|im_end|>: the answer ends there, "stop",
    without the end-of-turn token in the ids or the text."""
    prompt = "The quick brown fox"
    want, finish = await greedy_reference(reference, tokenizer.eos_ids, tokenizer.encode(prompt), 40)
    assert finish == "stop", "the test prompt should reach an end-of-turn on the tiny model"
    choice = (await complete(client, tiny_node.url, greedy(prompt, 40)))["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == want
    assert "<|im_end|>" not in choice["text"]


# -- models, health, status ---------------------------------------------------------------


async def test_models_lists_the_served_model(tiny_node, client, tiny_model_dir):
    async with client.get(tiny_node.url + "/v1/models") as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [Manifest.load(tiny_model_dir).name]
    assert data["data"][0]["object"] == "model"
    # The listed id is accepted as the model of a request.
    await complete(client, tiny_node.url, greedy(max_tokens=2) | {"model": data["data"][0]["id"]})


async def test_healthz(tiny_node, client):
    async with client.get(tiny_node.url + "/healthz") as resp:
        assert resp.status == 200
        data = await resp.json()
    assert data["ok"] is True
    assert data["node"] == tiny_node.node.node_id


async def test_status_shape_for_one_node(tiny_node, client, n_layers, tiny_model_dir):
    async with client.get(tiny_node.url + "/status") as resp:
        assert resp.status == 200
        status = await resp.json()
    me = tiny_node.node.node_id
    assert status["node"]["id"] == me
    assert status["supernode"] == me
    assert isinstance(status["term"], int) and status["term"] >= 1
    assert status["model"] == Manifest.load(tiny_model_dir).name
    assert status["plan"] == [{"node": me, "start": 0, "stop": n_layers}]
    assert len(status["peers"]) == 1
    peer = status["peers"][0]
    assert {"id", "name", "addr", "role", "device", "vram", "ram", "layers", "state", "rtt_ms"} <= peer.keys()
    assert peer["id"] == me
    assert peer["name"] == "test-node"
    assert peer["addr"] == tiny_node.url.removeprefix("http://")
    assert peer["role"] == "supernode"
    assert peer["device"] == "cpu"
    assert isinstance(peer["vram"], int) and peer["vram"] >= 0
    assert isinstance(peer["ram"], int) and peer["ram"] > 0
    assert peer["layers"] == [0, n_layers]
    assert peer["state"] == "ready"
    assert isinstance(peer["rtt_ms"], (int, float))


# -- sessions and concurrency -------------------------------------------------------------


def leaked(node) -> int:
    """KV sessions on the node's engine that no running generation and no cached prefix
    (a finished session's caches kept for reuse) accounts for."""
    return node.store.engine.sessions - len(node.scheduler.active) - len(node.scheduler.prefix)


async def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on and on"}]}),
])
async def test_client_hanging_up_mid_stream_frees_its_session(tiny_node, path, body, caplog):
    node = tiny_node.node
    assert await wait_until(lambda: not node.scheduler.active and leaked(node) == 0)
    # Long enough that the stream is still running when the client goes.
    request = body | {"max_tokens": 450, "temperature": 0.9, "seed": 3, "stream": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(tiny_node.url + path, json=request)
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: {")
        assert node.scheduler.active, "the stream should still be generating when the client hangs up"
        resp.close()  # drops the connection
    assert await wait_until(lambda: not node.scheduler.active, 10.0), node.scheduler.active
    assert await wait_until(lambda: leaked(node) == 0, 10.0), (node.store.engine.sessions, node.scheduler.prefix.stats())
    # A client hanging up is ordinary: no "Error handling request" traceback in the log.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    async with aiohttp.ClientSession() as http:
        await assert_still_serves(http, tiny_node.url)


async def test_non_streamed_requests_free_their_sessions(tiny_node, client):
    node = tiny_node.node
    await complete(client, tiny_node.url, greedy(max_tokens=4) | {"n": 3})
    assert not node.scheduler.active
    assert leaked(node) == 0
    async with client.get(tiny_node.url + "/status") as resp:
        shown = (await resp.json())["node"]
        assert shown["sessions"] == shown["scheduler"]["prefix_cache"]["entries"]


async def test_concurrent_greedy_requests_equal_each_alone(tiny_node, client):
    alone = [(await complete(client, tiny_node.url, greedy(p, 24)))["choices"][0] for p in PROMPTS]
    together = await asyncio.gather(*(complete(client, tiny_node.url, greedy(p, 24)) for p in PROMPTS))
    assert [d["choices"][0]["token_ids"] for d in together] == [a["token_ids"] for a in alone]
    assert [d["choices"][0]["text"] for d in together] == [a["text"] for a in alone]
    # And mixed with streams and sampling, the greedy ones still do not move.
    mixed = await asyncio.gather(
        *(complete(client, tiny_node.url, greedy(p, 24)) for p in PROMPTS),
        sse_events(client, tiny_node.url, greedy(PROMPT, 24)),
        complete(client, tiny_node.url, sampled(5, n=2)),
    )
    assert [d["choices"][0]["token_ids"] for d in mixed[:4]] == [a["token_ids"] for a in alone]
    streamed = mixed[4]
    assert [t for c in streamed[:-1] for t in c["choices"][0]["token_ids"]] == alone[0]["token_ids"]


# -- the real model ------------------------------------------------------------------------


@pytest.mark.real_model
async def test_real_model_completion_equals_direct_greedy(real_model_dir, tmp_path):
    tok = MeshTokenizer.load(real_model_dir)
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    stage = load_stage(real_model_dir, Span(0, 30), True, True)[0]  # the model as served (Q4_1 kept)
    want = await asyncio.to_thread(generate_greedy, stage, ids, 16)
    assert not set(want) & tok.eos_ids
    async with running_node(real_model_dir, tmp_path / "state") as served:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            data = await complete(http, served.url, {"prompt": prompt, "max_tokens": 16, "temperature": 0})
    choice = data["choices"][0]
    assert choice["token_ids"] == want
    assert choice["text"] == tok.decode(want)
    assert "Paris" in choice["text"]
    assert choice["finish_reason"] == "length"
    assert data["model"] == "smollm2-135m"
