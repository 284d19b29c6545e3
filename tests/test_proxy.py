"""The entry peer's proxy, in process (no namespaces): two nodes on loopback linked by a
static peer, the supernode ``sup`` and the entry peer ``entry`` a client talks to. What
the entry answers is what the supernode answers (streamed or whole, one id per
completion); a refusal passes through as it is; and when the supernode dies mid-stream,
the entry (which has the model too) takes over and the stream goes on where it stopped,
token for token what one node answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets

import aiohttp
import pytest
from structlog.testing import capture_logs

from tests.fixtures.api import PROMPT, greedy, post
from tests.fixtures.daemon import running_node
from tests.meshlab import greedy_reference
from tests.inproc import GiB, until

pytestmark = pytest.mark.timeout(120)
TOKENS = 24


@contextlib.asynccontextmanager
async def pair(tiny_model_dir, tmp_path, **sup_flags):
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    async with running_node(tiny_model_dir, tmp_path / "sup", name="sup", advertise_vram=8 * GiB,
                            secret_file=secret, **sup_flags) as sup:
        port = sup.url.rsplit(":", 1)[1]
        async with running_node(tiny_model_dir, tmp_path / "entry", name="entry", advertise_vram=4 * GiB,
                                secret_file=secret, peer=(f"127.0.0.1:{port}",)) as entry:
            await until(lambda: entry.node.serves() and not entry.node.view.is_supernode, timeout=30)
            yield sup, entry


async def stream(http: aiohttp.ClientSession, url: str, body: dict, on_event=None,
                 path: str = "/v1/completions") -> list:
    """The events of a streamed completion, JSON-decoded except ``[DONE]``."""
    events = []
    async with http.post(url + path, json=body | {"stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if on_event is not None:
                    await on_event(events)
    return events


def token_ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c["token_ids"]]


async def test_the_entry_peer_answers_what_the_supernode_answers(tiny_model_dir, tmp_path):
    async with pair(tiny_model_dir, tmp_path) as (sup, entry):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = greedy(max_tokens=12) | {"n": 2}
            status, direct = await post(http, sup.url, body)
            status_e, via = await post(http, entry.url, body)
            assert status == status_e == 200
            assert [c["token_ids"] for c in via["choices"]] == [c["token_ids"] for c in direct["choices"]]
            assert [c["text"] for c in via["choices"]] == [c["text"] for c in direct["choices"]]
            assert via["usage"] == direct["usage"] and via["id"].startswith("cmpl-")

            events = await stream(http, entry.url, greedy(max_tokens=12))
            assert events[-1] == "[DONE]"
            assert token_ids(events) == direct["choices"][0]["token_ids"]
            assert len({e["id"] for e in events[:-1]}) == 1, "one completion, one id"

            bad = greedy() | {"temperature": 5}
            assert await post(http, entry.url, bad) == await post(http, sup.url, bad)


async def test_the_supernode_lost_mid_stream_the_stream_goes_on(tiny_model_dir, tmp_path):
    want = await asyncio.to_thread(greedy_reference, tiny_model_dir, PROMPT, TOKENS)
    async with pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, drain_timeout_s=1.0) as (sup, entry):
        term = entry.node.current_term()

        async def kill_after_a_few(events: list) -> None:
            if len(token_ids(events)) >= 4 and not sup.task.cancelling():
                sup.task.cancel()  # the supernode dies: no drain, its links and sockets just close

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            with capture_logs() as logs:
                events = await stream(http, entry.url, greedy(max_tokens=TOKENS), on_event=kill_after_a_few)
        with contextlib.suppress(asyncio.CancelledError):
            await sup.task
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
        assert token_ids(events) == want
        assert [e for e in logs if e.get("event") == "proxy_resubmit"], "the stream did not survive a resubmit"
        assert entry.node.view.is_supernode and entry.node.current_term() > term


async def test_sampling_fields_and_a_grammar_survive_a_resubmit(tiny_model_dir, tmp_path):
    """Penalties, bias, top-k/min-p and a json_schema mask under a seed: the stream resumed on
    the next supernode is token for token what the first one answers whole."""
    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 30},
                                               "ok": {"type": "boolean"}},
              "required": ["note", "ok"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Say something."}], "temperature": 0.9, "seed": 11,
            "frequency_penalty": 0.8, "presence_penalty": 0.3, "repetition_penalty": 1.2, "top_k": 40,
            "min_p": 0.02, "logit_bias": {"50": -100}, "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    async with pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, drain_timeout_s=1.0) as (sup, entry):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            status, whole = await post(http, sup.url, body, path="/v1/chat/completions")
            assert status == 200, whole
            want = whole["choices"][0]["token_ids"]
            assert len(want) > 8 and 50 not in want
            json.loads(whole["choices"][0]["message"]["content"])

            async def kill_after_a_few(events: list) -> None:
                if len(token_ids(events)) >= 4 and not sup.task.cancelling():
                    sup.task.cancel()

            with capture_logs() as logs:
                events = await stream(http, entry.url, body, on_event=kill_after_a_few, path="/v1/chat/completions")
        with contextlib.suppress(asyncio.CancelledError):
            await sup.task
        assert [e for e in logs if e.get("event") == "proxy_resubmit"], "no resubmit happened"
        assert token_ids(events) == want
