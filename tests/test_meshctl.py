"""``meshctl``, every command, as a user runs it against real ``meshd run`` processes:
against one daemon on loopback, against a two-daemon mesh linked by ``--peer`` (the
table's columns, the streamed text, the exit codes a script branches on), and
against a peer in a namespace that cannot serve."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import secrets
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request

import pytest

from meshd.tools.meshctl import format_status
from shards.manifest import Manifest
from tests.fixtures.daemon import (
    daemon_env,
    free_port,
    http_get,
    running_daemon,
    start_daemon,
    status_json,
    stop_daemon,
)
from tests.fixtures.mesh import GiB


def meshctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshd.tools.meshctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=daemon_env())


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


# -- one daemon ---------------------------------------------------------------------------


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


# -- a two-daemon mesh --------------------------------------------------------------------

# A few ms per layer on both peers, so that splitting the layers pays (and a
# generation lasts long enough to see it stream).
DELAY = ("--debug-layer-delay-ms", "3")


def table(text: str) -> list[dict[str, str]]:
    """The rows of meshctl's table, cut at the header's column starts (cells hold spaces)."""
    lines = text.splitlines()
    h = next(i for i, line in enumerate(lines) if line.startswith("PEER"))
    starts = [m.start() for m in re.finditer(r"\S+", lines[h])]
    names = lines[h].split()
    rows = []
    for line in lines[h + 1:]:
        if not line.strip():
            break
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        rows.append(dict(zip(names, cells)))
    return rows


@pytest.fixture(scope="module")
def mesh(tiny_model_dir, tmp_path_factory):
    """Two daemons: ``alpha`` (more VRAM: the supernode) and ``beta``, which dials it."""
    base = tmp_path_factory.mktemp("meshctl")
    secret = base / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    common = ("--secret-file", str(secret), *DELAY)
    with running_daemon(tiny_model_dir, base / "a", base / "alpha.log", "--name", "alpha",
                        "--advertise-vram", str(8 * GiB), *common) as a:
        b = start_daemon(tiny_model_dir, base / "b", base / "beta.log", "--name", "beta",
                         "--advertise-vram", str(4 * GiB), "--peer", a.url.removeprefix("http://"), *common)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # both in the plan, and beta's RTT measured
                view = json.loads(http_get(a.url + "/status")[1])
                if len(view["plan"]) == 2 and all(p["rtt_ms"] is not None for p in view["peers"]):
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"no two-stage plan: {view}\n{a.log_tail()}\n{b.log_tail()}")
            yield a, b
        finally:
            stop_daemon(b.proc)


def ids(a, b) -> tuple[str, str]:
    return (json.loads(http_get(a.url + "/status")[1])["node"]["id"],
            json.loads(http_get(b.url + "/status")[1])["node"]["id"])


def test_status_table_reads_right_from_either_peer(mesh, tiny_model_dir):
    a, b = mesh
    a_id, b_id = ids(a, b)
    assert meshctl("generate", "--url", a.url, "Warm up", "--max-tokens", "8").returncode == 0  # for tokens/s
    for url in (a.url, b.url):
        out = meshctl("status", "--url", url)
        assert out.returncode == 0, out.stderr
        head = out.stdout.splitlines()[0]
        assert f"supernode {a_id}" in head and "serving" in head and "NOT" not in head, head
        rows = {r["PEER"].split()[0]: r for r in table(out.stdout)}
        assert set(rows) == {a_id, b_id}, out.stdout
        me = a_id if url == a.url else b_id
        assert rows[me]["PEER"].endswith("*")  # the peer asked is marked
        assert re.search(r"^speculation \d+ drafted, \d+ taken", out.stdout, re.M), out.stdout  # the supernode's
        alpha, beta = rows[a_id], rows[b_id]
        assert (alpha["NAME"], alpha["ROLE"], alpha["STATE"]) == ("alpha", "supernode", "ready"), alpha
        assert (beta["NAME"], beta["ROLE"], beta["STATE"]) == ("beta", "stage", "ready"), beta
        assert alpha["DEVICE"] == beta["DEVICE"] == "cpu"
        # RAM in use of total for both, the other peer's as it reports it (in its Pongs).
        for r in (alpha, beta):
            assert re.fullmatch(r"\d+\.\d (MiB|GiB)/\d+\.\d GiB", r["RAM"]), r
            assert r["VRAM"].endswith("GiB")  # advertised, none in use on a CPU peer
            assert re.fullmatch(r"\d+\.\d", r["TOK/S"]), r
        assert float(alpha["TOK/S"]) > 0  # the warm-up's tokens within the last 10 s
        spans = sorted(tuple(map(int, r["LAYERS"].split("-"))) for r in (alpha, beta))
        assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == 6, spans
        other = b_id if url == a.url else a_id
        assert re.fullmatch(r"\d+\.\d\d ms", rows[other]["RTT"]), rows[other]
        assert f"{a_id}[" in out.stdout and f"{b_id}[" in out.stdout  # the plan line


def test_every_peer_reports_its_ram_in_use(mesh):
    """Each peer's /status carries every peer's RAM in use (reported in its Pongs), so the
    table reads used/total for all from the one answer, with no peer asked directly (a
    peer meshctl cannot reach, behind a firewall or TLS, still shows it)."""
    a, b = mesh
    own = {s["node"]["id"]: s["node"]["memory"]["rss"] for s in (status_json(a.url), status_json(b.url))}
    for url in (a.url, b.url):
        status = status_json(url)
        assert len(status["peers"]) == 2
        for p in status["peers"]:
            assert isinstance(p["ram_used"], int) and 0 < p["ram_used"] < p["ram"], p
            # the peer's own figure, not the asked peer's: within what a second of serving moves it
            assert abs(p["ram_used"] - own[p["id"]]) < own[p["id"]] * 0.25, (p, own)
        rows = table(format_status(status))
        assert len(rows) == 2
        for r in rows:
            assert re.fullmatch(r"\d+\.\d (MiB|GiB)/\d+\.\d GiB", r["RAM"]), r


def test_status_json_and_watch(mesh):
    a, _ = mesh
    out = meshctl("status", "--url", a.url, "--json")
    assert out.returncode == 0
    shown = json.loads(out.stdout)
    assert shown["supernode"] and len(shown["peers"]) == 2 and shown["serving"] is True
    out = meshctl("status", "--url", a.url, "--watch", "0.3", "--count", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\nPEER ") == 3 and out.stdout.count("every 0.3 s") == 3


def test_plan_and_peers(mesh):
    a, b = mesh
    a_id, b_id = ids(a, b)
    out = meshctl("--url", b.url, "plan")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("term ") and f"supernode {a_id}" in out.stdout.splitlines()[0]
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:4]}
    assert set(lines) == {a_id, b_id}, out.stdout
    assert sum(int(row[3]) for row in lines.values()) == 6
    assert "terms" in out.stdout
    plan = json.loads(meshctl("--url", b.url, "plan", "--json").stdout)
    assert [p["node"] for p in plan["plan"]] and plan["term"] >= 1

    out = meshctl("--url", a.url, "peers")
    assert out.returncode == 0
    rows = table(out.stdout)
    assert {r["NAME"] for r in rows} == {"alpha", "beta"} and {r["STATE"] for r in rows} == {"ready"}


def test_generate_streams_the_completion(mesh):
    a, b = mesh
    body = json.dumps({"prompt": "Stream me", "max_tokens": 24, "temperature": 0}).encode()
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(b.url + "/v1/completions", body,
                                                       {"Content-Type": "application/json"}), timeout=60) as r:
        want = json.loads(r.read())["choices"][0]["text"]
    proc = subprocess.Popen([sys.executable, "-m", "meshd.tools.meshctl", "--url", b.url, "generate", "Stream me",
                             "--max-tokens", "24"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=daemon_env())
    try:
        chunks, times = [], []
        while True:
            piece = proc.stdout.read1(4096)
            if not piece:
                break
            chunks.append(piece)
            times.append(time.monotonic())
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stderr.read()
    got = b"".join(chunks).decode()
    assert got == want + "\n"
    if len(want) > 4:  # text came in pieces as tokens were made, not all at the end
        assert len(chunks) > 1 and times[-1] - times[0] > 0.02, (len(chunks), times)


def _load(url: str, stop: threading.Event, count: int = 40) -> None:
    """Completions one after another (bounded in count) until ``stop``."""
    body = json.dumps({"prompt": "Keep the mesh busy", "max_tokens": 16, "temperature": 0}).encode()
    for _ in range(count):
        if stop.is_set():
            return
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                           {"Content-Type": "application/json"}), timeout=60) as r:
            r.read()


def _top_in_a_terminal(url: str, until, key: bytes, timeout: float = 60.0) -> tuple[int, str]:
    """``meshctl top`` on a pseudo-terminal of 120x40: read its screen until ``until(text)``,
    then type ``key``; its exit status and everything it wrote."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C reaches it as SIGINT)
        # As a shell starts a command: SIGINT neither blocked nor ignored. A test process's
        # own may be either (seen: top never saw the Ctrl-C, blocked in a read of /live).
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        # faulthandler: a top that does not end is sent SIGABRT below, and shows where it stood.
        os.execve(sys.executable, [sys.executable, "-m", "meshd.tools.meshctl", "--url", url, "top"],
                  daemon_env() | {"PYTHONFAULTHANDLER": "1"})
    out = b""
    try:
        deadline = time.monotonic() + timeout
        while not until(out.decode("utf-8", "replace")):
            assert time.monotonic() < deadline, f"top drew no figures in {timeout:.0f} s: {out[-3000:]!r}"
            if select.select([fd], [], [], 0.5)[0]:
                out += os.read(fd, 65536)
        os.write(fd, key)
        deadline = time.monotonic() + 15
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGABRT)
                time.sleep(1)
                with contextlib.suppress(OSError):
                    while select.select([fd], [], [], 0.5)[0]:
                        out += os.read(fd, 65536)
                raise AssertionError(f"top did not end on {key!r}; where it stood: {out[-3000:].decode(errors='replace')}")
            if select.select([fd], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):  # EIO once the child closed its side
                    out += os.read(fd, 65536)
        with contextlib.suppress(OSError):
            while select.select([fd], [], [], 0.2)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                out += chunk
        return os.waitstatus_to_exitcode(status), out.decode("utf-8", "replace")
    finally:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        os.close(fd)


