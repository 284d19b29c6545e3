"""The ``meshd run`` daemon as a user runs it: a real process on loopback that answers
what the engine computes, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

from shards.engine import StageEngine, generate_greedy
from shards.manifest import Manifest
from shards.span import Span
from shards.tokenizer import MeshTokenizer
from tests.fixtures.daemon import http_get, running_daemon, stop_daemon


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
