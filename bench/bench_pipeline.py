"""Does the pipeline pay? meshd on 1 and 2 peers against llama.cpp, each pinned to its own core.

Every configuration runs in this one invocation, on loopback, with static peers and one
torch thread per daemon pinned with ``taskset`` to a core of its own, so two daemons behave
like two boxes. All are started first and then measured in turns, a round of each at a time
(the order reversed every other round), one configuration busy while the others idle: this
shared box's speed drifts by 20-30% over minutes, and measured one after another the
configurations met different moments of it, which moved the ratios between them:

- ``meshd-1``: one daemon on core 0
- ``meshd-2``: two daemons, the supernode on core 0, the second peer on core 1
- ``llama-1``: llama-server (1 thread, core 0) on the same GGUF the model was converted from
- ``llama-rpc-2``: llama-server on core 0 with half the layers on a ggml-rpc-server on core 1
  (llama.cpp's own split over the same two cores)

For each it measures, with the same client (OpenAI streaming API, greedy):

- ``agg16``: aggregate tokens/s of 16 concurrent streams x ``--tokens`` tokens
- ``decode1``: batch-1 decode tokens/s (one stream, from its first token to its last)
- ``ttft_long``: time to first token of a ~``--long``-token prompt (each one new, so no cache helps)
- ``chat1`` / ``chat2``: time to first token of turn 1 and turn 2 of a chat whose first
  user message holds ~``--long`` tokens (turn 2 repeats the history: a prefix cache pays here)
- ``ttft_idle`` / ``ttft_busy``: time to first token of a short request alone, and while
  ``--streams`` streams are decoding (target: busy <= 2x idle)

and prints the table, the ratios against the issue's targets (2 peers >= 1.7x one peer at
16 streams, long-prompt TTFT with 2 peers <= 0.65x, batch-1 decode >= 0.95x, chat turn 2
<= 0.2x turn 1) and meshd against llama.cpp. Each figure is the median of ``--rounds``.

    .venv/bin/python bench/bench_pipeline.py                          # the full run (quiet machine)
    .venv/bin/python bench/bench_pipeline.py --tokens 8 --long 200 --rounds 1 --streams 4   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from locate import OUT, ROOT, SMOLLM2_GGUF, add_llama_cpp_flags, add_model_flag, gguf_file, llama_cpp, need_model

LLAMA_TOOLS = ("llama-server", "ggml-rpc-server")
PROMPTS = [
    "The old lighthouse keeper climbed the stairs and",
    "A bicycle stays upright because the rider",
    "The moon is about a quarter of the size of the Earth, and its surface",
    "After the rain stopped, the streets of the city",
]
PARAGRAPH = ("The river runs past the mill, under the stone bridge and through the meadows where the "
             "farmers keep their sheep; in spring it floods the lower fields and in summer it is low "
             "enough to cross on foot. ")
TARGETS = {"agg16": (">=", 1.7), "ttft_long": ("<=", 0.65), "decode1": (">=", 0.95)}


def pinned_workdir(bench: str) -> Path | None:
    """A work directory for a bench of daemons each pinned to a core of its own; None (and
    why, on stderr) where this box cannot pin two (no taskset, one core)."""
    if shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        print(f"{bench} needs taskset and 2 cores", file=sys.stderr)
        return None
    return Path(tempfile.mkdtemp(prefix=f"meshd-{bench.replace('_', '-')}-"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def long_text(tokens: int, tag: str) -> str:
    """About ``tokens`` tokens of prose (a paragraph is ~40), opened by ``tag`` so that no
    two prompts share a prefix."""
    return f"Note {tag}. " + PARAGRAPH * max(1, tokens // 40)


# -- the client (the same for meshd and llama-server) --------------------------------------


async def stream(http: aiohttp.ClientSession, url: str, body: dict, chat: bool = False,
                 started: list[int] | None = None) -> dict:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = body | {"temperature": 0, "stream": True}
    t0 = time.monotonic()
    stamps, text = [], []
    async with http.post(url + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                piece = c.get("delta", {}).get("content") if chat else c.get("text")
                n = len(c["token_ids"]) if "token_ids" in c else (1 if piece else 0)
                if n and not stamps and started is not None:
                    started[0] += 1
                stamps += [time.monotonic()] * n
                text.append(piece or "")
    if not stamps:
        raise RuntimeError(f"{url}{path}: no tokens")
    return {"ttft": stamps[0] - t0, "first": stamps[0], "last": stamps[-1], "n": len(stamps), "text": "".join(text),
            "t0": t0}


def client() -> aiohttp.ClientSession:
    # A fresh connection per request: llama-server may close a kept-alive one under the client.
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                 connector=aiohttp.TCPConnector(force_close=True))


async def agg16(http: aiohttp.ClientSession, url: str, args, tag: object) -> float:
    """Aggregate tok/s of ``args.streams`` greedy streams of ``args.tokens`` at once."""
    t0 = time.monotonic()
    rs = await asyncio.gather(*(stream(http, url, {"prompt": f"({tag}.{i}) " + PROMPTS[i % len(PROMPTS)],
                                                    "max_tokens": args.tokens})
                                for i in range(args.streams)))
    return sum(r["n"] for r in rs) / (max(r["last"] for r in rs) - t0)


async def decode1(http: aiohttp.ClientSession, url: str, args, tag: object) -> float:
    """Batch-1 decode tok/s, from one stream's first token to its last."""
    r = await stream(http, url, {"prompt": f"({tag}) " + PROMPTS[0], "max_tokens": args.tokens})
    return (r["n"] - 1) / (r["last"] - r["first"]) if r["n"] > 1 else float("nan")


