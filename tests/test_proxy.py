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
import dataclasses
import json
import secrets
import time

import aiohttp
import pytest
from structlog.testing import capture_logs

from meshd.control.transfer import AUTH_HEADER, files_path, files_token
from meshd.control.tunnel import GENERATE, TUNNEL_HEADER
from meshd.serving.openai import read_request
from protocol import generate as gen
from protocol.codec import decode_of, encode
from shards.layers import KVCache
from tests.fixtures.api import PROMPT, greedy, post
from tests.fixtures.daemon import linked_pair, running_node
from tests.meshlab import greedy_reference
from tests.inproc import GiB, until

pytestmark = pytest.mark.timeout(120)
TOKENS = 24


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
    async with linked_pair(tiny_model_dir, tmp_path) as (sup, entry):
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

            # the prompt's own logprobs (echo): the entry peer passes them on, whole and streamed
            scored = greedy(max_tokens=3) | {"echo": True, "logprobs": 2}
            _, direct = await post(http, sup.url, scored)
            _, via = await post(http, entry.url, scored)
            assert via["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]
            assert via["choices"][0]["text"] == direct["choices"][0]["text"]
            events = await stream(http, entry.url, scored)
            lps = [v for e in events[:-1] for c in e["choices"] for v in c["logprobs"]["token_logprobs"]]
            assert lps == direct["choices"][0]["logprobs"]["token_logprobs"]

            # A request the API refuses is refused at the entry's own edge, as the supernode
            # refuses it: it never crosses the link (the supernode has no timeline of it).
            bad = greedy() | {"temperature": 5}
            seen = len(sup.node.traces.finished)
            via_entry = await post(http, entry.url, bad)
            assert len(sup.node.traces.finished) == seen and via_entry[0] == 400
            assert via_entry == await post(http, sup.url, bad)


async def test_the_supernode_lost_mid_stream_the_stream_goes_on(tiny_model_dir, tmp_path):
    want = await asyncio.to_thread(greedy_reference, tiny_model_dir, PROMPT, TOKENS)
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, drain_timeout_s=1.0) as (sup, entry):
        term = entry.node.uplink.current_term()

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
        assert entry.node.view.is_supernode and entry.node.uplink.current_term() > term


def by_choice(events: list) -> dict[int, list[int]]:
    """Each choice's token ids, from a stream's events."""
    out: dict[int, list[int]] = {}
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else ():
            out.setdefault(c["index"], []).extend(c["token_ids"])
    return out


async def test_several_choices_survive_the_supernode_lost_mid_stream(tiny_model_dir, tmp_path):
    """n = 2 under a seed (streamed) and two prompts (whole) through the entry peer: the
    supernode dies in their middle, and each choice goes on at the next supernode from its
    own history (a choice already whole is not run again): every choice, its finish and the
    usage are what the unfaulted supernode answers."""
    seeded = greedy(max_tokens=TOKENS, n=2, temperature=0.8, seed=3, stream_options={"include_usage": True})
    prompts = greedy(prompt=[PROMPT, "Once upon a time"], max_tokens=TOKENS)
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, drain_timeout_s=1.0) as (sup, entry):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            calm = await stream(http, sup.url, seeded)
            status, calm_whole = await post(http, sup.url, prompts)
            assert status == 200 and len(calm_whole["choices"]) == 2
            want = by_choice(calm)
            assert len(want) == 2 and want[0] != want[1], "the two samples should differ"
            # The resubmission's own fields, straight: choice 0 whole, choice 1 from its 5th token.
            status, rest = await post(http, sup.url, prompts | {"meshd_resume": [calm_whole["choices"][0]["token_ids"],
                                                                                  calm_whole["choices"][1]["token_ids"][:5]],
                                                                 "meshd_finished": [0]})
            assert status == 200 and [c["index"] for c in rest["choices"]] == [1], rest
            assert rest["choices"][0]["token_ids"] == calm_whole["choices"][1]["token_ids"][5:], rest  # after its history
            for bad in ({"meshd_resume": [1, 2]}, {"meshd_finished": [0, 1]}, {"meshd_finished": [2]}):
                status, err = await post(http, sup.url, prompts | bad)
                assert status == 400 and err["error"]["param"] in ("meshd_resume", "meshd_finished"), (bad, err)

            async def kill_after_a_few(events: list) -> None:
                if len(token_ids(events)) >= 6 and not sup.task.cancelling():
                    sup.task.cancel()  # the supernode dies: no drain, its links and sockets just close

            with capture_logs() as logs:
                whole = asyncio.create_task(post(http, entry.url, prompts))
                events = await stream(http, entry.url, seeded, on_event=kill_after_a_few)
                status, got_whole = await asyncio.wait_for(whole, 60)
        with contextlib.suppress(asyncio.CancelledError):
            await sup.task
    assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    assert by_choice(events) == want
    finishes = {c["index"]: c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
                if c.get("finish_reason")}
    assert finishes == {c["index"]: c["finish_reason"] for e in calm if isinstance(e, dict)
                        for c in e.get("choices", []) if c.get("finish_reason")}
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage[-1] == [e["usage"] for e in calm if isinstance(e, dict) and e.get("usage")][-1], usage
    assert status == 200, got_whole
    assert [(c["token_ids"], c["text"], c["finish_reason"]) for c in got_whole["choices"]] == \
        [(c["token_ids"], c["text"], c["finish_reason"]) for c in calm_whole["choices"]]
    assert got_whole["usage"] == calm_whole["usage"], (got_whole["usage"], calm_whole["usage"])
    assert len([e for e in logs if e.get("event") == "proxy_resubmit"]) >= 2, "both requests were resubmitted"


