"""The HTTP API of a real mesh with keys and TLS: who gets in, where it listens, what it
never shows, and what a client that hangs up leaves behind.

``keyed``: two ``meshd run`` processes linked by a static peer, each with the same API key
file and control key file: ``alpha`` (the supernode) on 127.0.0.1, ``beta`` (a stage, the
entry peer a client talks to) bound to 127.0.0.2 only. ``tls``: two more, with a
self-signed certificate (made here with ``cryptography``) for the API and the peer links,
forming their mesh over wss and serving over https. Daemons are killed by pid in teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.fixtures.daemon import free_port
from tests.meshlab import daemon_env, greedy_reference

pytestmark = pytest.mark.timeout(300)

GiB = 1 << 30
DELAY = ("--debug-layer-delay-ms", "3")  # splitting the layers pays: beta is a stage
PROMPT = "A mesh of small machines"
MAX_TOKENS = 16
START_S = 90.0
FREE_WAIT_S = 15.0


@dataclass
class Proc:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    state_dir: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def spawn(name: str, host: str, base: Path, model_dir: Path, *extra: str, scheme: str = "http") -> Proc:
    port = free_port()
    state = base / f"state-{name}"
    log_path = base / f"{name}.log"
    cmd = [sys.executable, "-m", "meshd.tools.cli", "run", "--no-mdns", "--host", host, "--port", str(port),
           "--state-dir", str(state), "--model", str(model_dir), "--name", name, "--device", "cpu",
           "--dtype", "float32", "--log-level", "debug", *extra]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=daemon_env() | {"MESHD_SETTLE_S": "0.2"})
    return Proc(name, f"{scheme}://{host}:{port}", proc, log_path, state)


def kill(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.wait(5)


def request(url: str, body: dict | None = None, headers: dict | None = None, ctx=None,
            method: str | None = None, timeout: float = 30) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"raw": raw.decode(errors="replace")}


def wait_mesh(procs: list[Proc], ctx=None, timeout: float = START_S) -> dict:
    """Until every daemon serves one plan with a span on each of them; that view."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.name} exited rc={p.proc.returncode}:\n{p.log_text()[-3000:]}")
        try:
            views = [request(p.url + "/status", ctx=ctx, timeout=3)[1] for p in procs]
        except OSError as exc:
            last = exc
            time.sleep(0.25)
            continue
        last = views
        if all(v.get("serving") for v in views) and len({v.get("term") for v in views}) == 1 \
                and len(views[0]["plan"]) == len(procs):
            return views[0]
        time.sleep(0.25)
    raise AssertionError(f"no mesh within {timeout:.0f} s: {str(last)[:1500]}\n"
                         + "\n".join(f"--- {p.name}\n{p.log_text()[-2000:]}" for p in procs))


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def body(**extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0} | extra


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    return greedy_reference(tiny_model_dir, PROMPT, MAX_TOKENS)


@dataclass
class Keyed:
    alpha: Proc
    beta: Proc
    secret: str
    api_key: str
    control_key: str
    files: dict[str, Path]
    view: dict


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("keyed")
    secret, api_key, control_key = secrets.token_hex(32), "api-" + secrets.token_hex(16), "ctl-" + secrets.token_hex(16)
    files = {}
    for name, value in (("secret", secret), ("api-keys", api_key + "\n"), ("control-keys", control_key + "\n")):
        files[name] = base / name
        files[name].write_text(value)
        files[name].chmod(0o600)
    common = ("--secret-file", str(files["secret"]), "--api-key-file", str(files["api-keys"]),
              "--control-key-file", str(files["control-keys"]), *DELAY)
    alpha = spawn("alpha", "127.0.0.1", base, tiny_model_dir, "--advertise-vram", str(8 * GiB), *common)
    procs = [alpha]
    try:
        beta = spawn("beta", "127.0.0.2", base, tiny_model_dir, "--advertise-vram", str(4 * GiB),
                     "--peer", alpha.url.removeprefix("http://"), *common)
        procs.append(beta)
        view = wait_mesh(procs)
        yield Keyed(alpha, beta, secret, api_key, control_key, files, view)
    finally:
        kill(procs)


# -- keys --------------------------------------------------------------------------------


