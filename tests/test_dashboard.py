"""The dashboard in a real browser: Debian's headless Chromium, driven by Playwright,
against a three-peer mesh of real daemons in network namespaces (found by mDNS).

The page must load from a peer, show every peer of the mesh (the supernode marked),
the layers as a bar coloured by owner, and a chat answer that streams in. A
screenshot is saved as a test artifact under artifacts/.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.meshlab import MeshLab
from tests.netlab import Lab, netlab_available

CHROMIUM = os.environ.get("MESHD_TEST_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
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
