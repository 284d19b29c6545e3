"""What the HTTP API refuses, and how: every bad request is a 4xx with OpenAI's JSON
error shape naming the parameter at fault, and the node goes on serving; a node that
cannot serve (no model, or its KV budget full) answers 503 and says why. Through a real
in-process server on loopback (tiny model)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
import pytest

from shards.layers import KVCache
from shards.tokenizer import MeshTokenizer
from tests.fixtures.api import PROMPT, assert_error_body, assert_still_serves, complete, greedy, post
from tests.fixtures.daemon import running_node

pytestmark = pytest.mark.asyncio(loop_scope="module")


# -- bad input ----------------------------------------------------------------------------


BAD_COMPLETIONS = [
    pytest.param({"max_tokens": 4}, 400, "prompt", id="missing-prompt"),
    pytest.param({"prompt": "", "max_tokens": 4}, 400, "prompt", id="empty-prompt"),
    pytest.param({"prompt": 42}, 400, "prompt", id="prompt-not-string"),
    pytest.param({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", id="max-tokens-0"),
    pytest.param({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", id="max-tokens-negative"),
    pytest.param({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens", id="max-tokens-huge"),
    pytest.param({"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", id="max-tokens-beyond-context"),
    pytest.param({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", id="max-tokens-float"),
    pytest.param({"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens", id="max-tokens-string"),
    pytest.param({"prompt": "hi", "max_tokens": True}, 400, "max_tokens", id="max-tokens-bool"),
    pytest.param({"prompt": "hi", "temperature": 5}, 400, "temperature", id="temperature-5"),
    pytest.param({"prompt": "hi", "temperature": -0.1}, 400, "temperature", id="temperature-negative"),
    pytest.param({"prompt": "hi", "temperature": float("nan")}, 400, "temperature", id="temperature-nan"),
    pytest.param({"prompt": "hi", "top_p": float("nan")}, 400, "top_p", id="top-p-nan"),
    pytest.param({"prompt": "hi", "top_p": 0}, 400, "top_p", id="top-p-0"),
    pytest.param({"prompt": "hi", "n": 0}, 400, "n", id="n-0"),
    pytest.param({"prompt": "hi", "n": 100}, 400, "n", id="n-100"),
    pytest.param({"prompt": "hi", "seed": "x"}, 400, "seed", id="seed-string"),
    pytest.param({"prompt": "hi", "stop": 3}, 400, "stop", id="stop-not-string"),
    pytest.param({"prompt": "hi", "stop": [""]}, 400, "stop", id="stop-empty"),
    pytest.param({"prompt": "hi", "stream": "yes"}, 400, "stream", id="stream-not-bool"),
    pytest.param({"prompt": "hi", "model": "gpt-4"}, 404, "model", id="unknown-model"),
    pytest.param({"prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens", id="echo-max-tokens-negative"),
    pytest.param({"prompt": "hi", "echo": True, "logprobs": 6}, 400, "logprobs", id="echo-logprobs-6"),
    pytest.param({"prompt": "hi", "echo": "yes", "logprobs": 1}, 400, "echo", id="echo-not-bool"),
    pytest.param({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens", id="min-tokens-negative"),
    pytest.param({"prompt": "hi", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens", id="min-tokens-over-max"),
    pytest.param({"prompt": "hi", "min_tokens": 1.5}, 400, "min_tokens", id="min-tokens-float"),
    pytest.param({"prompt": "hi", "min_tokens": 10**6}, 400, "min_tokens", id="min-tokens-beyond-context"),
    pytest.param({"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", id="ignore-eos-not-bool"),
    # A digit int() refuses ("²".isdigit() is true), and one past Python's 4300-digit limit.
    pytest.param({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias", id="logit-bias-superscript"),
    pytest.param({"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias", id="logit-bias-5000-digits"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
async def test_bad_completion_is_a_4xx_json_error(tiny_node, client, body, status, param):
    got, data = await post(client, tiny_node.url, body)
    assert got == status, data
    assert_error_body(data, param)
    await assert_still_serves(client, tiny_node.url)


@pytest.mark.parametrize("body,param", [
    pytest.param({"max_tokens": 4}, "messages", id="messages-missing"),
    pytest.param({"messages": []}, "messages", id="messages-empty"),
    pytest.param({"messages": "hello"}, "messages", id="messages-not-list"),
    pytest.param({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", id="bad-role"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}],
                  "tools": [{"type": "function", "function": {"name": "f", "description": {"x": 1}}}]},
                 "tools[0].function.description", id="tool-description-not-string"),
    pytest.param({"messages": [{"content": "hi"}]}, "messages", id="no-role"),
    pytest.param({"messages": [{"role": "user", "content": 7}]}, "messages", id="content-not-string"),
    pytest.param({"messages": ["hi"]}, "messages", id="message-not-object"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "min_tokens": 4},
                 "min_tokens", id="min-tokens-over-max-completion-tokens"),
    pytest.param({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo", id="echo-on-chat"),
    # Nested past the JSON parser's recursion, inside a string the body's depth check cannot see.
    pytest.param({"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                                   "name": "f", "arguments": "[" * 100_000}}]}]}, "messages", id="tool-arguments-deep"),
])
async def test_bad_chat_is_a_400_json_error(tiny_node, client, body, param):
    got, data = await post(client, tiny_node.url, body, path="/v1/chat/completions")
    assert got == 400, data
    assert_error_body(data, param)
    await assert_still_serves(client, tiny_node.url)


@pytest.mark.parametrize("raw", [
    pytest.param(b'{"prompt": "hi", ', id="truncated"),
    pytest.param(b"not json at all", id="not-json"),
    pytest.param(b"\xff\xfe\x00garbage", id="not-utf8"),
    pytest.param(b"", id="empty"),
    pytest.param(b'["prompt", "hi"]', id="array"),
    pytest.param(b'"just a string"', id="string"),
    pytest.param(b"null", id="null"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_malformed_body_is_a_400(tiny_node, client, raw, path):
    got, data = await post(client, tiny_node.url, None, raw=raw, path=path)
    assert got == 400, data
    assert_error_body(data)
    await assert_still_serves(client, tiny_node.url)


@pytest.mark.parametrize("path,param", [
    pytest.param("/live?since=%C2%B2", "since", id="live-since-superscript"),
    pytest.param("/traces?limit=%C2%B9", "limit", id="traces-limit-superscript"),
    pytest.param("/v1/batches?limit=%C2%B2", "limit", id="batches-limit-superscript"),
    pytest.param("/v1/files?limit=1" + "0" * 5000, "limit", id="files-limit-5000-digits"),
])
async def test_a_query_number_int_refuses_is_a_400(tiny_node, client, path, param):
    """Digits Python's isdigit() takes and int() does not ("²"), or too many of them."""
    async with client.get(tiny_node.url + path) as resp:
        assert resp.status == 400, await resp.text()
        assert param in (await resp.json())["error"]["message"]
    await assert_still_serves(client, tiny_node.url)