def test_api_keys_on_every_peer(keyed, reference):
    for p in (keyed.alpha, keyed.beta):  # beta proxies to alpha with a mesh token, not our key
        url = p.url + "/v1/completions"
        status, data = request(url, body())
        assert status == 401 and "API key" in data["error"]["message"], (p.name, status, data)
        for wrong in ("nope", keyed.control_key, keyed.api_key + "x", keyed.secret):
            status, data = request(url, body(), bearer(wrong))
            assert status in (401, 403) and data["error"]["message"], (p.name, wrong, status, data)
        status, data = request(url, body(), {"Authorization": keyed.api_key})  # not "Bearer ..."
        assert status == 401, (p.name, status)
        status, data = request(url, body(), bearer(keyed.api_key))
        assert status == 200 and data["choices"][0]["token_ids"] == reference, (p.name, status, data)
        status, data = request(p.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 4})
        assert status == 401, (p.name, status)
        assert request(p.url + "/v1/models")[0] == 401
        assert request(p.url + "/v1/models", headers=bearer(keyed.api_key))[0] == 200
        # Read-only pages stay open.
        for path in ("/healthz", "/status", "/metrics"):
            with urllib.request.urlopen(p.url + path, timeout=10) as resp:
                assert resp.status == 200, (p.name, path)


def test_control_endpoints_need_the_control_key(keyed):
    for p in (keyed.alpha, keyed.beta):
        url = p.url + "/v1/mesh/drain"
        drain = {"node": "no-such-node"}
        status, data = request(url, drain)
        assert status == 401 and data["error"]["message"], (p.name, status, data)
        for key in (keyed.api_key, "wrong", keyed.secret):  # an API key is not a control key
            status, data = request(url, drain, bearer(key))
            assert status == 403, (p.name, key, status, data)
        # A forged or stale peer token does not stand in for a key.
        for token in ("x", f"{keyed.view['supernode']}:{int(time.time())}:{'0' * 64}",
                      f"{keyed.view['supernode']}:{int(time.time()) - 3600}:{'0' * 64}"):
            status, _ = request(url, drain, {"X-Meshd-Auth": token})
            assert status == 401, (p.name, token, status)
        # With the control key the request gets in (and, here, names no peer: 404).
        status, data = request(url, drain, bearer(keyed.control_key))
        assert status == 404 and "no-such-node" in data["error"]["message"], (p.name, status, data)
    # Nothing was drained.
    assert request(keyed.alpha.url + "/status")[1]["plan"] == keyed.view["plan"]


def test_api_binds_to_the_configured_address(keyed):
    port = int(keyed.beta.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.2", port), timeout=3):
        pass
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=3):
        pass
    status = request(keyed.beta.url + "/status")[1]
    assert status["node"]["addr"] == f"127.0.0.2:{port}"


# -- secrets stay secret -----------------------------------------------------------------------


def test_secret_and_keys_are_never_shown(keyed, tmp_path):
    toml = tmp_path / "meshd.toml"
    toml.write_text(f'secret_file = "{keyed.files["secret"]}"\napi_key_file = "{keyed.files["api-keys"]}"\n'
                    f'control_key_file = "{keyed.files["control-keys"]}"\nmesh = "keyed"\n')
    shown: dict[str, str] = {}
    for p in (keyed.alpha, keyed.beta):
        for path in ("/status", "/metrics", "/", "/healthz"):
            with urllib.request.urlopen(p.url + path, timeout=10) as resp:
                shown[f"{p.name} {path}"] = resp.read().decode(errors="replace")
        for args in (("status",), ("status", "--json"), ("plan", "--json"), ("peers", "--json")):
            out = subprocess.run([sys.executable, "-m", "meshd.tools.meshctl", "--url", p.url, *args],
                                 capture_output=True, text=True, timeout=60, env=daemon_env())
            assert out.returncode == 0, (args, out.stderr)
            shown[f"{p.name} meshctl {' '.join(args)}"] = out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "config", "show", "--config", str(toml)],
                         capture_output=True, text=True, timeout=60, env=daemon_env())
    assert out.returncode == 0 and "keyed" in out.stdout, out.stderr
    shown["meshd config show"] = out.stdout + out.stderr
    # Both logs, written at debug level through every request the other tests made.
    for p in (keyed.alpha, keyed.beta):
        shown[f"{p.name} log"] = p.log_text()
    assert len(shown["alpha log"]) > 1000
    for what, text in shown.items():
        for name, value in (("secret", keyed.secret), ("api key", keyed.api_key),
                            ("control key", keyed.control_key)):
            assert value not in text, f"the {name} appears in {what}"


