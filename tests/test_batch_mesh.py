"""A batch job on a namespaced 3-peer mesh, submitted to a peer that is not the supernode
(its lines go through that peer's proxy): another stage is SIGKILLed mid-job, then the
supernode too (the entry peer takes over, alone); the job completes and every line's
result is what the unfaulted mesh answers for it."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fixtures.mesh import GiB
from tests.meshlab import http_json

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]
openai = pytest.importorskip("openai", reason="the openai SDK is in the test extra")

LINES = 48
PATH = "/v1/completions"
LAYER_DELAY_MS = 5.0  # every peer gets layers of the tiny model, and a job lasts a few seconds


def test_a_stage_then_the_supernode_killed_mid_job_change_no_result(meshlab, tiny_model_dir):
    mesh = meshlab
    daemons = [mesh.start(mesh.lab.add_host(), model=str(tiny_model_dir), vram=v * GiB, layer_delay_ms=LAYER_DELAY_MS,
                          env={"MESHD_BATCH_CONCURRENCY": "8"}) for v in (8, 4, 2)]
    view = mesh.wait_converged(daemons, n_stages=3)
    by_id = {d.node_id: d for d in daemons}
    stages = [by_id[a["node"]] for a in view["plan"] if a["node"] != view["supernode"]]
    entry, victim = stages[0], stages[1]

    jobs = {}
    for i in range(LINES):
        body = {"prompt": f"Item {i}: the mesh", "max_tokens": 12, "temperature": 0}
        if i % 4 == 0:
            body |= {"temperature": 0.7, "seed": 500 + i}
        jobs[f"item-{i}"] = body
    # What the unfaulted mesh answers for each line, asked through the same entry peer.
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: http_json(entry.url + PATH, b, timeout=120), jobs.values()))
    assert all(code == 200 for code, _ in answers), answers
    want = {cid: data["choices"][0]["token_ids"] for cid, (_, data) in zip(jobs, answers)}

    client = openai.OpenAI(base_url=entry.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    data = "".join(json.dumps({"custom_id": c, "method": "POST", "url": PATH, "body": b}) + "\n"
                   for c, b in jobs.items()).encode()
    uploaded = client.files.create(file=("items.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=PATH, completion_window="24h")
    deadline = time.monotonic() + 60
    while (counts := client.batches.retrieve(batch.id).request_counts).completed < LINES // 4:
        assert time.monotonic() < deadline, f"the job did not get going: {counts}" + mesh.fail_report()
        time.sleep(0.05)
    victim.kill()
    at_kill = client.batches.retrieve(batch.id).request_counts.completed
    assert at_kill < LINES, "the kill should land mid-job"
    # Then the supernode, once the job has gone on under the re-planned mesh.
    supernode = by_id[view["supernode"]]
    while (counts := client.batches.retrieve(batch.id).request_counts).completed < at_kill + LINES // 4:
        assert time.monotonic() < deadline + 60, f"the job stalled after the stage loss: {counts}" + mesh.fail_report()
        time.sleep(0.05)
    supernode.kill()
    at_failover = client.batches.retrieve(batch.id).request_counts.completed
    assert at_failover < LINES, "the supernode kill should land mid-job"

    deadline = time.monotonic() + 150
    while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"the job did not finish: {done}" + mesh.fail_report()
        time.sleep(0.2)
    report = mesh.fail_report()
    assert done.status == "completed" and done.request_counts.completed == LINES, f"{done}" + report
    after = entry.status()
    assert after["supernode"] == entry.node_id and [a["node"] for a in after["plan"]] == [entry.node_id], report

    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in out}
    assert len(out) == LINES and got == want, report


def test_a_batch_whose_peer_is_lost_for_good_is_finished_by_the_peer_holding_its_replica(meshlab, tiny_model_dir):
    """Submitted to a member that is then SIGKILLed for good: the supernode, which holds
    the job's replica, takes it over once the member has been gone ``batch_takeover_s``;
    the owner reads the whole batch there, each line once, each as the mesh answers it."""
    mesh = meshlab
    env = {"MESHD_BATCH_CONCURRENCY": "2", "MESHD_BATCH_TAKEOVER_S": "3"}
    daemons = [mesh.start(mesh.lab.add_host(), model=str(tiny_model_dir), vram=v * GiB, layer_delay_ms=LAYER_DELAY_MS,
                          env=env) for v in (8, 4, 2)]
    view = mesh.wait_converged(daemons, n_stages=3)
    by_id = {d.node_id: d for d in daemons}
    supernode = by_id[view["supernode"]]
    home = next(d for d in daemons if d.node_id != view["supernode"])

    jobs = {f"item-{i}": {"prompt": f"Item {i}: the mesh", "max_tokens": 12, "temperature": 0} for i in range(LINES)}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: http_json(supernode.url + PATH, b, timeout=120), jobs.values()))
    assert all(code == 200 for code, _ in answers), answers
    want = {cid: data["choices"][0]["token_ids"] for cid, (_, data) in zip(jobs, answers)}

    at_home = openai.OpenAI(base_url=home.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    data = "".join(json.dumps({"custom_id": c, "method": "POST", "url": PATH, "body": b}) + "\n"
                   for c, b in jobs.items()).encode()
    uploaded = at_home.files.create(file=("items.jsonl", io.BytesIO(data)), purpose="batch")
    batch = at_home.batches.create(input_file_id=uploaded.id, endpoint=PATH, completion_window="24h")
    replicated = mesh.wait_log(home, "batch_replicated", timeout=30, batch=batch.id)
    assert replicated["holder"] == supernode.node_id
    deadline = time.monotonic() + 60
    while (counts := at_home.batches.retrieve(batch.id).request_counts).completed < LINES // 4:
        assert time.monotonic() < deadline, f"the job did not get going: {counts}" + mesh.fail_report()
        time.sleep(0.05)
    home.kill()
    at_kill = counts.completed
    assert at_kill < LINES, "the kill should land mid-job"

    taken = mesh.wait_log(supernode, "batch_taken_over", timeout=60, batch=batch.id)
    # The replica carried the results synced before the kill (those of the last second
    # run again there: a line's answer is the same wherever it runs).
    assert taken["gone_s"] >= 3 and 0 < taken["done"] <= at_kill
    there = openai.OpenAI(base_url=supernode.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + 120
    while (done := there.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"the job did not finish: {done}" + mesh.fail_report()
        time.sleep(0.2)
    report = mesh.fail_report()
    assert done.status == "completed" and done.request_counts.completed == LINES, f"{done}" + report
    out = [json.loads(x) for x in there.files.content(done.output_file_id).text.splitlines()]
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in out}
    assert len(out) == LINES and got == want, report
