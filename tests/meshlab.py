"""A harness for real ``meshd run`` daemons in lab hosts (network namespaces).

    mesh = MeshLab(lab, workdir)                # per-run secret file and state dirs
    a = mesh.start(lab.add_host(), model=str(model_dir), vram=4 << 30)
    b = mesh.start(lab.add_host(), model="tiny-llama")       # fetches its span
    view = mesh.wait_converged([a, b])          # every /status agrees: term, plan, serving
    tokens, text = complete(b.url, "A mesh", 16)
    mesh.fail_report()                          # each daemon's log tail, for assertion messages

Each daemon runs in its own namespace on the bridge, binds its host's address,
and runs mDNS there only (``--mdns-interface <addr>``). Daemons are started
through ``host.popen`` so the lab kills them (by pid) even when a test fails.
The pytest process reaches hosts through ``lab.uplink()``. Every wait here is
bounded in time and in count.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shards import qblocks, rowops
from tests.netlab import Host, Lab, _pid_alive

PORT = 8470
START_TIMEOUT_S = 120.0  # Python + torch import + speed probe on 2 shared cores, several at once
CONVERGE_TIMEOUT_S = 120.0
POLL_S = 0.25
HTTP_TIMEOUT_S = 5.0
COMPLETION_TIMEOUT_S = 180.0
LOG_TAIL_LINES = 30


def daemon_env() -> dict[str, str]:
    """The caller's environment without MESHD_* (a Makefile's state dir must not leak in).
    One torch thread per daemon: several share 2 cores, and oversubscribed torch spins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
    return env | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} | _built_kernels()


@functools.cache
def _built_kernels() -> dict[str, str]:
    """The C kernels built once here, in this suite's cache, for every daemon it starts: four
    daemons of a mesh each compiling them at once, on 2 cores beside the other tests, took
    the mesh past its 60 s to converge. (The cache is keyed by source, compiler and CPU, so a
    daemon given another compiler still builds its own.)"""
    qblocks.library()
    qblocks.build(rowops.SOURCE)
    return {"MESHD_KERNEL_CACHE": str(qblocks.cache_dir())}


# -- HTTP from the pytest process ------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, dict]:
    """GET (or POST ``body``) and the JSON answer, error statuses included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw.decode(errors="replace")}


_POST_IN_NS = """
import json, sys, urllib.request, urllib.error
url, body, timeout = sys.argv[1], sys.argv[2].encode(), float(sys.argv[3])
req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        print(resp.status); print(resp.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code); print(exc.read().decode())
"""


def http_json_from(host, url: str, body: dict, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, dict]:
    """POST ``body`` from inside ``host``'s namespace: a caller on that box (control
    endpoints answer only those, peers and key holders)."""
    out = host.run([sys.executable, "-c", _POST_IN_NS, url, json.dumps(body), str(timeout)],
                   capture_output=True, text=True, timeout=timeout + 30)
    assert out.returncode == 0, out.stderr
    status, _, payload = out.stdout.partition("\n")
    try:
        return int(status), json.loads(payload)
    except ValueError:
        return int(status), {"raw": payload}


def completion_body(prompt: str, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | extra


def complete(url: str, prompt: str, max_tokens: int, timeout: float = COMPLETION_TIMEOUT_S) -> tuple[list[int], dict]:
    """POST a greedy completion; the choice's ``token_ids`` and the whole answer."""
    status, data = http_json(url + "/v1/completions", completion_body(prompt, max_tokens), timeout=timeout)
    if status != 200:
        raise AssertionError(f"POST {url}/v1/completions: HTTP {status}: {json.dumps(data)[:600]}")
    return list(data["choices"][0]["token_ids"]), data


def complete_stream(url: str, prompt: str, max_tokens: int,
                    timeout: float = COMPLETION_TIMEOUT_S) -> tuple[list[int], list]:
    """POST a greedy streamed completion; the token ids of every SSE event in order,
    and the decoded events (``"[DONE]"`` last)."""
    body = json.dumps(completion_body(prompt, max_tokens, stream=True)).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        ctype = resp.headers.get("Content-Type", "")
        assert resp.status == 200 and ctype.startswith("text/event-stream"), (resp.status, ctype)
        raw = resp.read().decode()
    events: list = []
    for block in raw.split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]  # ":" lines: keepalives
        if not lines:
            continue
        assert all(ln.startswith("data: ") for ln in lines), f"not an SSE data event: {block[:200]!r}"
        payload = "\n".join(ln.removeprefix("data: ") for ln in lines)
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    tokens = [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]
    return tokens, events