def test_top_draws_the_live_figures_in_a_terminal_and_quits_on_q_or_ctrl_c(mesh):
    a, b = mesh
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(b.url, stop), daemon=True)
    load.start()
    try:
        def drawn(text: str) -> bool:  # a frame with tokens flowing and both peers' stage times
            frames = text.split("\x1b[H")
            frame = frames[-2] if len(frames) > 2 else ""  # the last whole frame
            m = re.search(r"tokens/s\s+([0-9.]+)", frame)
            return bool(m and float(m.group(1)) > 0 and re.search(r"alpha\s+0-\d+\s+[0-9.]+", frame)
                        and re.search(r"beta\s+\d+-\d+\s+[0-9.]+", frame))

        code, screen = _top_in_a_terminal(b.url, drawn, b"q")  # through beta: the supernode's figures
        assert code == 0, screen[-2000:]
        assert screen.startswith("\x1b[?1049h") and screen.rstrip().endswith("\x1b[?25h\x1b[?1049l"), \
            "the terminal is put back"
        for what in ("figures of the supernode alpha", "running", "TTFT p50", "KV cache", "STAGE ms", "HOP ms"):
            assert what in screen, what
        assert "Traceback" not in screen

        code, screen = _top_in_a_terminal(b.url, lambda text: "tokens/s" in text, b"\x03")  # Ctrl-C
        assert code == 0 and screen.rstrip().endswith("\x1b[?25h\x1b[?1049l") and "Traceback" not in screen, \
            screen[-2000:]
    finally:
        stop.set()
        load.join(90)


