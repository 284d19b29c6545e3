"""The Batch API on a real ``meshd run`` daemon (tiny model): the official ``openai`` SDK's
round trip, malformed lines reported with their custom_id while the rest goes on,
OpenAI's error shapes, cancel, the storage bound, meshctl's batch commands, and
interactive requests going ahead of a batch's lines."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import urllib.request

import pytest

from meshd.tools import meshctl
from meshd.serving.scheduler import BATCH_BESIDE_INTERACTIVE, MAX_BATCH, Priority, Session, pick_step, rotate_batch
from tests.fixtures.daemon import running_daemon, running_node, status_json
from tests.meshlab import http_json

openai = pytest.importorskip("openai", reason="the openai SDK is in the test extra")

STORE_BYTES = 8 << 20  # a small batch store, to hit its bound on purpose
DONE = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("batch-daemon")
    # A layer delay makes a step last a few ms, so a batch runs long enough to be watched.
    with running_daemon(tiny_model_dir, base / "state", base / "meshd.log", "--threads", "1",
                        "--batch-max-bytes", str(STORE_BYTES), "--debug-layer-delay-ms", "1") as served:
        yield served


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def jsonl(lines: list) -> bytes:
    return b"".join((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines)


def request_line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def wait_done(client, batch_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in DONE:
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} not finished within {timeout} s: {b}")


def alone(url: str, path: str, body: dict) -> dict:
    status, data = http_json(url + path, body, timeout=60)
    assert status == 200, data
    return data


def test_openai_sdk_round_trip_equals_each_request_sent_alone(daemon, client):
    path = "/v1/chat/completions"
    bodies = {f"q{i}": {"messages": [{"role": "user", "content": f"Tell me about mesh number {i}."}],
                        "max_tokens": 12, "temperature": 0} for i in range(5)}
    bodies["seeded"] = {"messages": [{"role": "user", "content": "Pick a word."}], "max_tokens": 12,
                        "temperature": 0.9, "seed": 1234}
    lines = [request_line(cid, path, body) for cid, body in bodies.items()]
    lines.insert(3, b'{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": {')
    lines.append(request_line("refused", path, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}))

    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes) == ("file", "batch", len(jsonl(lines)))
    assert client.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert client.files.content(uploaded.id).content == jsonl(lines)

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=path, completion_window="24h",
                                  metadata={"job": "sdk"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "sdk"}
    done = wait_done(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
    assert done.completed_at >= done.in_progress_at >= done.created_at and done.output_file_id and done.error_file_id
    assert done.usage.output_tokens > 0

    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(bodies)
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        got = r["response"]["body"]["choices"][0]
        want = alone(daemon.url, path, bodies[r["custom_id"]])["choices"][0]
        assert (got["message"]["content"], got["token_ids"]) == (want["message"]["content"], want["token_ids"])

    errors = {e["custom_id"]: e for e in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert set(errors) == {"broken", "refused"}
    assert "line 4" in errors["broken"]["error"]["message"] and errors["broken"]["response"] is None
    refused = errors["refused"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
    assert any(b.id == batch.id for b in client.batches.list(limit=5).data)


def test_lines_a_parser_chokes_on_are_error_records_and_the_batch_and_daemon_go_on(daemon, client):
    """Lines nested deeper than Python's recursion, with a number past its digit limit, or
    with a custom_id holding a lone surrogate (which the store cannot keep as text) are
    each an error record naming its line: the rest of the batch runs, the daemon serves on."""
    path = "/v1/completions"
    good = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
    lines = [request_line("good", path, good),
             b'{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": '
             + b"[" * 100_000 + b"]" * 100_000 + b"}",
             b'{"custom_id": "long", "method": "POST", "url": "/v1/completions", "body": {"max_tokens": '
             + b"9" * 5000 + b"}}",
             b'{"custom_id": "lone\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}']
    uploaded = client.files.create(file=("hostile.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    done = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint=path,
                                                   completion_window="24h").id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 1, 3)
    errors = {e["custom_id"]: e["error"]["message"]
              for e in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert "line 2" in errors["deep"] and "deeper than" in errors["deep"], errors
    assert "line 3" in errors["long"] and "digits" in errors["long"], errors
    assert "line 4" in errors["lone\\ud800"] and "surrogate" in errors["lone\\ud800"], errors
    out = json.loads(client.files.content(done.output_file_id).text)
    want = alone(daemon.url, path, good)["choices"][0]["text"]
    assert out["custom_id"] == "good" and out["response"]["body"]["choices"][0]["text"] == want


def test_an_upload_whose_filename_is_not_utf8_is_kept_with_its_name_readable(daemon, client):
    """A multipart filename in Latin-1 (aiohttp keeps such bytes as surrogates, which the
    store cannot write): the upload succeeds, its name shows U+FFFD where the bytes were."""
    data = jsonl([request_line("a", "/v1/completions", {"prompt": "x", "max_tokens": 1})])
    body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"caf\xe9.jsonl\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n" + data + b"\r\n--b0undary--\r\n")
    req = urllib.request.Request(daemon.url + "/v1/files", body,
                                 {"Content-Type": "multipart/form-data; boundary=b0undary"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        file_id = json.loads(resp.read())["id"]
    got = client.files.retrieve(file_id)
    assert got.filename.startswith("caf") and got.filename.endswith(".jsonl") and "\ufffd" in got.filename
    assert client.files.content(file_id).content == data


def test_bad_batch_requests_are_openai_errors(daemon, client):
    uploaded = client.files.create(file=("a.jsonl", io.BytesIO(jsonl([request_line("a", "/v1/completions",
                                                                                    {"prompt": "x"})]))),
                                   purpose="batch")
    create = {"input_file_id": uploaded.id, "endpoint": "/v1/completions", "completion_window": "24h"}
    cases = [
        (create | {"output_expires_after": {"anchor": "created_at", "seconds": 3600}}, 400, "output_expires_after"),
        (create | {"endpoint": "/v1/embeddings"}, 400, "endpoint"),
        (create | {"completion_window": "soon"}, 400, "completion_window"),
        (create | {"input_file_id": "file-nope"}, 400, "input_file_id"),
        (create | {"metadata": {"k": 1}}, 400, "metadata"),
    ]
    for body, status, param in cases:
        code, data = http_json(daemon.url + "/v1/batches", body)
        assert (code, data["error"]["param"]) == (status, param), data
        assert data["error"]["message"] and data["error"]["type"] == "invalid_request_error"
    code, data = http_json(daemon.url + "/v1/batches/batch_nope")
    assert code == 404 and data["error"]["code"] == "not_found" and "submitted to" in data["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="user_data")
    # A finished batch cannot be cancelled.
    done = wait_done(client, client.batches.create(**create).id)
    code, data = http_json(daemon.url + f"/v1/batches/{done.id}/cancel", {})
    assert code == 409 and "already completed" in data["error"]["message"]


def test_an_upload_over_the_store_bound_is_a_507_that_says_what_to_do(daemon):
    big = jsonl([request_line(f"c{i}", "/v1/completions", {"prompt": "y" * 900}) for i in range(5000)])
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\r\n").encode() \
        + big + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(daemon.url + "/v1/files", body,
                                 {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 507
    error = json.loads(info.value.read())["error"]
    assert error["code"] == "storage_full" and "batch_max_bytes" in error["message"]
    assert status_json(daemon.url)["serving"]


def test_cancel_stops_a_batch_and_frees_its_sessions(daemon, client):
    lines = [request_line(f"c{i}", "/v1/completions", {"prompt": f"Count {i}:", "max_tokens": 200, "temperature": 0})
             for i in range(80)]
    uploaded = client.files.create(file=("many.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while status_json(daemon.url)["node"]["scheduler"]["batch_sessions"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    # While it runs, /status (the dashboard's source) and /metrics show it.
    (running,) = [j for j in status_json(daemon.url)["batches"] if j["id"] == batch.id]
    assert running["status"] == "in_progress" and running["total"] == 80
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "meshd_batch_jobs_running 1.0" in metrics
    assert f'meshd_batch_job_lines{{batch="{batch.id}",state="total"}} 80.0' in metrics
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_done(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts.completed < done.request_counts.total == 80
    if done.output_file_id:
        assert len(client.files.content(done.output_file_id).text.splitlines()) == done.request_counts.completed
    deadline = time.monotonic() + 10
    while status_json(daemon.url)["node"]["scheduler"]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status_json(daemon.url)["node"]["scheduler"]["active"] == 0


def test_meshctl_batch_submit_wait_out_list_status_results(daemon, tmp_path, capsys):
    src = tmp_path / "jobs.jsonl"
    src.write_bytes(jsonl([request_line(f"m{i}", "/v1/completions", {"prompt": f"Line {i}", "max_tokens": 6,
                                                                      "temperature": 0}) for i in range(12)]))
    out = tmp_path / "results.jsonl"
    code = meshctl.main(["--url", daemon.url, "batch", "submit", str(src), "--wait", "--out", str(out),
                         "--poll", "0.1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    batch_id = captured.out.strip()
    assert batch_id.startswith("batch_") and "12/12 100%" in captured.err and "tok/s" in captured.err
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"m{i}" for i in range(12)]
    want = alone(daemon.url, "/v1/completions", {"prompt": "Line 3", "max_tokens": 6, "temperature": 0})
    assert results[3]["response"]["body"]["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]

    assert meshctl.main(["--url", daemon.url, "batch", "list"]) == 0
    assert batch_id in capsys.readouterr().out
    assert meshctl.main(["--url", daemon.url, "batch", "status", batch_id]) == 0
    assert "completed: 12 completed, 0 failed of 12" in capsys.readouterr().out
    assert meshctl.main(["--url", daemon.url, "batch", "results", batch_id]) == 0
    assert capsys.readouterr().out == out.read_text()
    assert meshctl.main(["--url", daemon.url, "batch", "results", batch_id, "--errors"]) == 1
    assert "no error file" in capsys.readouterr().err
    assert meshctl.main(["--url", daemon.url, "batch", "status", "batch_nope"]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    # A job with a failed line exits 1 and says where the errors are.
    src.write_bytes(jsonl([request_line("ok", "/v1/completions", {"prompt": "a", "max_tokens": 2}), b"nonsense"]))
    assert meshctl.main(["--url", daemon.url, "batch", "submit", str(src), "--wait", "--poll", "0.1"]) == 1
    assert "1 failed" in capsys.readouterr().err


def test_an_interactive_request_finishes_ahead_of_batch_lines_that_started_first(daemon):
    """16 batch-class streams of 32 tokens start first; an interactive stream of 48 tokens
    sent after them still finishes before every one of them that runs its full length from
    fewer than 16 tokens in when it was sent. With priority a step carries it and 4 of the
    16 (BATCH_BESIDE_INTERACTIVE), so in its 48 steps each of those makes 12 tokens, short
    of the 16 it needs; with no priority it shares every step with them and finishes after
    them (they need at most 32 steps). The head start is read from each stream as it runs:
    how far a stream got before the interactive one was sent depends on the machine's load."""
    finished: list[tuple[str, int]] = []  # (name, tokens), in the order they ended
    progress: dict[str, int] = {}
    lock = threading.Lock()

    def stream(name: str, body: dict) -> None:
        req = urllib.request.Request(daemon.url + "/v1/completions", json.dumps(body | {"stream": True}).encode(),
                                     {"Content-Type": "application/json"})
        n = 0
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:  # one SSE line at a time, as sent
                if line.startswith(b"data: {"):
                    n += sum(len(c["token_ids"]) for c in json.loads(line[6:])["choices"])
                    with lock:
                        progress[name] = n
        with lock:
            finished.append((name, n))

    # min_tokens: every stream runs its full length (some of these prompts reach an end of
    # text in 8 tokens), so every one that starts behind can tell.
    batch = [threading.Thread(target=stream, args=(f"batch{i}", {"prompt": f"Batch line {i}", "max_tokens": 32,
                                                                 "min_tokens": 32, "temperature": 0,
                                                                 "meshd_priority": "batch"}))
             for i in range(16)]
    for t in batch:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every batch stream has begun (a fast box may finish some soon after)
        with lock:
            if len(progress) == 16:
                break
        time.sleep(0.005)
    interactive = threading.Thread(target=stream, args=("interactive", {"prompt": "Now, a person asks",
                                                                         "max_tokens": 48, "min_tokens": 48,
                                                                         "temperature": 0}))
    with lock:
        head_start = dict(progress)
    interactive.start()
    for t in [*batch, interactive]:
        t.join(120)
    order = [name for name, _ in finished]
    assert len(order) == 17 and dict(finished)["interactive"] == 48, finished
    behind = [name for name, n in finished if name != "interactive" and n == 32 and head_start.get(name, 0) < 16]
    assert len(behind) >= 4, f"too few batch streams ran their full length from behind to tell: {finished} " \
                             f"(tokens when the interactive one was sent: {head_start})"
    assert all(order.index("interactive") < order.index(name) for name in behind), (finished, head_start)


