"""vLLM's sampling extensions that benchmark and evaluation clients send: ``min_tokens`` (the
end tokens masked, and stop strings not looked for, until that many tokens are out) and
``ignore_eos`` (an end token is a token like any other; max_tokens ends the answer), on the
real model, whose greedy answer to a short question ends after a few tokens.
(Bad values: tests/test_api_validation.py.)"""

from __future__ import annotations

import aiohttp
import pytest

from shards.tokenizer import MeshTokenizer
from tests.fixtures.api import complete
from tests.fixtures.daemon import running_node

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
CHAT = "/v1/chat/completions"
MAX = 40


async def test_min_tokens_and_ignore_eos_run_past_the_end_token(real_model_dir, tmp_path):
    tok = MeshTokenizer.load(real_model_dir)
    eos = tok.eos_ids
    ends_text = {tok.decode([e]) for e in eos}
    async with running_node(real_model_dir, tmp_path / "state") as served, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        body = {"messages": ASK, "max_tokens": MAX, "temperature": 0}
        plain = (await complete(http, served.url, body, CHAT))["choices"][0]
        ends = len(plain["token_ids"])
        assert plain["finish_reason"] == "stop" and ends + 8 < MAX, plain  # greedy ends early by itself
        print(f"\ngreedy ends after {ends} tokens: {plain['message']['content']!r}")

        # min_tokens: the end token is masked until then, so the answer runs at least that long
        least = ends + 6
        data = await complete(http, served.url, body | {"min_tokens": least}, CHAT)
        choice = data["choices"][0]
        ids = choice["token_ids"]
        assert len(ids) >= least and data["usage"]["completion_tokens"] == len(ids)
        assert not set(ids[:least]) & eos
        assert ids[:ends] == plain["token_ids"]  # the same greedy path up to where it would have ended
        print(f"min_tokens={least}: {len(ids)} tokens, {choice['finish_reason']}: {choice['message']['content']!r}")

        # its logprobs are those of the distribution sampled from: no end token among the top ones before
        data = await complete(http, served.url, body | {"min_tokens": least, "logprobs": True, "top_logprobs": 5},
                              CHAT)
        content = data["choices"][0]["logprobs"]["content"]
        assert not {t["token"] for c in content[:least] for t in c["top_logprobs"]} & ends_text

        # ignore_eos: the end token is taken as any other, the answer runs to max_tokens
        data = await complete(http, served.url, body | {"ignore_eos": True}, CHAT)
        choice = data["choices"][0]
        ids = choice["token_ids"]
        assert choice["finish_reason"] == "length" and len(ids) == MAX == data["usage"]["completion_tokens"]
        assert ids[:ends] == plain["token_ids"] and ids[ends] in eos  # where greedy ended, it went on

        # streamed: token by token past the end token too
        events = []
        async with http.post(served.url + CHAT, json=body | {"ignore_eos": True, "stream": True}) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    events.append(line)
        assert len(events) >= MAX // 2  # streamed token by token (a few pieces may wait for whole characters)

        # a stop string that greedy text holds early does not cut before min_tokens
        first_word = plain["message"]["content"].strip().split()[0][:3]
        data = await complete(http, served.url, body | {"min_tokens": least, "stop": [first_word]}, CHAT)
        assert len(data["choices"][0]["token_ids"]) >= least