async def test_a_stream_cut_while_the_supernode_lives_goes_on_within_the_heartbeat_bound(tiny_model_dir, tmp_path):
    """The supernode's side of one tunneled stream ends (its task cancelled: no last reply)
    while the supernode and its link live on: nothing changes in the mesh, so the entry
    must not wait for a new supernode (the failover wait, 30 s) but resume on the same one."""
    want = await asyncio.to_thread(greedy_reference, tiny_model_dir, PROMPT, TOKENS)
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0) as (sup, entry):
        term, cut_at = entry.node.uplink.current_term(), []

        async def cut_after_a_few(events: list) -> None:
            if len(token_ids(events)) >= 4 and not cut_at:
                running = list(sup.node.tunnel._running.values())
                assert len(running) == 1, running
                running[0].cancel()
                cut_at.append(time.monotonic())

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            with capture_logs() as logs:
                events = await stream(http, entry.url, greedy(max_tokens=TOKENS), on_event=cut_after_a_few)
            took = time.monotonic() - cut_at[0]
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
        assert token_ids(events) == want
        assert [e for e in logs if e.get("event") == "upstream_unchanged"], "the entry did not go back to it"
        assert entry.node.uplink.current_term() == term and not entry.node.view.is_supernode
        bound = entry.node.config.heartbeat_s * entry.node.config.missed_beats
        # Silence (sock_read) and the wait for a change are both the heartbeat bound; the
        # failover wait is 30 s. Not a speed figure: the gap between the two is 20 s.
        assert took < 2 * bound + 1 + 5, took


async def test_a_stream_cut_again_and_again_goes_on_while_each_attempt_gets_tokens_out(tiny_model_dir, tmp_path):
    """Six cuts of one tunneled stream, each once a few more tokens came through (a long
    answer meeting fault after fault): each resubmission made progress, so the proxy goes on
    (it gave up after four, whatever came through between them: a soak saw a stream meet five
    faults in 30 s and end in an error). The stream is the unfaulted one, exactly."""
    want = await asyncio.to_thread(greedy_reference, tiny_model_dir, PROMPT, TOKENS)
    cuts = 6
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, heartbeat_s=0.3) as (sup, entry):
        cut_at: list[int] = []

        async def cut_every_three(events: list) -> None:
            n = len(token_ids(events))
            if len(cut_at) < cuts and n >= 3 * (len(cut_at) + 1):
                running = list(sup.node.tunnel._running.values())
                if running:
                    running[0].cancel()
                    cut_at.append(n)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            with capture_logs() as logs:
                events = await stream(http, entry.url, greedy(max_tokens=TOKENS), on_event=cut_every_three)
    assert len(cut_at) == cuts, cut_at
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert token_ids(events) == want
    assert len([e for e in logs if e.get("event") == "proxy_resubmit"]) >= cuts