async def test_ten_megabyte_body_is_a_413(tiny_node, client):
    body = json.dumps({"prompt": "x" * (10 * 1024 * 1024)}).encode()
    got, data = await post(client, tiny_node.url, None, raw=body)
    assert got == 413, data
    assert_error_body(data)
    await assert_still_serves(client, tiny_node.url)


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("GET", "/nope")])
async def test_unknown_path_is_a_404(tiny_node, client, method, path):
    async with client.request(method, tiny_node.url + path) as resp:
        assert resp.status == 404
        assert_error_body(await resp.json())
    await assert_still_serves(client, tiny_node.url)


async def test_wrong_method_is_a_405(tiny_node, client):
    async with client.get(tiny_node.url + "/v1/completions") as resp:
        assert resp.status == 405
        assert_error_body(await resp.json())


# -- a node that cannot serve ---------------------------------------------------------------


async def test_node_without_its_model_answers_503_and_says_why(tmp_path):
    """A daemon pointed at a model it does not have: up, but not serving, and it says so
    everywhere a user looks (healthz, status, completions, meshctl)."""
    missing = tmp_path / "no-such-model"
    async with running_node(missing, tmp_path / "state", ready=False) as served:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async def status() -> dict:
                async with http.get(served.url + "/status") as resp:
                    assert resp.status == 200
                    return await resp.json()

            deadline = time.monotonic() + 20
            while "no model" not in str((st := await status())["reason"]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert st["serving"] is False
            assert "no model" in st["reason"]
            assert st["plan"] == []
            async with http.get(served.url + "/healthz") as resp:
                assert resp.status == 503
                assert (await resp.json())["ok"] is False
            for stream in (False, True):
                got, data = await post(http, served.url, {"prompt": "hi", "stream": stream})
                assert got == 503, data
                assert_error_body(data)
                assert "no model" in data["error"]["message"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "meshd.tools.meshctl", "status", "--url", served.url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1, err
        assert b"NOT serving" in out


async def test_a_full_kv_budget_is_a_503_until_positions_come_back(tiny_model_dir, tmp_path):
    """KV admission: a request that would overrun the budget (the cache chunks each running
    session's prompt plus max_tokens take on the stages: one chunk of 256 here) is refused
    with a 503 naming the budget, and served once the running one is done."""
    prompt = len(MeshTokenizer.load(tiny_model_dir).encode(PROMPT))
    async with running_node(tiny_model_dir, tmp_path / "state", kv_budget_tokens=KVCache.CHUNK,
                            debug_layer_delay_ms=5.0) as served:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            got, data = await post(http, served.url, greedy(max_tokens=KVCache.CHUNK - prompt + 1))  # two chunks
            assert got == 503, data
            assert_error_body(data)
            assert data["error"]["code"] == "mesh_unavailable" and "KV cache budget full" in data["error"]["message"]
            # One stream holds most of the budget while it runs; a second does not fit beside it.
            async with http.post(served.url + "/v1/completions", json=greedy(max_tokens=25, stream=True)) as first:
                assert first.status == 200
                assert (await first.content.readline()).startswith(b"data: {")  # admitted, generating
                got, data = await post(http, served.url, greedy(max_tokens=25))
                assert got == 503 and "KV cache budget full" in data["error"]["message"], data
                assert b'"error"' not in await first.read()
            assert not served.node.scheduler.active and served.node.scheduler.reserved_tokens == 0
            await complete(http, served.url, greedy(max_tokens=25))
