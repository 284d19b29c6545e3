"""Control calls that cannot be rebound or routed around the supernode's key (issue #32).

``split``: two ``meshd run`` processes: ``alpha``, the supernode on 127.0.0.1, with a
control key file (and no API keys: completions stay open), and ``beta``, a stage bound
to 127.0.0.2 with no keys at all, which also allows the name ``.mesh.example``. The
attacks of the issue, each repeated: a DNS-rebinding page (a ``Host`` and ``Origin`` of
the attacker's name) on either peer, from a separate process; a drain handed to the
keyless member, which used to reach the supernode as "one of us" and drain a peer. An
honest client is served by beta all the while, and the plan never changes.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import pytest

from tests.honest import Honest
from tests.test_api_security import DELAY, GiB, Proc, bearer, kill, request, spawn, wait_mesh

pytestmark = pytest.mark.timeout(300)

EVIL = "rebind.evil.example"
ROUNDS = 20

# The attacker: a separate process that POSTs drains (and Batch API reads) with a
# rebinding Host and Origin, as a browser would after the attacker's name resolved to
# the peer; prints the statuses and bodies it got, one JSON line each.
ATTACKER = r"""
import http.client, json, sys
host, port, name, rounds, node = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
for i in range(rounds):
    for method, path, body in (("POST", "/v1/mesh/drain", json.dumps({"node": node})), ("GET", "/v1/files", None),
                               ("GET", "/v1/batches", None)):
        c = http.client.HTTPConnection(host, port, timeout=30)
        hdrs = {"Host": f"{name}:{port}", "Origin": f"http://{name}:{port}", "Content-Type": "application/json"}
        c.request(method, path, body, hdrs)
        r = c.getresponse()
        print(json.dumps({"path": path, "status": r.status, "body": json.loads(r.read() or b"null")}), flush=True)
        c.close()
"""


@dataclass
class Split:
    alpha: Proc
    beta: Proc
    control_key: str
    view: dict


@pytest.fixture(scope="module")
def split(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("split")
    secret, control_key = secrets.token_hex(32), "ctl-" + secrets.token_hex(16)
    (base / "secret").write_text(secret)
    (base / "control-keys").write_text(control_key + "\n")
    for f in ("secret", "control-keys"):
        (base / f).chmod(0o600)
    alpha = spawn("alpha", "127.0.0.1", base, tiny_model_dir, "--advertise-vram", str(8 * GiB),
                  "--secret-file", str(base / "secret"), "--control-key-file", str(base / "control-keys"), *DELAY)
    procs = [alpha]
    try:
        beta = spawn("beta", "127.0.0.2", base, tiny_model_dir, "--advertise-vram", str(4 * GiB),
                     "--peer", alpha.url.removeprefix("http://"), "--secret-file", str(base / "secret"),
                     "--allowed-host", ".mesh.example", *DELAY)
        procs.append(beta)
        yield Split(alpha, beta, control_key, wait_mesh(procs))
    finally:
        kill(procs)


def honest_client(url: str) -> Honest:
    """A client of beta's that asks /healthz and a short completion over and over."""
    return Honest(lambda path, body: request(url + path, body, timeout=30),
                  (("/healthz", None), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})))


def _host_port(p: Proc) -> tuple[str, int]:
    host, port = p.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _raw(p: Proc, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict]:
    """A request with a Host of our choosing (urllib would set its own)."""
    import http.client

    host, port = _host_port(p)
    c = http.client.HTTPConnection(host, port, timeout=30)
    try:
        c.request(method, path, None if body is None else json.dumps(body),
                  {"Content-Type": "application/json", **headers})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        c.close()


def _assert_error(data: dict, status: int) -> None:
    err = data["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], data
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), data