def test_trace_of_a_request_and_of_one_it_does_not_know(mesh):
    a, b = mesh
    a_id, b_id = ids(a, b)
    rid = "meshctl-" + secrets.token_hex(4)
    body = json.dumps({"prompt": "Trace me", "max_tokens": 8, "temperature": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(b.url + "/v1/completions", body, {
            "Content-Type": "application/json", "X-Request-Id": rid}), timeout=60) as r:
        assert r.headers["X-Request-Id"] == rid
    out = meshctl("--url", b.url, "trace", rid)
    assert out.returncode == 0, out.stderr
    assert f"request {rid}" in out.stdout and "entry beta -> supernode alpha" in out.stdout
    rows = {tuple(re.split(r"\s{2,}", line.strip())[:2]) for line in out.stdout.splitlines()}
    assert {("stage forward", "alpha"), ("stage forward", "beta"), ("hop", "beta")} <= rows, out.stdout
    listed = meshctl("--url", a.url, "trace")
    assert listed.returncode == 0 and rid in listed.stdout
    missing = meshctl("--url", b.url, "trace", "never-sent")
    assert missing.returncode == 1 and "never-sent" in missing.stderr and "Traceback" not in missing.stderr


def test_drain_moves_a_peer_off_the_plan(mesh):
    a, b = mesh
    a_id, b_id = ids(a, b)
    out = meshctl("--url", b.url, "drain", a_id)
    assert out.returncode == 1 and "refused (HTTP 409)" in out.stderr, out.stderr  # not the supernode
    out = meshctl("--url", b.url, "drain", "no-such-peer")
    assert out.returncode == 1 and "HTTP 404" in out.stderr
    out = meshctl("--url", b.url, "drain", "beta")  # by name, through the peer being drained
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"drained {b_id}: term ") and f"{a_id}[0:6)" in out.stdout
    rows = {r["NAME"]: r for r in table(meshctl("status", "--url", a.url).stdout)}
    assert rows["beta"]["STATE"] == "drained" and rows["beta"]["LAYERS"] == "-"
    assert rows["alpha"]["LAYERS"] == "0-6"