async def ttft_long(http: aiohttp.ClientSession, url: str, args, tag: object) -> float:
    """Time to first token of a new ~``args.long``-token prompt."""
    r = await stream(http, url, {"prompt": long_text(args.long, f"L{tag}-{secrets.token_hex(3)}"), "max_tokens": 1})
    return r["ttft"]


async def measure(url: str, args, round_no: int) -> dict:
    async with client() as http:
        await stream(http, url, {"prompt": "Warm up.", "max_tokens": 4})
        agg = await agg16(http, url, args, round_no)
        decode = await decode1(http, url, args, round_no)
        long_ttft = await ttft_long(http, url, args, round_no)
        # chat turn 1, turn 2
        messages = [{"role": "user", "content": long_text(args.long, f"C{round_no}-{secrets.token_hex(3)}")
                     + "\nWhat is this text about?"}]
        r1 = await stream(http, url, {"messages": messages, "max_tokens": 16}, chat=True)
        messages += [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": "Say it shorter."}]
        r2 = await stream(http, url, {"messages": messages, "max_tokens": 4}, chat=True)
        # TTFT of a new short request: idle, then with the streams all decoding (every prompt
        # opens with its own tag, so that no prefix cache serves one from another)
        idle = (await stream(http, url, {"prompt": f"(idle {round_no}) " + PROMPTS[1], "max_tokens": 2}))["ttft"]
        started = [0]
        running = [asyncio.create_task(stream(http, url, {"prompt": f"[{round_no}.{i}] " + PROMPTS[i % len(PROMPTS)],
                                                          "max_tokens": 2 * args.tokens}, started=started))
                   for i in range(args.streams)]
        deadline = time.monotonic() + 300
        while started[0] < args.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        busy = (await stream(http, url, {"prompt": f"(busy {round_no}) " + PROMPTS[1], "max_tokens": 2}))["ttft"]
        await asyncio.gather(*running)
    return {"agg16": agg, "decode1": decode, "ttft_long": long_ttft, "chat1": r1["ttft"], "chat2": r2["ttft"],
            "ttft_idle": idle, "ttft_busy": busy}


def median_rows(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


# -- meshd ------------------------------------------------------------------------------


def wait_http(url: str, ok, timeout: float, procs: list[subprocess.Popen], what: str) -> dict:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                data = json.loads(resp.read())
                if ok(data):
                    return data
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not ready within {timeout:.0f} s")


def stop(procs: list[subprocess.Popen], logs: list) -> None:
    """End the processes this bench started (each by its own handle), then close their logs."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
    for log in logs:
        log.close()


class Running:
    """A configuration up and serving: its URL, what to say of its plan, and its processes."""

    def __init__(self, name: str, url: str, procs: list[subprocess.Popen], logs: list, plan: str = ""):
        self.name, self.url, self.procs, self.logs, self.plan = name, url, procs, logs, plan
        self.rows: list[dict] = []

    def stop(self) -> None:
        stop(list(reversed(self.procs)), self.logs)


def start_meshd(peers: int, args, workdir: Path, name: str | None = None,
                budgets: list[int] | None = None, extra: tuple[str, ...] = ()) -> Running:
    """``peers`` daemons on cores 0, 1, ...; ``budgets``: each one's --mem-budget (which caps
    the layers placement may give it: bench_splits.py forces a split with them); ``extra``:
    more flags for each."""
    name = name or f"meshd-{peers}"
    secret = workdir / f"secret-{name}"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    ports = [free_port() for _ in range(peers)]
    procs, logs = [], []
    mesh = f"bench-{secrets.token_hex(3)}"
    try:
        for i, port in enumerate(ports):
            state = workdir / f"{name}-{i}"
            state.mkdir()
            argv = ["taskset", "-c", str(i), sys.executable, "-m", "meshd.tools.cli", "run", "--name", f"p{i}",
                    "--host", "127.0.0.1", "--port", str(port), "--mesh", mesh, "--secret-file", str(secret),
                    "--state-dir", str(state), "--model", str(args.model), "--device", "cpu", "--dtype", "float32",
                    "--threads", "1", "--no-mdns", "--no-replicate", "--log-level", os.environ.get("BENCH_LOG_LEVEL", "warning"),
                    "--advertise-vram", str((peers - i) << 30)]
            for other in ports[:i]:
                argv += ["--peer", f"127.0.0.1:{other}"]
            if budgets:
                argv += ["--mem-budget", str(budgets[i])]
            argv += list(extra)
            log = open(workdir / f"{name}-{i}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          env=os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}))
        url = f"http://127.0.0.1:{ports[0]}"
        view = wait_http(url + "/status", lambda v: v["serving"] and sum(
            1 for p in v["peers"] if p["state"] == "ready") == peers, 300, procs, name)
        try:  # placement may keep every layer on one peer (a probe that read it slow): report it, go on
            view = wait_http(url + "/status", lambda v: v["serving"] and len(v["plan"]) == peers, 30, procs, name)
        except RuntimeError:
            view = wait_http(url + "/status", lambda v: v["serving"], 60, procs, name)
            print(f"   placement gave {len(view['plan'])} stage(s) to {peers} peers", flush=True)
        plan = " ".join(f"{a['node'][:6]}[{a['start']}:{a['stop']})" for a in view["plan"])
        # What placement weighed the split on: each peer's timed layer (and head) at the decode batch.
        timed = {p["id"]: p.get("measured") for p in view["peers"]}
        plan += " timed " + " ".join(
            f"{n[:6]}=layer {t['layer_ms_batch']:.2f}/head {t['head_ms_batch']:.2f} ms" if t else f"{n[:6]}=probe"
            for n, t in timed.items())
        return Running(name, url, procs, logs, plan)
    except BaseException:
        stop(procs, logs)
        raise


# -- llama.cpp ----------------------------------------------------------------------------


def start_llama(rpc: bool, args, workdir: Path) -> Running | None:
    llama, why_not = llama_cpp(args.llama_cpp, args.build_llama_cpp, LLAMA_TOOLS)
    if llama is None or args.gguf is None:
        why_not = why_not or f"no {SMOLLM2_GGUF} in the state dir's cache/ (`make test` fetches it; or --gguf FILE)"
        print(f"   llama.cpp: skipped, {why_not}", flush=True)
        return None
    bin_dir = llama / "bin"
    server = bin_dir / "llama-server"
    env = os.environ | {"LD_LIBRARY_PATH": str(bin_dir)}
    port = free_port()
    procs, logs = [], []
    name = "llama-rpc-2" if rpc else "llama-1"
    try:
        argv = ["taskset", "-c", "0", str(server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", "1", "-tb", "1", "-np", str(args.streams), "-c", str(args.streams * (args.long + 256)),
                "--no-webui"]
        if rpc:
            rport = free_port()
            log = open(workdir / "rpc.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(["taskset", "-c", "1", str(bin_dir / "ggml-rpc-server"), "-t", "1",
                                           "-H", "127.0.0.1", "-p", str(rport)], stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
            time.sleep(1.0)
            argv += ["--rpc", f"127.0.0.1:{rport}", "-ngl", str(args.rpc_layers)]
        log = open(workdir / f"{name}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", lambda v: v.get("status") == "ok", 120, procs, name)
        return Running(name, url, procs, logs, f"{args.rpc_layers} layers on the RPC server" if rpc else "all local")
    except RuntimeError as exc:
        print(f"   {name}: {exc}", flush=True)
        stop(list(reversed(procs)), logs)
        return None
    except BaseException:
        stop(list(reversed(procs)), logs)
        raise


# -- the report -------------------------------------------------------------------------


def report(results: dict[str, dict], args) -> None:
    cols = list(results)
    print(f"\n== figures (median of {args.rounds}; {args.streams} streams x {args.tokens} tokens; "
          f"long prompt ~{args.long} tokens)")
    units = {"agg16": "tok/s", "decode1": "tok/s", "ttft_long": "s", "chat1": "s", "chat2": "s", "ttft_idle": "s",
             "ttft_busy": "s"}
    print(f"   {'figure':<12}" + "".join(f"{c:>14}" for c in cols))
    for key, unit in units.items():
        print(f"   {key + ' ' + unit:<12}" + "".join(f"{results[c][key]:>14.3f}" for c in cols))
    print("\n== ratios (targets in brackets)")
    one, two = results.get("meshd-1"), results.get("meshd-2")
    if one and two:
        for key, (op, want) in TARGETS.items():
            ratio = two[key] / one[key]
            ok = ratio >= want if op == ">=" else ratio <= want
            print(f"   meshd 2 peers / 1 peer, {key}: {ratio:.2f}x [{op} {want}x] {'ok' if ok else 'MISSED'}")
    for r in (one, two):
        if r:
            ratio = r["chat2"] / r["chat1"]
            print(f"   {r['name']} chat turn 2 / turn 1 TTFT: {ratio:.2f}x [<= 0.2x] {'ok' if ratio <= 0.2 else 'MISSED'}"
                  f"  (prefix cache {r.get('prefix_cache')})")
            ratio = r["ttft_busy"] / r["ttft_idle"]
            print(f"   {r['name']} TTFT with {args.streams} streams decoding / idle: {ratio:.2f}x [<= 2x] "
                  f"{'ok' if ratio <= 2 else 'MISSED'}")
    for mine, theirs in (("meshd-1", "llama-1"), ("meshd-2", "llama-rpc-2")):
        if mine in results and theirs in results:
            a, b = results[mine], results[theirs]
            print(f"   {mine} / {theirs}: agg16 {a['agg16'] / b['agg16']:.2f}x, decode1 {a['decode1'] / b['decode1']:.2f}x,"
                  f" ttft_long {a['ttft_long'] / b['ttft_long']:.2f}x (lower is better), chat2 {a['chat2'] / b['chat2']:.2f}x")
    if "llama-1" in results and "llama-rpc-2" in results:
        a, b = results["llama-rpc-2"], results["llama-1"]
        print(f"   llama.cpp RPC 2 cores / 1 core: agg16 {a['agg16'] / b['agg16']:.2f}x, decode1 "
              f"{a['decode1'] / b['decode1']:.2f}x, ttft_long {a['ttft_long'] / b['ttft_long']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(ap)
    ap.add_argument("--gguf", type=Path, default=gguf_file(SMOLLM2_GGUF),
                    help="the GGUF file llama.cpp runs (default: %(default)s, the model's source as fetched)")
    add_llama_cpp_flags(ap)
    ap.add_argument("--configs", default="meshd-1,meshd-2,llama-1,llama-rpc-2")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--long", type=int, default=1000, help="tokens of the long prompt and of the chat's history")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rpc-layers", type=int, default=15, help="layers llama.cpp puts on the RPC server")
    ap.add_argument("--out", type=Path, default=OUT, help="where the figures go (default: %(default)s)")
    args = ap.parse_args()
    need_model(args.model)
    if (workdir := pinned_workdir("bench_pipeline")) is None:
        return 2
    print(f"conditions: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start, each process "
          f"pinned to its own core with taskset, 1 thread each; logs in {workdir}", flush=True)
    running: list[Running] = []
    try:
        for name in args.configs.split(","):
            print(f"== starting {name}", flush=True)
            r = start_meshd(int(name.split("-")[1]), args, workdir) if name.startswith("meshd-") else \
                start_llama(name == "llama-rpc-2", args, workdir)
            if r is not None:
                running.append(r)
                print(f"   plan {r.plan}", flush=True)
        for round_no in range(args.rounds):
            for r in running if round_no % 2 == 0 else running[::-1]:
                t0 = time.monotonic()
                row = asyncio.run(measure(r.url, args, round_no))
                r.rows.append(row)
                print(f"   round {round_no} {r.name}: " + ", ".join(f"{k} {row[k]:.3f}" for k in row)
                      + f" ({time.monotonic() - t0:.0f} s)", flush=True)
        results: dict[str, dict] = {}
        for r in running:
            results[r.name] = {"name": r.name, "plan": r.plan, **median_rows(r.rows), "rounds": r.rows}
            if r.name.startswith("meshd-"):
                status = wait_http(r.url + "/status", lambda v: True, 10, r.procs, "status")
                results[r.name]["prefix_cache"] = status["node"]["scheduler"].get("prefix_cache")
    finally:
        for r in running:
            r.stop()
    print(f"   load average {os.getloadavg()[0]:.2f} at the end")
    report(results, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