async def raw_status(url: str, request: bytes) -> int:
    """The status of one raw HTTP/1.1 request (bytes a client library would refuse to send)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
        return int(line.split()[1])
    finally:
        writer.close()


async def test_forwarded_requests_meet_the_supernodes_keys_and_file_tokens_are_single_use(tiny_model_dir, tmp_path):
    """The entry peer has no API-key file; the supernode has one. A request through the
    entry (over the sealed link) meets the supernode's keys as a direct one would. Shard-file
    tokens: good once, for their own path only; a malformed (non-ASCII) one is a 401, not a 500.
    A client that hangs up mid-stream through the entry frees its session on the supernode."""
    keys = tmp_path / "keys"
    keys.write_text("k-" + secrets.token_hex(8) + "\n")
    key = keys.read_text().strip()
    async with linked_pair(tiny_model_dir, tmp_path, api_key_file=keys, debug_layer_delay_ms=5.0) as (sup, entry):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            status, data = await post(http, entry.url, greedy(max_tokens=4))
            assert status == 401 and "API key" in data["error"]["message"], (status, data)
            async with http.post(entry.url + "/v1/completions", json=greedy(max_tokens=4),
                                 headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401
            async with http.post(entry.url + "/v1/completions", json=greedy(max_tokens=6),
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                via = await resp.json()
                assert resp.status == 200, via
            async with http.post(sup.url + "/v1/completions", json=greedy(max_tokens=6),
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                assert (await resp.json())["choices"][0]["token_ids"] == via["choices"][0]["token_ids"]

            model = sup.node.store.manifest.name
            path = files_path(model, "manifest.json")
            token = files_token(sup.node.secret, entry.node.node_id, path)
            async with http.get(sup.url + path, headers={AUTH_HEADER: token}) as resp:
                assert resp.status == 200
            for headers in ({AUTH_HEADER: token},  # replayed
                            {AUTH_HEADER: files_token(sup.node.secret, entry.node.node_id, path + "x")},
                            {AUTH_HEADER: files_token(b"not the secret at all", entry.node.node_id, path)},
                            {}):
                async with http.get(sup.url + path, headers=headers) as resp:
                    assert resp.status in (401, 404), (headers, resp.status)
            weird = f"GET {path} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: ".encode() + "nœud:1:é".encode() + b"\r\n\r\n"
            assert await raw_status(sup.url, weird) == 401
            weird = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nAuthorization: Bearer \xc3\xa9\xff\r\n\r\n{}"
            assert await raw_status(entry.url, weird) in (400, 401)
            assert await raw_status(sup.url, weird) == 401

            # A client gone mid-stream: the supernode's request is cancelled through the link.
            with capture_logs() as logs:
                async with http.post(entry.url + "/v1/completions", json=greedy(max_tokens=200) | {"stream": True},
                                     headers={"Authorization": f"Bearer {key}"}) as resp:
                    assert resp.status == 200
                    await resp.content.readline()
                await until(lambda: not sup.node.scheduler.active, timeout=10)
            assert [e for e in logs if e.get("event") == "tunnel_cancelled"], "the supernode never heard"


def after_tokens(k: int):
    """An event set once a stream has ``k`` tokens, and the ``on_event`` that sets it."""
    started = asyncio.Event()

    async def note(events: list) -> None:
        if len(token_ids(events)) >= k:
            started.set()

    return started, note


async def test_a_refusal_upstream_is_never_a_200(tiny_model_dir, tmp_path):
    """The supernode's KV budget is full: through the entry peer the client gets the 503
    (whole or streamed), not a 200 with empty text and no finish reason."""
    async with linked_pair(tiny_model_dir, tmp_path, kv_budget_tokens=KVCache.CHUNK) as (sup, entry):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = greedy(max_tokens=KVCache.CHUNK)  # two cache chunks with its prompt: past the budget
            for stream_it in (False, True):
                async with http.post(entry.url + "/v1/completions", json=body | {"stream": stream_it}) as resp:
                    data = await resp.json(content_type=None)
                    assert resp.status == 503, (stream_it, resp.status, data)
                    assert "KV cache budget full" in data["error"]["message"], data
            status, ok = await post(http, entry.url, greedy(max_tokens=8))
            assert status == 200 and ok["choices"][0]["finish_reason"] == "length", ok


async def test_a_supernode_that_yields_hands_its_streams_on(tiny_model_dir, tmp_path):
    """A peer that outranks the supernode joins mid-stream: the supernode yields at once,
    and the streams (one through the entry peer, one sent straight to the old supernode,
    and one of two choices sent straight to it) go on at the new one, token for token the unfaulted answer, without
    waiting out a timer."""
    n = 48
    want = await asyncio.to_thread(greedy_reference, tiny_model_dir, PROMPT, n)
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=15.0) as (sup, entry):
        port = lambda served: served.url.rsplit(":", 1)[1]  # noqa: E731
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            started, note = after_tokens(4)
            with capture_logs() as logs:
                via_entry = asyncio.create_task(stream(http, entry.url, greedy(max_tokens=n), on_event=note))
                straight = asyncio.create_task(stream(http, sup.url, greedy(max_tokens=n)))
                whole = asyncio.create_task(post(http, sup.url, greedy(max_tokens=n)))
                pair = asyncio.create_task(stream(http, sup.url, greedy(max_tokens=n, n=2)))
                await asyncio.wait_for(started.wait(), 60)
                async with running_node(tiny_model_dir, tmp_path / "big", name="big", advertise_vram=16 * GiB,
                                        secret_file=tmp_path / "secret", debug_layer_delay_ms=15.0,
                                        peer=(f"127.0.0.1:{port(sup)}", f"127.0.0.1:{port(entry)}")) as big:
                    results = await asyncio.wait_for(asyncio.gather(via_entry, straight, whole, pair), 90)
                    assert big.node.view.is_supernode and not sup.node.view.is_supernode
        for events in results[:2]:
            assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e], events
            assert token_ids(events) == want
        status, body = results[2]
        assert status == 200 and body["choices"][0]["token_ids"] == want, body
        assert body["choices"][0]["finish_reason"] == "length"
        events = results[3]  # n = 2, straight at the old supernode: both choices go on
        assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
        assert by_choice(events) == {0: want, 1: want}
        assert [e for e in logs if e.get("event") == "supernode_yields"], "the supernode did not yield mid-stream"
        assert len([e for e in logs if e.get("event") == "session_handed_on"]) == 3, "its own requests went on"
        assert [e for e in logs if e.get("event") == "proxy_resubmit"]


async def test_a_graceful_stop_ends_within_its_drain_timeout(tiny_model_dir, tmp_path):
    """The supernode stops while a long stream runs on it and another runs through the
    entry peer: the stop takes its drain timeout, not more; the stream sent straight to
    it is handed on to the next supernode and, still relayed at the drain deadline, ends
    with an error event and [DONE] (never cut short, its session here logged as cut), and
    the one through the entry peer goes on at the next supernode, exact."""
    n = 64
    want = await asyncio.to_thread(greedy_reference, tiny_model_dir, PROMPT, n)
    drain_s = 1.2
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=15.0, drain_timeout_s=drain_s) as (sup, entry):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            started, note = after_tokens(4)
            with capture_logs() as logs:
                straight = asyncio.create_task(stream(http, sup.url, greedy(max_tokens=n), on_event=note))
                via_entry = asyncio.create_task(stream(http, entry.url, greedy(max_tokens=n)))
                await asyncio.wait_for(started.wait(), 60)
                t0 = asyncio.get_running_loop().time()
                sup.stop.set()
                await asyncio.wait_for(sup.task, drain_s + 5)
                took = asyncio.get_running_loop().time() - t0
                cut, through = await asyncio.wait_for(asyncio.gather(straight, via_entry), 60)
    assert took < drain_s + 1.5, f"the stop took {took:.1f} s with a drain timeout of {drain_s} s"
    assert cut[-1] == "[DONE]" and "shutting down" in cut[-2].get("error", {}).get("message", ""), cut[-3:]
    assert len(token_ids(cut)) < n and token_ids(cut) == want[:len(token_ids(cut))]
    assert through[-1] == "[DONE]" and token_ids(through) == want, through[-3:]
    assert any(e.get("event") == "session_finished" and e.get("finish") == "cut" for e in logs)
    assert any(e.get("event") == "relay_cut" for e in logs), "the straight stream was not handed on"


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
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, drain_timeout_s=1.0) as (sup, entry):
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


async def _generate(http: aiohttp.ClientSession, url: str, data: bytes, headers: dict) -> tuple[int, list]:
    """POST /mesh/generate as the tunnel does (or as a client trying it): the status and the frames."""
    async with http.post(url + GENERATE, data=data, headers=headers) as resp:
        body = await resp.read()
    if resp.status != 200:
        return resp.status, []
    async def pieces():
        yield body
    return 200, [decode_of(f, gen.OUTPUT_TYPES) async for f in gen.read_frames(pieces())]


async def test_the_generate_path_answers_only_the_tunnel_and_checks_what_a_peer_sends(tiny_model_dir, tmp_path):
    """/mesh/generate, where an entry peer's completions arrive: a client (no tunnel mark,
    or a wrong one) finds nothing there; what a peer sends is checked as a client's request
    is, also what an edge would never pass (a frame that is not a Generate, a history of ids
    the model does not have, n of 0, a temperature past the API's, a chat turn of no role a
    template knows) and refused with a Failure naming it, the daemon serving on; a good one
    is answered in frames whose tokens are the direct answer's."""
    async with running_node(tiny_model_dir, tmp_path / "n") as node:
        mark = {TUNNEL_HEADER: node.node.local_token}
        asked = read_request(greedy(max_tokens=6), chat=False, model=node.node.model_name)
        good = encode(asked, gen.REQUEST_TYPES)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            for headers in ({}, {TUNNEL_HEADER: "not-the-token"}):
                assert (await _generate(http, node.url, good, headers))[0] == 404
            vocab = node.node.scheduler.tokenizer.vocab_size

            def changed(**fields) -> bytes:
                return encode(dataclasses.replace(asked, request=dataclasses.replace(asked.request, **fields)),
                              gen.REQUEST_TYPES)

            bad = {
                "malformed request frame": encode(gen.End(), gen.OUTPUT_TYPES),
                "token ids of this model": encode(dataclasses.replace(asked, resume=(gen.History((vocab,)),)),
                                                  gen.REQUEST_TYPES),
                "n must be >= 1": changed(n=0),
                "temperature must be >= 0.0 and <= 2.0, got 7.0": changed(temperature=7.0),
                "needs a role": changed(chat=1, prompts=(), messages=(gen.Turn("root", "hi"),)),
            }
            for why, data in bad.items():
                status, frames = await _generate(http, node.url, data, mark)
                assert status == 200 and len(frames) == 1 and isinstance(frames[0], gen.Failure), (why, frames)
                assert frames[0].act is gen.Act.FAIL and frames[0].status == 400 and why in frames[0].message, frames
            status, frames = await _generate(http, node.url, good, mark)
            _, direct = await post(http, node.url, greedy(max_tokens=6))
        assert status == 200 and isinstance(frames[0], gen.Begin) and isinstance(frames[-1], gen.End), frames
        ids = [t for f in frames if isinstance(f, gen.Delta) for t in f.token_ids]
        assert ids == direct["choices"][0]["token_ids"] and len(ids) == 6
        assert [f.finish for f in frames if isinstance(f, gen.Delta)][-1] is gen.Finish.LENGTH
        assert [f for f in frames if isinstance(f, gen.Usage)] == [gen.Usage(direct["usage"]["prompt_tokens"], 6)]