def test_exit_codes_when_nobody_answers_or_the_mesh_cannot_serve(tiny_model_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    for args in (["status"], ["plan"], ["peers"], ["drain", "x"], ["generate", "hi"]):
        out = meshctl("--url", dead, *args)
        assert out.returncode == 2 and "no answer from" in out.stderr, (args, out.stderr)
    assert meshctl("frobnicate").returncode == 64
    assert meshctl("status", "--no-such-flag").returncode == 64

    # A daemon whose model is nowhere: it answers, but cannot serve.
    port = free_port()
    log = open(tmp_path / "nomodel.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "meshd.tools.cli", "run", "--no-mdns", "--host", "127.0.0.1",
                             "--port", str(port), "--state-dir", str(tmp_path / "s"), "--model", "no-such-model",
                             "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT,
                            env=daemon_env() | {"MESHD_FAILOVER_WAIT_S": "1"})  # a 503 without waiting 30 s
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if http_get(url + "/status", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        out = meshctl("status", "--url", url)
        assert out.returncode == 1 and "NOT serving" in out.stdout, out.stdout + out.stderr
        assert meshctl("plan", "--url", url).returncode == 1
        out = meshctl("generate", "--url", url, "hi")
        assert out.returncode == 1 and "HTTP 503" in out.stderr, out.stderr
    finally:
        stop_daemon(proc)
        log.close()


# -- a peer in a namespace that cannot serve ---------------------------------------------


@pytest.mark.netns
def test_meshctl_fails_on_a_peer_that_cannot_serve(meshlab, tiny_model_dir):
    """meshctl's exit code means something: a lone peer without the model answers but cannot serve."""
    host = meshlab.lab.add_host()
    lone = meshlab.start(host, model="no-such-model", vram=GiB)
    meshlab.wait_up([lone])
    res = meshctl("status", "--url", lone.url)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "NOT serving" in res.stdout
