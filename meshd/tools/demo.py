"""``meshd demo``: N daemons on 127.0.0.1 (mDNS bound to loopback), one
completion through a peer that is not the supernode, then ``meshctl status``.

Only the first peer starts with the model; the others fetch their spans from it,
as a real home lab would.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from meshd.config import build_config
from meshd.tools.meshctl import format_status, get_json
from shards.manifest import Manifest

READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(urls: list[str], n: int, procs: list[subprocess.Popen], deadline: float) -> dict:
    """Poll until every peer serves and the plan has ``n`` stages, or fail."""
    last: dict = {}
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a daemon exited early with code {p.returncode}")
        try:
            views = [get_json(u + "/status", timeout=2) for u in urls]
        except OSError:
            time.sleep(0.5)
            continue
        last = views[0]
        # Every peer serving under one term and seeing all the others. Not "n stages":
        # placement may rightly give the supernode no layers, or a peer none.
        linked = all(sum(p["state"] != "lost" for p in v["peers"]) == n for v in views)
        if all(v.get("serving") for v in views) and len({v["term"] for v in views}) == 1 and linked:
            return views[0]
        time.sleep(0.5)
    raise RuntimeError(f"the mesh did not become ready in time; last status: {json.dumps(last)[:800]}")


def run_demo(args: argparse.Namespace) -> int:
    from shards.fetch import fetch_default

    state = build_config(flags={"state_dir": args.state_dir}).state_dir
    given = Path(args.model).expanduser()
    # A model directory is used as it is (tests run the demo on a tiny one); a name is fetched.
    model_dir = given if (given / "manifest.json").is_file() else fetch_default(state, args.model)
    name = Manifest.load(model_dir).name
    work = Path(tempfile.mkdtemp(prefix="meshd-demo-"))
    secret = work / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    mesh = f"demo-{os.getpid()}"
    ports = [args.base_port + i if args.base_port else free_port() for i in range(args.peers)]
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for i, port in enumerate(ports):
            argv = [sys.executable, "-m", "meshd.tools.cli", "run", "--name", f"demo-{i}", "--host", "127.0.0.1",
                    "--port", str(port), "--mesh", mesh, "--secret-file", str(secret),
                    "--state-dir", str(work / f"peer-{i}"), "--mdns-interface", "127.0.0.1",
                    # N daemons share this box's cores: one torch thread each.
                    "--threads", "1"]
            if i == 0:
                # The first peer has the model and, advertising the most VRAM, is supernode.
                argv += ["--model", str(model_dir), "--advertise-vram", str(1 << 30)]
            else:
                argv += ["--model", name]
            log = open(work / f"peer-{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        print(f"meshd demo: {args.peers} peers on ports {', '.join(map(str, ports))}; logs in {work}", flush=True)
        t0 = time.monotonic()
        _wait_serving(urls, args.peers, procs, t0 + READY_TIMEOUT_S)
        print(f"mesh ready in {time.monotonic() - t0:.1f} s", flush=True)

        entry = urls[-1]  # not the supernode: the request is proxied to it
        body = json.dumps({"model": name, "prompt": args.prompt, "max_tokens": args.max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(entry + "/v1/completions", body, {"Content-Type": "application/json"})
        t1 = time.monotonic()
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
        took = time.monotonic() - t1
        text = answer["choices"][0]["text"]
        n = answer["usage"]["completion_tokens"]
        print(f"\nPOST {entry}/v1/completions  prompt={args.prompt!r}")
        print(f"-> {args.prompt}{text}")
        print(f"({n} tokens in {took:.2f} s, {n / took:.1f} tok/s)\n")
        print(f"$ meshctl status --url {entry}")
        print(format_status(get_json(entry + "/status")))
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