def test_a_rebinding_host_is_refused_on_every_peer(split):
    """A page whose name now resolves to a peer: its drain and Batch API calls carry the
    attacker's Host. Every one is a 403 naming Host, on the supernode and on the member,
    while beta serves an honest client; nothing is drained."""
    victim = split.view["plan"][-1]["node"]
    with honest_client(split.beta.url) as honest:
        for p in (split.alpha, split.beta):
            host, port = _host_port(p)
            out = subprocess.run([sys.executable, "-c", ATTACKER, host, str(port), EVIL, str(ROUNDS), victim],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            answers = [json.loads(line) for line in out.stdout.splitlines()]
            assert len(answers) == 3 * ROUNDS
            for a in answers:
                assert a["status"] == 403, (p.name, a)
                _assert_error(a["body"], 403)
                assert a["body"]["error"]["param"] == "Host" and EVIL in a["body"]["error"]["message"], a
    honest.assert_live()
    status = request(split.alpha.url + "/status")[1]
    assert status["plan"] == split.view["plan"] and status["term"] == split.view["term"]


def test_names_of_the_peer_pass_the_host_check(split):
    """Loopback names, the address the connection reached, this machine's hostname and an
    allowed domain pass the Host check (and then meet the key check: 401 on alpha)."""
    import socket

    host, port = _host_port(split.alpha)
    for name in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"{socket.gethostname()}:{port}"):
        status, data = _raw(split.alpha, "POST", "/v1/mesh/drain", {"Host": name}, {"node": "no-such-node"})
        assert status == 401, (name, status, data)
    bhost, bport = _host_port(split.beta)
    for name in (f"{bhost}:{bport}", f"api.mesh.example:{bport}", "mesh.example"):
        status, data = _raw(split.beta, "GET", "/v1/batches", {"Host": name})
        assert status == 200, (name, status, data)
    for name in ("mesh.example.evil.example", "evilmesh.example", "10.255.0.1"):
        status, data = _raw(split.beta, "GET", "/v1/batches", {"Host": name})
        assert status == 403 and data["error"]["param"] == "Host", (name, status, data)


def test_host_headers_are_read_as_browsers_send_them():
    """The name in Host without port or brackets; an allowed domain covers its subdomains,
    not names that merely end the same way; "*" turns the check off."""
    from meshd.serving.guards import host_allowed, host_name

    assert [host_name(h) for h in ("Example.ORG:8470", "[::1]:80", "::1", "a.b.", "10.0.0.1")] == \
        ["example.org", "::1", "::1", "a.b", "10.0.0.1"]
    assert host_allowed("api.localhost:1", None, ()) and host_allowed(None, None, ())
    assert host_allowed("10.9.9.9:1", ("10.9.9.9", 1), ())  # the address the connection reached
    assert not host_allowed("10.9.9.9:1", ("10.9.9.8", 1), ())
    assert host_allowed("x.mesh.example", None, (".mesh.example",))
    assert not host_allowed("xmesh.example", None, (".mesh.example",))
    assert host_allowed(EVIL, None, ("*",)) and not host_allowed(EVIL, None, ("mesh.example",))


def test_a_drain_through_a_keyless_member_needs_the_supernodes_control_key(split):
    """The issue's drain, sent to beta (no keys) from its own box with a proper Host: beta
    lets it through to the supernode, which now asks for its control key: 401 without
    one, 403 with a wrong or second key; with the key it gets in (here: no such node).
    An honest client is served throughout; the plan never changes."""
    victim = split.view["plan"][-1]["node"]
    with honest_client(split.beta.url) as honest:
        for _ in range(ROUNDS):
            status, data = request(split.beta.url + "/v1/mesh/drain", {"node": victim})
            assert status == 401, (status, data)
            _assert_error(data, 401)
            for key in ("wrong", "ctl-" + secrets.token_hex(16)):
                status, data = request(split.beta.url + "/v1/mesh/drain", {"node": victim}, bearer(key))
                assert status == 403, (key, status, data)
                _assert_error(data, 403)
        status, data = request(split.beta.url + "/v1/mesh/drain", {"node": "no-such-node"},
                               bearer(split.control_key))
        assert status == 404 and "no-such-node" in data["error"]["message"], (status, data)
    honest.assert_live()
    status = request(split.alpha.url + "/status")[1]
    assert status["plan"] == split.view["plan"] and status["term"] == split.view["term"]


def test_a_member_leaving_still_hands_its_span_away_without_a_key(split):
    """A stage's own shutdown asks the supernode to move its span (the one control act a
    member may ask without a key, and only for itself): the supernode, whose drains need
    a key, still takes the span over before beta goes."""
    os.kill(split.beta.proc.pid, signal.SIGTERM)
    split.beta.proc.wait(60)
    log = split.beta.log_text()
    drained = [json.loads(line) for line in log.splitlines() if '"drained_self"' in line]
    assert drained and drained[-1]["status"] == 200, log[-3000:]
    deadline = time.monotonic() + 30
    while True:
        status = request(split.alpha.url + "/status")[1]
        if [s["node"] for s in status["plan"]] == [split.view["supernode"]] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [s["node"] for s in status["plan"]] == [split.view["supernode"]], status["plan"]
