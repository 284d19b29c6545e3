"""mDNS is unauthenticated: anyone on the LAN can advertise a real peer's node id at
an address of its own. Here an attacker without the secret (tests/mdns_spoofer.py, a
separate process in its own namespace, real zeroconf) does so for both peers of a
mesh before they start, under names of its own and under the real service name, and
moves its adverts to another port five times a second; its adverts claim far more
VRAM than either peer. The two daemons still find each other (each address of an id is
dialled on its own, and the handshake tells the real one), elect the real supernode,
serve the single-node tokens, and find each other again when one restarts under the
attack; a peer whose own service name the attacker holds advertises under another. The
dialling daemon tried the attacker's addresses and refused them: the attack was heard.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path

import pytest

from protocol.messages import PROTOCOL_VERSION
from tests.fixtures.mesh import GiB
from tests.honest import Honest
from tests.meshlab import complete, completion_body, daemon_env, greedy_reference, http_json

pytestmark = pytest.mark.netns

SPOOF_S = 150.0  # the attacker's own bound: longer than the test, shorter than its timeout
READY_S = 20.0
PROMPT = "Spoofed adverts"
MAX_TOKENS = 8
WATCH_S = 5.0


def spoofer_lines(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def refused_from(daemon, addr: str) -> list[dict]:
    return [r for r in daemon.log_events("peer_refused") if str(r.get("addr", "")).split(":")[0] == addr]


@pytest.mark.timeout(240)
def test_spoofed_adverts_of_real_node_ids_do_not_keep_the_peers_apart(meshlab, tiny_model_dir):
    lab = meshlab.lab
    h1, h2, evil = lab.add_host(), lab.add_host(), lab.add_host()
    ids = sorted(secrets.token_hex(6) for _ in range(2))
    out = meshlab.workdir / "spoofer.jsonl"
    argv = [sys.executable, "-m", "tests.mdns_spoofer", "--interface", evil.addr, "--mesh", "lab",
            "--version", str(PROTOCOL_VERSION), "--duration", str(SPOOF_S),
            "--impostor-port", "8470", "--impostor-port", "8471", "--closed-port", "8472", "--closed-port", "8473"]
    for node_id in ids:
        argv += ["--victim", node_id]
    with open(out, "w") as f:
        spoofer = evil.popen(argv, stdout=f, stderr=f, env=daemon_env(), cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + READY_S
        while not any(e["ev"] == "ready" for e in spoofer_lines(out)):
            assert spoofer.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)

        # The smaller id dials first: give it the most VRAM, so the supernode is the first to dial.
        d1 = meshlab.start(h1, model=str(tiny_model_dir), vram=2 * GiB, node_id=ids[0])
        d2 = meshlab.start(h2, model=str(tiny_model_dir), vram=1 * GiB, node_id=ids[1])
        view = meshlab.wait_converged([d1, d2])
        assert view["supernode"] == ids[0], view
        assert {p["id"] for p in view["peers"]} == set(ids), view
        reference = greedy_reference(tiny_model_dir, PROMPT, MAX_TOKENS)
        got, _ = complete(d2.url, PROMPT, MAX_TOKENS)
        assert got == reference, meshlab.fail_report()
        # While the spoofed adverts go on changing: an honest client is served, and no link
        # is lost or replaced (what a believed advert would do).
        churn = [len(d.log_events(e)) for d in (d1, d2) for e in ("peer_joined", "peer_lost")]
        body = completion_body(PROMPT, MAX_TOKENS)
        with Honest(lambda path, b: http_json(d2.url + path, b), (("/healthz", None), ("/v1/completions", body))) as honest:
            time.sleep(WATCH_S)
        honest.assert_live()
        assert [len(d.log_events(e)) for d in (d1, d2) for e in ("peer_joined", "peer_lost")] == churn, \
            meshlab.fail_report()
        assert {d.status()["supernode"] for d in (d1, d2)} == {ids[0]}, meshlab.fail_report()

        # A peer that restarts comes back into a LAN where the spoofed adverts are
        # already there, and still changing.
        d2.terminate()
        d2b = meshlab.start(h2, model=str(tiny_model_dir), vram=1 * GiB, node_id=ids[1], name="h2-again")
        view = meshlab.wait_converged([d1, d2b])
        assert view["supernode"] == ids[0] and {p["id"] for p in view["peers"]} == set(ids), view
        got, _ = complete(d1.url, PROMPT, MAX_TOKENS)
        assert got == reference, meshlab.fail_report()

        # The attack was live all along, and heard: the smaller id, which dials, tried the
        # impostor's addresses too and refused each at the handshake.
        assert spoofer.poll() is None, out.read_text()
        refused = refused_from(d1, evil.addr)
        assert refused and all("secret" in r["reason"] for r in refused), meshlab.fail_report([d1])
        assert all(d.status()["peers"] and {p["id"] for p in d.status()["peers"]} == set(ids) for d in (d1, d2b))
    finally:
        spoofer.terminate()
        spoofer.wait(10)
    updates = [e for e in spoofer_lines(out) if e["ev"] == "exit"]
    assert updates and updates[0]["updates"] > 100 and updates[0]["accepted"] > 0, out.read_text()