# -- a client that hangs up -------------------------------------------------------------------


def sessions(p: Proc, supernode: Proc) -> tuple[int, int]:
    """(KV sessions on its engine beyond the supernode's cached prefixes, which every stage
    holds; sessions its scheduler runs)."""
    cached = request(supernode.url + "/status", timeout=5)[1]["node"]["scheduler"]["prefix_cache"]["entries"]
    node = request(p.url + "/status", timeout=5)[1]["node"]
    return node["sessions"] - (cached if node["layers"] else 0), node["scheduler"]["active"]


async def test_disconnect_mid_stream_frees_every_stage(keyed):
    beta_id = request(keyed.beta.url + "/status")[1]["node"]["id"]
    assert {a["node"] for a in keyed.view["plan"]} == {keyed.view["supernode"], beta_id}  # beta is a stage
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
        resp = await http.post(keyed.beta.url + "/v1/completions", headers=bearer(keyed.api_key),
                               json=body(max_tokens=400, stream=True))
        assert resp.status == 200
        tokens, finished = 0, False
        async with asyncio.timeout(30):
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    tokens += len(choice.get("token_ids", []))
                    finished = finished or bool(choice.get("finish_reason"))
                if tokens >= 4:
                    break
        assert tokens >= 4 and not finished
        during = [await asyncio.to_thread(sessions, p, keyed.alpha) for p in (keyed.alpha, keyed.beta)]
        assert during[0][1] == 1 and during[1][0] == 1, during  # alpha schedules it, beta holds its KV
        resp.close()  # hang up mid-stream
    deadline = time.monotonic() + FREE_WAIT_S
    now = during
    while time.monotonic() < deadline:
        now = [await asyncio.to_thread(sessions, p, keyed.alpha) for p in (keyed.alpha, keyed.beta)]
        if now == [(0, 0), (0, 0)]:
            break
        await asyncio.sleep(0.2)
    assert now == [(0, 0), (0, 0)], f"sessions left after the client hung up: {now}"


# -- TLS ---------------------------------------------------------------------------------------


def self_signed(dir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA): ``cryptography`` when this
    Python has it, else the openssl command."""
    cert_path, key_path = dir / "cert.pem", dir / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither cryptography nor openssl to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key_path), "-out", str(cert_path), "-days", "1",
                        "-subj", "/CN=meshd-test", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                       check=True, capture_output=True, timeout=30)
        key_path.chmod(0o600)
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshd-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def test_tls_mesh_over_wss_serves_https(tiny_model_dir, tmp_path, reference):
    cert, key = self_signed(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    # A slower simulated box than the keyed mesh's: over TLS the hop costs more, and the
    # layers must still be split so that forwards cross the wss link.
    common = ("--secret-file", str(secret), "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(cert),
              "--debug-layer-delay-ms", "15")
    ctx = ssl.create_default_context(cafile=str(cert))
    procs = [spawn("tls-a", "127.0.0.1", tmp_path, tiny_model_dir, "--advertise-vram", str(8 * GiB), *common,
                   scheme="https")]
    try:
        port_a = procs[0].url.rsplit(":", 1)[1]
        procs.append(spawn("tls-b", "127.0.0.1", tmp_path, tiny_model_dir, "--advertise-vram", str(4 * GiB),
                           "--peer", f"127.0.0.1:{port_a}", *common, scheme="https"))
        view = wait_mesh(procs, ctx=ctx)  # the link is wss: the servers speak nothing else
        assert len(view["plan"]) == 2
        for p in procs:
            status, data = request(p.url + "/v1/completions", body(), ctx=ctx)
            assert status == 200 and data["choices"][0]["token_ids"] == reference, (p.name, status, data)
        # Plain HTTP to a TLS port gets no answer; an unverified client is refused by the handshake.
        with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
            request(procs[0].url.replace("https://", "http://") + "/status", timeout=5)
        with pytest.raises((urllib.error.URLError, ssl.SSLError)):
            request(procs[0].url + "/status", ctx=ssl.create_default_context(), timeout=5)
        logs = procs[0].log_text() + procs[1].log_text()
        assert secret.read_text() not in logs
        assert "peer_joined" in procs[0].log_text() and "peer_refused" not in logs
    finally:
        kill(procs)


def http_client_errors():
    import http.client

    return http.client.HTTPException