def test_a_step_takes_interactive_sessions_first_and_batch_ones_in_turn():
    def session(i: int, priority: Priority) -> Session:
        return Session(f"s{i}", [1], 1, priority=priority)

    batch = [session(i, Priority.BATCH) for i in range(10)]
    people = [session(100 + i, Priority.INTERACTIVE) for i in range(2)]
    assert pick_step(batch, interactive_running=False) == batch  # alone, batch lines fill the step
    assert len(pick_step(batch * 7, False)) == MAX_BATCH
    lane = batch[:5] + people + batch[5:]
    picked = pick_step(lane, interactive_running=True)
    assert picked[:2] == people and len(picked) == 2 + BATCH_BESIDE_INTERACTIVE
    # In turn: over five steps every batch session gets its two steps.
    steps = {s.id: 0 for s in batch}
    for _ in range(5):
        picked = pick_step(lane, True)
        for s in picked[2:]:
            steps[s.id] += 1
        lane = rotate_batch(lane, picked)
    assert set(steps.values()) == {2}


async def test_with_api_keys_a_batch_needs_one_and_its_lines_pass(tiny_model_dir, tmp_path):
    """The runner's own requests carry the mesh token, so they pass where clients need a key."""
    keys = tmp_path / "keys"
    keys.write_text("sk-local-1\n")
    async with running_node(tiny_model_dir, tmp_path / "state", api_key_file=keys) as served:
        anonymous = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.batches.list()
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="sk-local-1", max_retries=0)
        data = jsonl([request_line(f"k{i}", "/v1/completions", {"prompt": f"Key {i}", "max_tokens": 4})
                      for i in range(3)])
        uploaded = await client.files.create(file=("k.jsonl", io.BytesIO(data)), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                            completion_window="24h")
        for _ in range(200):
            batch = await client.batches.retrieve(batch.id)
            if batch.status in DONE:
                break
            await asyncio.sleep(0.05)
        assert (batch.status, batch.request_counts.completed) == ("completed", 3), batch
