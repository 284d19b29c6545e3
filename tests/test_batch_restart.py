"""A batch job survives its daemon: a 200-line job whose ``meshd run`` is SIGKILLed at
about half and restarted on the same state dir finishes with 200 results, none
duplicated, each equal to the same request sent alone (greedy and seeded lines)."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time

import pytest

from meshd.serving.batchstore import DB_NAME
from tests.fixtures.daemon import start_daemon, stop_daemon
from tests.meshlab import http_json

openai = pytest.importorskip("openai", reason="the openai SDK is in the test extra")

LINES = 200
PATH = "/v1/completions"


def bodies() -> dict[str, dict]:
    out = {}
    for i in range(LINES):
        body = {"prompt": f"Document {i}: a short note about mesh number {i * 7 % 13}", "max_tokens": 8,
                "temperature": 0}
        if i % 5 == 0:  # seeded sampling: reproducible too
            body |= {"temperature": 0.8, "seed": 1000 + i}
        out[f"doc-{i:03d}"] = body
    return out


def results_in_store(state_dir) -> int:
    with sqlite3.connect(state_dir / DB_NAME) as db:  # a SIGKILLed writer's WAL is read as committed
        return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]


def test_a_job_killed_at_half_and_restarted_finishes_with_each_result_once(tiny_model_dir, tmp_path):
    state, log = tmp_path / "state", tmp_path / "meshd.log"
    jobs = bodies()
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": PATH, "body": b}) + "\n"
                   for cid, b in jobs.items()).encode()
    # Few lines at a time and slow steps, so the job lasts a few seconds and the kill lands mid-way.
    first = start_daemon(tiny_model_dir, state, log, "--threads", "1", "--batch-concurrency", "8",
                         "--debug-layer-delay-ms", "2")
    second = None
    try:
        client = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        uploaded = client.files.create(file=("docs.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=PATH, completion_window="24h")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = client.batches.retrieve(batch.id).request_counts
            if counts.completed + counts.failed >= LINES * 0.45:
                break
            time.sleep(0.02)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        at_kill = results_in_store(state)
        assert 0 < at_kill < LINES, f"the kill should land mid-job: {at_kill} results"

        second = start_daemon(tiny_model_dir, state, log, "--threads", "1")
        client = openai.OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        deadline = time.monotonic() + 90
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed") \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert done.status == "completed", (done, second.log_tail())
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (LINES,
                                                                                                          LINES, 0)
        resumed = [json.loads(x) for x in log.read_text().splitlines() if '"batch_resumed"' in x]
        assert [(r["batch"], r["done"]) for r in resumed] == [(batch.id, at_kill)], "resumed where it stopped"

        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        ids = [r["custom_id"] for r in out]
        assert len(ids) == LINES and set(ids) == set(jobs), "200 results, none duplicated, none missing"
        assert results_in_store(state) == LINES
        for r in out:
            status, want = http_json(second.url + PATH, jobs[r["custom_id"]], timeout=60)
            assert status == 200, want
            got = r["response"]["body"]["choices"][0]
            assert got["token_ids"] == want["choices"][0]["token_ids"], r["custom_id"]
            assert got["text"] == want["choices"][0]["text"]
    finally:
        for served in (first, second):
            if served is not None:
                stop_daemon(served.proc)
