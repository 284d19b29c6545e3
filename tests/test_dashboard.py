"""The dashboard in a real browser: Debian's headless Chromium, driven by Playwright,
against a three-peer mesh of real daemons in network namespaces (found by mDNS).

The page must load from a peer, show every peer of the mesh (the supernode marked),
the layers as a bar coloured by owner, and a chat answer that streams in. A
screenshot is saved as a test artifact under artifacts/. Under load, its live charts
must move and a request's timeline must show every stage; the same mesh serves
``meshctl trace`` (a request's phases add up to what its client waited) and the
Grafana dashboard's metrics (each one exists in the supernode's /metrics).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.meshlab import MeshLab, daemon_env
from tests.netlab import Lab, netlab_available

CHROMIUM = os.environ.get("MESHD_TEST_CHROMIUM", "/usr/bin/chromium")
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
GRAFANA = ROOT / "docs" / "grafana" / "meshd.json"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GiB = 1 << 30

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no browser at {CHROMIUM} (Debian: apt-get install chromium)")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def three_peers(tiny_model_dir, tmp_path_factory):
    if not netlab_available():
        pytest.skip("network namespaces need root and a working `ip netns`")
    with Lab() as lab:
        mesh = MeshLab(lab, tmp_path_factory.mktemp("dashboard-mesh"))
        try:
            hosts = [lab.add_host() for _ in range(3)]
            names = ["attic", "den", "garage"]
            daemons = [mesh.start(h, model=str(tiny_model_dir), name=n, vram=(3 - i) * GiB, layer_delay_ms=5.0)
                       for i, (h, n) in enumerate(zip(hosts, names))]
            view = mesh.wait_converged(daemons, n_stages=3)
            yield mesh, daemons, view
        finally:
            mesh.close()


def test_dashboard_shows_the_mesh_and_streams_a_chat(browser, three_peers):
    mesh, daemons, view = three_peers
    entry = daemons[1]  # not the supernode: the page works from any peer
    ids = {d.node_id for d in daemons}
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        resp = page.goto(entry.url + "/", wait_until="load", timeout=30_000)
        assert resp is not None and resp.status == 200 and "text/html" in resp.headers["content-type"]
        page.wait_for_function("document.body.dataset.peers === '3'", timeout=20_000)

        # Every peer drawn, once, sized by memory; the supernode marked.
        shown = page.eval_on_selector_all("#graph g.peer", "gs => gs.map(g => g.dataset.peerId)")
        assert sorted(shown) == sorted(ids), shown
        for d in daemons:
            text = page.text_content(f'#graph g.peer[data-peer-id="{d.node_id}"]')
            assert d.name in text, text
        radii = {d.name: float(page.get_attribute(f'#graph g.peer[data-peer-id="{d.node_id}"] circle:last-of-type',
                                                  "r")) for d in daemons}
        assert radii["attic"] > radii["den"] > radii["garage"], radii  # 3, 2, 1 GiB advertised
        sup = page.text_content(f'#graph g.peer[data-peer-id="{view["supernode"]}"]')
        assert "supernode" in sup
        assert page.text_content("#supernode") == view["supernode"]
        assert page.text_content("#serving") == "serving"
        # Links with RTT from this peer to the two others.
        rtts = page.eval_on_selector_all("#graph text.rtt", "ts => ts.map(t => t.textContent)")
        assert sum(1 for t in rtts if t.endswith(" ms")) >= 2, rtts

        # The layers bar: one segment per span, coloured by owner, in order.
        segs = page.eval_on_selector_all(
            "#spanbar .seg", "ss => ss.map(s => [s.dataset.node, s.textContent, getComputedStyle(s).backgroundColor])")
        assert [s[0] for s in segs] == [a["node"] for a in view["plan"]]
        assert len({s[2] for s in segs}) == len(segs)
        assert segs[0][1].endswith("[0:2)") or "[0:" in segs[0][1]
        rows = page.eval_on_selector_all("#peers tr", "rs => rs.map(r => r.dataset.peerId)")
        assert sorted(rows) == sorted(ids)

        # A chat answer streams in: text grows over several updates before "done".
        page.fill("#chat-input", "Say something about meshes.")
        page.click("#chat-send")
        page.wait_for_function("document.getElementById('chat-state').textContent.startsWith('streaming')",
                               timeout=60_000)
        partial = page.text_content("#chat-output")
        page.wait_for_function("document.getElementById('chat-state').dataset.done === '1'", timeout=120_000)
        final = page.text_content("#chat-output")
        state = page.text_content("#chat-state")
        n = int(state.split()[1])
        assert n > 1 and len(final) > 0, state
        assert len(partial) < len(final) or n > 1, (partial, final)

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        assert not errors, errors
    finally:
        page.close()


def test_dashboard_shows_a_running_batch_job(browser, three_peers):
    """A batch job submitted to a peer shows on that peer's page with its progress."""
    openai = pytest.importorskip("openai")
    mesh, daemons, view = three_peers
    entry = daemons[1]
    client = openai.OpenAI(base_url=entry.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    lines = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": f"Item {i}", "max_tokens": 64, "temperature": 0}}) + "\n"
                    for i in range(40))
    uploaded = client.files.create(file=("jobs.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    page = browser.new_page()
    try:
        page.goto(entry.url + "/", wait_until="load", timeout=30_000)
        row = f'#batches tr[data-batch-id="{batch.id}"]'
        page.wait_for_selector(row, timeout=20_000)
        text = page.text_content(row)
        assert "in_progress" in text and "/40" in text and "/v1/completions" in text, text
        assert page.is_hidden("#batches-none")
    finally:
        page.close()
        client.batches.cancel(batch.id)


def _load(url: str, name: str, stop: threading.Event, count: int = 60) -> None:
    """Streamed completions one after another (x-request-id ``NAME-i``), bounded in count, until ``stop``."""
    for i in range(count):
        if stop.is_set():
            return
        body = json.dumps({"prompt": f"Busy mesh number {i}", "max_tokens": 24, "temperature": 0,
                           "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json",
                                                                     "X-Request-Id": f"{name}-{i}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.read().rstrip().endswith(b"data: [DONE]")


def _charts(page) -> dict[str, dict]:
    """Each live chart's latest values (what its legend shows) and its sample count."""
    return page.eval_on_selector_all(
        ".chart", "cs => Object.fromEntries(cs.map(c => [c.id, {last: JSON.parse(c.dataset.last || '{}'), "
                  "points: Number(c.dataset.points || 0)}]))")


def test_live_charts_move_under_load_and_a_request_shows_its_timeline(browser, three_peers, tmp_path):
    openai = pytest.importorskip("openai")
    mesh, daemons, view = three_peers
    sup = next(d for d in daemons if d.node_id == view["supernode"])
    entry = next(d for d in daemons if d is not sup)
    names = {d.node_id: d.name for d in daemons}
    # A batch job on the supernode (its progress on the page, its series in /metrics) and
    # two clients streaming through another peer, whose page shows the supernode's figures.
    client = openai.OpenAI(base_url=sup.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    lines = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": f"Line {i}", "max_tokens": 64, "temperature": 0}}) + "\n"
                    for i in range(400))
    uploaded = client.files.create(file=("live.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    stop = threading.Event()
    load = [threading.Thread(target=_load, args=(entry.url, f"load{i}", stop), daemon=True) for i in range(2)]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    try:
        for t in load:
            t.start()
        page.goto(entry.url + "/", wait_until="load", timeout=30_000)
        page.wait_for_function(
            "(() => { const c = document.getElementById('c-stage'); const last = JSON.parse(c.dataset.last || '{}');"
            "  return Number(document.body.dataset.samples) >= 3 && Object.values(last).filter(v => v > 0).length === 3"
            "    && JSON.parse(document.getElementById('c-tps').dataset.last)['tokens/s'] > 0; })()", timeout=90_000)
        first = _charts(page)
        time.sleep(2.5)
        second = _charts(page)
        # The charts moved without a reload: more samples, and new figures while requests run.
        assert all(second[c]["points"] > first[c]["points"] for c in first), (first, second)
        assert second["c-tps"]["last"]["tokens/s"] > 0 and second["c-ttft"]["last"]["p50"] > 0, second
        assert second["c-stage"]["last"] != first["c-stage"]["last"], (first["c-stage"], second["c-stage"])
        assert set(second["c-stage"]["last"]) == set(names.values())  # every peer of the plan, by name
        remote = {names[d.node_id] for d in daemons if d is not sup}
        assert {k for k, v in second["c-hop"]["last"].items() if v} == remote | {f"{n} ping" for n in remote}
        seen = page.evaluate("live.samples.map(s => [s.running, s.kv_reserved])")
        assert max(r for r, _ in seen) >= 1 and max(kv for _, kv in seen) > 0, seen
        assert "the supernode" in page.text_content("#live-source")
        row = page.text_content(f'#batches tr[data-batch-id="{batch.id}"]')
        assert "in_progress" in row and "/400" in row and sup.name in row, row

        # A finished request of the clients' (it entered at this peer), picked from the recent
        # ones: its timeline shows each stage, each hop, the supernode's own parts and this peer's.
        done = page.wait_for_selector('#requests tr[data-request-id^="load"]:has(td:text-is("200"))', timeout=30_000)
        picked = done.get_attribute("data-request-id")
        done.click()
        page.wait_for_function(f"document.getElementById('tl-head').textContent.startsWith('{picked}')"
                               " && document.querySelectorAll('#tl-phases tr.phase-row[data-kind=stage]').length === 3",
                               timeout=30_000)
        rows = page.eval_on_selector_all("#tl-phases tr.phase-row",
                                         "rs => rs.map(r => [r.dataset.kind, r.dataset.peer, Number(r.dataset.ms)])")
        kinds = {(k, p) for k, p, _ in rows}
        assert [p for k, p, _ in rows if k == "stage"] == [a["node"] for a in view["plan"]], rows
        assert {("hop", d.node_id) for d in daemons if d is not sup} <= kinds
        assert {"queue", "sample", "stream", "proxy"} <= {k for k, _ in kinds} and all(ms > 0 for *_, ms in rows)
        assert page.eval_on_selector_all("#tl-bar > div", "ds => ds.length") >= len(rows)

        shot = tmp_path / "dashboard-live.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot: {shot}")
        assert shot.stat().st_size > 50_000
        assert not errors, errors

        # Every metric the Grafana dashboard plots, in the supernode's /metrics while all of it runs.
        with urllib.request.urlopen(sup.url + "/metrics", timeout=10) as resp:
            exposed = {line.split("{")[0].split(" ")[0] for line in resp.read().decode().splitlines()
                       if line and not line.startswith("#")}
        board = json.loads(GRAFANA.read_text())
        wanted = {name for p in board["panels"] for t in p.get("targets", [])
                  for name in re.findall(r"\bmeshd_[a-z0-9_]+", t["expr"])}
        assert len(wanted) > 20 and not wanted - exposed, sorted(wanted - exposed)
    finally:
        stop.set()
        page.close()
        with contextlib.suppress(openai.ConflictError):  # it may have finished
            client.batches.cancel(batch.id)
        for t in load:
            t.join(120)


def test_meshctl_trace_lists_every_stage_adding_up_to_the_wall_time(three_peers):
    """A request through a peer that is not the supernode: its phases on each of the three
    peers are positive and add up to within 10% of what its client waited."""
    mesh, daemons, view = three_peers
    sup = view["supernode"]
    entry = next(d for d in daemons if d.node_id != sup)
    rid = "trace-" + secrets.token_hex(6)
    body = json.dumps({"prompt": "A mesh of small machines", "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(entry.url + "/v1/completions", body,
                                 {"Content-Type": "application/json", "X-Request-Id": rid})
    began = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer = json.loads(resp.read())
    wall_ms = (time.monotonic() - began) * 1000
    assert answer["usage"]["completion_tokens"] > 1

    out = subprocess.run([sys.executable, "-m", "meshd.tools.meshctl", "--url", entry.url, "trace", rid, "--json"],
                         capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    trace = json.loads(out.stdout)
    phases = trace["phases"]
    assert trace["request_id"] == rid and trace["entry"] == entry.node_id and trace["supernode"] == sup
    assert [p["peer"] for p in phases if p["kind"] == "stage"] == [a["node"] for a in view["plan"]]
    assert {p["peer"] for p in phases if p["kind"] == "hop"} == {a["node"] for a in view["plan"]} - {sup}
    assert {"admit", "queue", "sample", "stream", "proxy"} <= {p["kind"] for p in phases}
    assert all(p["ms"] > 0 for p in phases), phases
    total = sum(p["ms"] for p in phases)
    assert abs(total - wall_ms) <= 0.1 * wall_ms, (total, wall_ms, phases)

    table = subprocess.run([sys.executable, "-m", "meshd.tools.meshctl", "--url", entry.url, "trace", rid],
                           capture_output=True, text=True, timeout=60, env=daemon_env(), cwd=ROOT)
    assert table.returncode == 0, table.stderr
    for d in daemons:
        assert re.search(rf"stage forward\s+{d.name}\s+\d+-\d+", table.stdout), table.stdout
    print(table.stdout)


def test_dashboard_follows_a_peer_lost(browser, three_peers):
    """Live: the page's next polls show a peer that left as lost, without a reload."""
    mesh, daemons, view = three_peers
    page = browser.new_page()
    try:
        page.goto(daemons[0].url + "/", wait_until="load", timeout=30_000)
        page.wait_for_function("document.body.dataset.peers === '3'", timeout=20_000)
        gone = daemons[2]
        gone.terminate()
        page.wait_for_function(
            f"""(() => {{ const r = document.querySelector('#peers tr[data-peer-id="{gone.node_id}"]');
                         return r && r.textContent.includes('lost'); }})()""", timeout=30_000)
        time.sleep(0.1)
        status = json.loads(page.evaluate("fetch('/status').then(r => r.text())"))
        assert any(p["id"] == gone.node_id and p["state"] == "lost" for p in status["peers"])
    finally:
        page.close()
