"""Running meshd as a service: the unit file as systemd reads it, ``meshd install-service``,
and the notify protocol and shutdown order of a real ``meshd run`` against a real
NOTIFY_SOCKET (an AF_UNIX datagram socket bound here, as systemd binds it)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from meshd.config import build_config
from meshd.tools.service import render_config, render_unit, stop_timeout_s
from tests.fixtures.daemon import daemon_env, free_port, http_get, stop_daemon

REPO = Path(__file__).resolve().parent.parent
WATCHDOG_USEC = 300_000  # the daemon pings every half of it: 0.15 s


def unit_directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


# -- the unit file -------------------------------------------------------------------


def test_repo_unit_is_the_rendered_unit():
    assert (REPO / "systemd/meshd.service").read_text() == render_unit()
    assert (REPO / "systemd/meshd.toml.example").read_text() == render_config()


def test_unit_says_what_the_issue_asks():
    d = unit_directives(render_unit())
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["Restart"] == ["on-failure"]
    assert int(d["WatchdogSec"][0]) > 0
    assert d["DynamicUser"] == ["yes"] and d["StateDirectory"] == ["meshd"]
    assert d["ConfigurationDirectory"] == ["meshd"]
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes"), ("PrivateDevices", "no")]:
        assert d[key] == [value], key
    assert set(d["RestrictAddressFamilies"][0].split()) == {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}
    assert "--config /etc/meshd/meshd.toml" in d["ExecStart"][0]
    assert d["LoadCredential"] == ["secret:/etc/meshd/secret"]
    drain = build_config(environ={}).drain_timeout_s
    assert int(d["TimeoutStopSec"][0]) == stop_timeout_s(drain) > 3 * drain
    # Room for the connection limit (issue 15: 1,100 idle connections took every descriptor).
    assert int(d["LimitNOFILE"][0]) > build_config(environ={}).max_connections + 64
    assert d["MemoryMax"] == ["90%"]


@pytest.fixture
def installed(tmp_path) -> dict[str, Path]:
    out = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "install-service", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=daemon_env())
    assert out.returncode == 0, out.stderr
    return {"root": tmp_path, "unit": tmp_path / "etc/systemd/system/meshd.service",
            "config": tmp_path / "etc/meshd/meshd.toml", "secret": tmp_path / "etc/meshd/secret",
            "stdout": out.stdout}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_passes_without_a_warning(installed):
    out = subprocess.run(["systemd-analyze", "verify", str(installed["unit"])], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "" and out.stdout.strip() == "", out.stderr + out.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_security_rates_it_ok(installed):
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=30", str(installed["unit"])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    assert "Overall exposure level for meshd.service" in out.stdout


def test_install_service_writes_config_and_a_private_secret(installed):
    unit = installed["unit"].read_text()
    assert f"ExecStart={Path(sys.executable).with_name('meshd')} run" in unit  # this installation's meshd
    mode = stat.S_IMODE(installed["secret"].stat().st_mode)
    assert mode == 0o600, oct(mode)
    assert len(installed["secret"].read_text().strip()) == 64
    config = build_config(installed["config"], environ={})  # every key in it is a known, valid key
    assert config.port == 8470 and config.mesh == "home"


def test_install_service_keeps_an_existing_config_and_secret(installed):
    secret = installed["secret"].read_text()
    installed["config"].write_text('mesh = "lab"\n')
    out = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "install-service", "--root", str(installed["root"])],
                         capture_output=True, text=True, timeout=60, env=daemon_env())
    assert out.returncode == 0, out.stderr
    assert installed["secret"].read_text() == secret
    assert installed["config"].read_text() == 'mesh = "lab"\n'
    assert "kept" in out.stdout and "systemctl enable --now meshd" in out.stdout


# -- the notify protocol and shutdown, on a real daemon ---------------------------------


class NotifySocket:
    """What systemd does for Type=notify: bind a datagram socket, collect what arrives."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self.healthz_at_ready: int | None = None
        self.url = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            except OSError:
                return
            if "READY=1" in data and self.healthz_at_ready is None and self.url:
                # Right as READY arrives, the API must already answer that it serves.
                with contextlib.suppress(OSError):
                    self.healthz_at_ready = http_get(self.url + "/healthz", timeout=2)[0]
            self.messages.append((time.monotonic(), data))

    def times(self, state: str) -> list[float]:
        return [t for t, m in self.messages if state in m.split("\n")]

    def wait_for(self, state: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := self.times(state):
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no {state} within {timeout} s; got {[m for _, m in self.messages][-5:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def spawn(model_dir: Path, tmp: Path, notify: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = tmp / f"meshd-{port}.log"
    cmd = [sys.executable, "-m", "meshd.tools.cli", "run", "--no-mdns", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(tmp / f"state-{port}"), "--model", str(model_dir), "--name", "svc",
           "--device", "cpu", "--dtype", "float32", *extra]
    env = daemon_env() | {"MESHD_SETTLE_S": "0.2", "NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def log_events(path: Path) -> list[str]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict) and "event" in rec:
                out.append(rec["event"])
    return out


def stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed greedy completion read in a thread: its text events, [DONE] or the error."""
    got: dict = {"events": [], "done": False, "error": None, "first": threading.Event()}

    def run() -> None:
        body = json.dumps({"prompt": "Service", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stop": []}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line == "data: [DONE]":
                        got["done"] = True
                    elif line.startswith("data: "):
                        got["events"].append(json.loads(line[6:]))
                        got["first"].set()
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            got["error"] = repr(exc)
        finally:
            got["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


@pytest.fixture
def notify_socket(tmp_path):
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def test_ready_watchdog_stopping_and_a_drained_exit(tiny_model_dir, tmp_path, notify_socket):
    """READY=1 once /healthz is 200, WATCHDOG=1 over and over, STOPPING=1 at SIGTERM; the
    session in flight at SIGTERM is finished (to [DONE]) before the daemon exits 0."""
    proc, url, log_path = spawn(tiny_model_dir, tmp_path, notify_socket.path, "--debug-layer-delay-ms", "4")
    notify_socket.url = url
    try:
        ready = notify_socket.wait_for("READY=1", 90)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert notify_socket.healthz_at_ready == 200, "READY=1 came before the API served"
        time.sleep(1.0)
        beats = [t for t in notify_socket.times("WATCHDOG=1") if t > ready]
        assert len(beats) >= 4, f"{len(beats)} watchdog pings in 1 s after READY"
        gaps = [b - a for a, b in zip(beats, beats[1:])]
        assert max(gaps) < WATCHDOG_USEC / 1e6, gaps  # always inside the watchdog window

        thread, got = stream_in_thread(url, 60)  # 60 tokens x 6 layers x 4 ms: about 1.5 s
        assert got["first"].wait(30) and got["error"] is None, got
        os.kill(proc.pid, signal.SIGTERM)
        stopping = notify_socket.wait_for("STOPPING=1", 5)
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        thread.join(30)
        assert got["done"] and got["error"] is None, got  # finished, not cut off
        n_tokens = sum(len(c["token_ids"]) for e in got["events"] for c in e["choices"])
        assert n_tokens == 60 or got["events"][-1]["choices"][0]["finish_reason"] == "stop"
        assert stopping > ready
        assert len([t for t in notify_socket.times("WATCHDOG=1") if t > stopping]) >= 1  # pinged while draining
        events = log_events(log_path)
        order = [events.index(e) for e in ("signal_received", "node_stopping", "session_finished", "node_stopped")]
        assert order == sorted(order), events[-20:]
    finally:
        stop_daemon(proc)


def test_second_sigterm_forces_exit_during_a_slow_drain(tiny_model_dir, tmp_path, notify_socket):
    proc, url, log_path = spawn(tiny_model_dir, tmp_path, notify_socket.path, "--debug-layer-delay-ms", "40")
    notify_socket.url = url
    try:
        notify_socket.wait_for("READY=1", 90)
        thread, got = stream_in_thread(url, 400)  # about 100 s of tokens: far beyond this test
        assert got["first"].wait(30) and got["error"] is None, got
        os.kill(proc.pid, signal.SIGTERM)
        notify_socket.wait_for("STOPPING=1", 5)
        time.sleep(1.0)
        assert proc.poll() is None, "exited at the first SIGTERM while a session was in flight"
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(5)
        assert rc == 130, rc
        assert "forced_exit" in log_events(log_path)
        thread.join(10)
        assert not got["done"]
    finally:
        stop_daemon(proc)
