"""``meshctl status`` and the ``meshd run`` daemon, as a user runs them: real processes on loopback."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from shards.engine import StageEngine, generate_greedy
from shards.manifest import Manifest
from shards.span import Span
from shards.tokenizer import MeshTokenizer
from tests.fixtures.daemon import free_port, http_get, running_daemon, status_json, stop_daemon


def meshctl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.tools.meshctl", *args], capture_output=True, text=True,
                          timeout=timeout)


def table_rows(stdout: str) -> list[dict[str, str]]:
    """The peer table of ``meshctl status`` as one dict per row, keyed by column title
    (columns are separated by two or more spaces; the table ends at a blank line)."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("PEER"))
    titles = re.split(r"\s{2,}", lines[header].strip())
    rows = []
    for line in lines[header + 1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(titles), (titles, cells)
        rows.append(dict(zip(titles, cells)))
    return rows


def test_meshctl_status_table(tiny_daemon, tiny_model_dir):
    n_layers = Manifest.load(tiny_model_dir).n_layers
    me = status_json(tiny_daemon.url)["node"]["id"]

    out = meshctl("status", "--url", tiny_daemon.url)

    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert f"supernode {me}" in first
    assert "serving" in first and "NOT serving" not in first
    assert f"{me}[0:{n_layers})" in out.stdout
    rows = table_rows(out.stdout)
    assert {"PEER", "NAME", "ADDR", "ROLE", "DEVICE", "VRAM", "RAM", "LAYERS", "STATE", "RTT"} <= rows[0].keys()
    assert len(rows) == 1
    (row,) = rows
    assert row["PEER"].split()[0] == me
    assert row["NAME"] == "test-daemon"
    assert row["ADDR"] == tiny_daemon.url.removeprefix("http://")
    assert row["ROLE"] == "supernode"
    assert row["DEVICE"] == "cpu"
    assert row["LAYERS"] == f"0-{n_layers}"
    assert row["STATE"] == "ready"


def test_meshctl_url_before_the_subcommand(tiny_daemon):
    out = meshctl("--url", tiny_daemon.url, "status")
    assert out.returncode == 0, out.stderr
    assert "supernode" in out.stdout


def test_meshctl_status_json_is_the_status(tiny_daemon, tiny_model_dir):
    n_layers = Manifest.load(tiny_model_dir).n_layers
    out = meshctl("status", "--url", tiny_daemon.url, "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    direct = status_json(tiny_daemon.url)

    assert shown.keys() == direct.keys()
    assert {"node", "supernode", "term", "model", "plan", "peers"} <= shown.keys()
    me = direct["node"]["id"]
    assert shown["supernode"] == me
    assert shown["term"] == direct["term"] >= 1
    assert shown["model"] == direct["model"]
    assert shown["plan"] == direct["plan"] == [{"node": me, "start": 0, "stop": n_layers}]
    assert [p.keys() for p in shown["peers"]] == [p.keys() for p in direct["peers"]]
    (peer,) = shown["peers"]
    assert (peer["id"], peer["role"], peer["layers"], peer["state"]) == (me, "supernode", [0, n_layers], "ready")


def test_meshctl_against_a_dead_port_exits_2():
    out = meshctl("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "no answer" in out.stderr


def test_meshctl_against_something_not_meshd_is_not_a_traceback(tiny_daemon):
    """A URL that answers, but not with /status JSON (here: a path under the daemon that 404s)."""
    out = meshctl("status", "--url", tiny_daemon.url + "/v1/nothing")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr


def test_daemon_completion_equals_direct_greedy(tiny_daemon, tiny_model_dir):
    """The real ``meshd run`` serves the same greedy tokens as the engine run directly."""
    tok = MeshTokenizer.load(tiny_model_dir)
    prompt = "A mesh of small machines"
    engine = StageEngine.load(tiny_model_dir, Span(0, Manifest.load(tiny_model_dir).n_layers), True, True,
                              "cpu", "float32")
    try:
        want = engine.run_sync(lambda: generate_greedy(engine, tok.encode(prompt), 20))
    finally:
        engine.close()
    req = urllib.request.Request(
        tiny_daemon.url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": 20, "temperature": 0}).encode(),
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = json.loads(resp.read())
    assert data["choices"][0]["token_ids"] == want
    assert data["choices"][0]["text"] == tok.decode(want)


def test_daemon_stops_cleanly_on_sigterm(tiny_model_dir, tmp_path):
    """SIGTERM: the daemon stops serving and exits 0 well within its drain timeout."""
    with running_daemon(tiny_model_dir, tmp_path / "state", tmp_path / "meshd.log") as served:
        assert http_get(served.url + "/healthz")[0] == 200
        served.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = served.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"meshd did not exit 15 s after SIGTERM; log:\n{served.log_tail()}")
        assert rc == 0, served.log_tail()
        assert time.monotonic() - t0 < 15
        with pytest.raises(OSError):
            http_get(served.url + "/healthz", timeout=2)
        assert "node_stopped" in served.log_tail()
    assert stop_daemon(served.proc) == 0