async def test_a_resubmitted_stream_goes_on_with_the_clients_offsets(tiny_model_dir, tmp_path):
    """Cut mid-answer and resubmitted, a stream with logprobs is what the client would get
    uncut: the same tokens and logprobs, and ``text_offset`` counting on from where it was
    (it began again at 0 when each supernode wrote the client's chunks)."""
    body = greedy(max_tokens=TOKENS, logprobs=1)
    async with linked_pair(tiny_model_dir, tmp_path, debug_layer_delay_ms=5.0, heartbeat_s=0.3) as (sup, entry):
        cut: list[int] = []

        async def cut_once(events: list) -> None:
            if len(token_ids(events)) >= 5 and not cut and (running := list(sup.node.tunnel._running.values())):
                running[0].cancel()
                cut.append(len(token_ids(events)))

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
            calm = await stream(http, entry.url, body)
            with capture_logs() as logs:
                events = await stream(http, entry.url, body, on_event=cut_once)
    assert cut and [e for e in logs if e.get("event") == "proxy_resubmit"], "the stream was not cut and resubmitted"

    def logprobs(evs: list) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for e in evs:
            for c in e.get("choices", []) if isinstance(e, dict) else ():
                for key in out:
                    out[key] += (c["logprobs"] or {}).get(key, [])
        return out

    got, want = logprobs(events), logprobs(calm)
    assert token_ids(events) == token_ids(calm) and got == want
    starts = [sum(len(t) for t in got["tokens"][:i]) for i in range(len(got["tokens"]))]
    assert got["text_offset"] == starts and len(starts) == TOKENS