def greedy_reference(model_dir: Path, prompt: str, n: int, ignore_eos: bool = False) -> list[int]:
    """What one node answers at temperature 0: the whole model as one engine in this
    process, cut at the first end-of-sequence (which the API does not send), unless
    ``ignore_eos`` (as the API's field)."""
    from shards.engine import StageEngine, generate_greedy
    from shards.manifest import Manifest
    from shards.span import Span
    from shards.tokenizer import MeshTokenizer

    import torch

    tok = MeshTokenizer.load(model_dir)
    engine = StageEngine.load(model_dir, Span(0, Manifest.load(model_dir).n_layers), True, True, "cpu", "float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons run (OMP_NUM_THREADS=1): the same kernels, the same sums
    try:
        out = engine.run_sync(lambda: generate_greedy(engine, tok.encode_prompt(prompt), n))
    finally:
        torch.set_num_threads(threads)
        engine.close()
    for i, t in enumerate(out):
        if t in tok.eos_ids and not ignore_eos:
            return out[:i]
    return out


# -- daemons ---------------------------------------------------------------------------


@dataclass
class Daemon:
    """One ``meshd run`` in a lab host."""

    name: str
    host: Host
    proc: subprocess.Popen
    state_dir: Path
    log_path: Path
    argv: list[str]
    started: float  # time.monotonic() at spawn
    port: int = PORT
    started_wall: float = field(default_factory=time.time)

    @property
    def url(self) -> str:
        return f"http://{self.host.addr}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def status(self, timeout: float = HTTP_TIMEOUT_S) -> dict | None:
        """This daemon's /status, or None while it does not answer."""
        try:
            code, data = http_json(self.url + "/status", timeout=timeout)
        except (OSError, ValueError, http.client.HTTPException):
            return None
        return data if code == 200 else None

    @property
    def node_id(self) -> str:
        """The persistent node id it wrote into its state dir at start-up."""
        path = self.state_dir / "node-id"
        return path.read_text().strip() if path.exists() else ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to this daemon's pid (``ip netns exec`` execs, so it is meshd's)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def stop(self) -> None:
        """SIGSTOP: the process hangs, sends nothing, its sockets stay open."""
        self.signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.signal(signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.alive():
            self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_events(self, event: str | None = None) -> list[dict]:
        """The daemon's JSON log lines (structlog writes JSON when not on a terminal)."""
        out = []
        for line in self.log_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and (event is None or rec.get("event") == event):
                out.append(rec)
        return out

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@dataclass
class MeshLab:
    """Daemons in the hosts of ``lab``, with a secret file and state dirs under ``workdir``."""

    lab: Lab
    workdir: Path
    daemons: list[Daemon] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.uplink = self.lab.uplink()
        self.secret_file = self.new_secret("secret")

    def new_secret(self, name: str) -> Path:
        path = self.workdir / name
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
        return path

    def start(self, host: Host, *, model: str, name: str | None = None, mesh: str = "lab",
              secret_file: Path | None = None, vram: int | None = None, mdns: bool = True,
              peers: tuple[str, ...] = (), layer_delay_ms: float | None = None,
              extra: tuple[str, ...] = (), env: dict[str, str] | None = None, port: int = PORT,
              node_id: str | None = None) -> Daemon:
        """Spawn ``meshd run`` in ``host``; returns at once (see ``wait_up``). ``node_id``:
        the id it will have (written into its new state dir), where a test must know it first."""
        assert host.addr is not None, "a daemon needs a host on the bridge"
        name = name or host.name
        state = self.workdir / f"state-{name}"
        state.mkdir(parents=True, exist_ok=False)  # a fresh, empty state dir per daemon per run
        if node_id is not None:
            (state / "node-id").write_text(node_id + "\n")
        argv = [sys.executable, "-m", "meshd.tools.cli", "run", "--name", name, "--host", host.addr,
                "--port", str(port), "--mesh", mesh, "--secret-file", str(secret_file or self.secret_file),
                "--state-dir", str(state), "--model", model, "--device", "cpu", "--dtype", "float32",
                "--log-level", "info"]
        argv += ["--mdns-interface", host.addr] if mdns else ["--no-mdns"]
        for p in peers:
            argv += ["--peer", p]
        if vram is not None:
            argv += ["--advertise-vram", str(vram)]
        if layer_delay_ms is not None:
            argv += ["--debug-layer-delay-ms", str(layer_delay_ms)]
        argv += list(extra)
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=daemon_env() | (env or {}), cwd=_repo_root())
        d = Daemon(name, host, proc, state, log_path, argv, time.monotonic(), port)
        self.daemons.append(d)
        return d

    # -- waiting -------------------------------------------------------------------

    def wait_up(self, daemons: list[Daemon], timeout: float = START_TIMEOUT_S) -> None:
        """Until every daemon answers /status (serving or not)."""
        deadline = time.monotonic() + timeout
        left = list(daemons)
        for _ in range(int(timeout / POLL_S) + 1):
            self._check_running(left)
            left = [d for d in left if d.status(timeout=2) is None]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        if left:
            raise AssertionError(f"no /status from {[d.name for d in left]} within {timeout:.0f} s"
                                 + self.fail_report(daemons))

    def wait_converged(self, daemons: list[Daemon], timeout: float = CONVERGE_TIMEOUT_S,
                       n_stages: int | None = None) -> dict:
        """Until every daemon's /status agrees: serving, one term, one supernode, one plan,
        and every daemon listing exactly ``daemons`` as its live peers. Returns one view
        (with ``"converged_s"``: seconds from the earliest spawn)."""
        deadline = time.monotonic() + timeout
        views: list = []
        ids: set[str] = set()
        for _ in range(int(timeout / POLL_S) + 1):
            self._check_running(daemons)
            ids = {d.node_id for d in daemons}  # written by each daemon at start-up
            views = [d.status(timeout=2) for d in daemons]
            if all(views) and _agree(views, ids) and (n_stages is None or len(views[0]["plan"]) >= n_stages):
                view = dict(views[0])
                view["converged_s"] = round(time.monotonic() - min(d.started for d in daemons), 2)
                return view
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        brief = [None if v is None else {k: v.get(k) for k in ("supernode", "term", "serving", "reason", "plan")}
                 | {"peers": [(p["id"], p["state"]) for p in v.get("peers", [])]} for v in views]
        raise AssertionError(f"no converged plan within {timeout:.0f} s; want peers {sorted(ids)}; last views:\n"
                             + json.dumps(brief, indent=1)[:4000] + self.fail_report(daemons))

    def wait_log(self, daemon: Daemon, event: str, timeout: float = 30.0, **match) -> dict:
        """The first log record of ``event`` (with fields ``match``) in ``daemon``'s log."""
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / POLL_S) + 1):
            for rec in daemon.log_events(event):
                if all(rec.get(k) == v for k, v in match.items()):
                    return rec
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        raise AssertionError(f"{daemon.name} logged no {event} {match or ''} within {timeout:.0f} s"
                             + self.fail_report([daemon]))

    def _check_running(self, daemons: list[Daemon]) -> None:
        dead = [d for d in daemons if not d.alive()]
        if dead:
            raise AssertionError("daemon exited: " + ", ".join(f"{d.name} rc={d.proc.returncode}" for d in dead)
                                 + self.fail_report(dead))

    # -- reporting and ending --------------------------------------------------------

    def fail_report(self, daemons: list[Daemon] | None = None, lines: int = LOG_TAIL_LINES) -> str:
        """Each daemon's log tail, for an assertion message."""
        out = []
        for d in daemons if daemons is not None else self.daemons:
            state = "running" if d.alive() else f"exited rc={d.proc.returncode}"
            out.append(f"\n----- {d.name} ({d.host.addr}, pid {d.pid}, {state}, id {d.node_id or '?'}) "
                       f"log tail {d.log_path} -----\n{d.log_tail(lines)}")
        return "".join(out)

    def close(self, grace_s: float = 3.0) -> None:
        """SIGTERM every daemon by pid, SIGKILL what is left after ``grace_s`` (a stage
        that stops asks to be drained first; at teardown nobody needs that)."""
        for d in self.daemons:
            if d.alive():
                d.signal(signal.SIGCONT)
                d.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for d in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                d.proc.wait(max(0.1, deadline - time.monotonic()))
            if d.alive():
                d.kill()
        assert not any(_pid_alive(d.pid) for d in self.daemons if d.proc.poll() is None)


def _agree(views: list[dict], ids: set[str]) -> bool:
    first = views[0]
    if not first.get("supernode") or first["supernode"] not in ids or not first.get("plan"):
        return False
    for v in views:
        live = {p["id"] for p in v.get("peers", []) if p.get("state") != "lost"}
        if not v.get("serving") or live != ids:
            return False
        if (v["term"], v["supernode"], v["plan"]) != (first["term"], first["supernode"], first["plan"]):
            return False
    return True


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def plan_spans(view: dict) -> list[tuple[str, int, int]]:
    return [(a["node"], a["start"], a["stop"]) for a in view["plan"]]
