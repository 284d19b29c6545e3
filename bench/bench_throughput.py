"""Throughput: single node against a 3-peer mesh, at 1, 4, 16 and 64 concurrent streams.

Every configuration runs in network namespaces built by this script (tests/netlab.py),
side by side in one run, on the real default model, greedy:

- ``single``: one daemon (2 torch threads; the whole machine)
- ``mesh3``: three daemons on a bridge (1 torch thread each, so the mesh uses the same cores)
- ``mesh3-lan``: the same over 1 Gbit/s, 1 ms one-way
- ``mesh3-wifi``: the same over 100 Mbit/s, 5 ms ± 2 ms

Rate is real (a TBF qdisc on every host's eth0). Delay uses netem where the kernel has it;
where it has not (this machine), the daemons' debug link delay holds every frame back in
order, as a relay would. Prints aggregate tokens/s, time to first token and inter-token
latency percentiles, peak RSS per peer, the target ratios, and writes a PNG plot.

    sudo .venv/bin/python bench/bench_throughput.py [--streams 1,4,16,64] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from locate import OUT, SMOLLM2_GGUF, add_model_flag, gguf_file, need_model  # noqa: E402
from tests.meshlab import MeshLab  # noqa: E402
from tests.netlab import Lab, netlab_available  # noqa: E402

# Mid-sentence prompts: an instruct model asked a question may answer with an
# end-of-turn at once; these it continues.
PROMPTS = [
    "The old lighthouse keeper climbed the stairs and",
    "A bicycle stays upright because the rider",
    "The moon is about a quarter of the size of the Earth, and its surface",
    "After the rain stopped, the streets of the city",
]
PROFILES = {
    "mesh3": None,
    "mesh3-lan": {"rate": "1gbit", "delay_ms": 1.0, "jitter_ms": 0.0},
    "mesh3-wifi": {"rate": "100mbit", "delay_ms": 5.0, "jitter_ms": 2.0},
}


def has_netem(host) -> bool:
    probe = host.run(["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "9:", "netem", "delay", "1ms"],
                     capture_output=True)
    if probe.returncode == 0:
        host.run(["tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
        return True
    return False


def shape(host, profile: dict, netem: bool) -> None:
    """Rate (TBF) on the host's eth0, and with netem also the delay."""
    if netem:
        host.run(["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay",
                  f"{profile['delay_ms']}ms", f"{profile['jitter_ms']}ms", "rate", profile["rate"]], check=True)
    else:
        host.run(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", profile["rate"],
                  "burst", "256kb", "latency", "50ms"], check=True)


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def one_stream(http: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    stamps = []
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            n = sum(len(c.get("token_ids", [])) for c in event.get("choices", []))
            stamps += [time.monotonic()] * n
    if not stamps:
        return {"error": "no tokens"}
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "n": len(stamps),
            "end": stamps[-1]}


async def load(url: str, streams: int, tokens: int) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await one_stream(http, url, "Warm up.", 4)
        t0 = time.monotonic()
        results = await asyncio.gather(*(one_stream(http, url, PROMPTS[i % len(PROMPTS)], tokens)
                                         for i in range(streams)))
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print("   error:", r["error"], flush=True)
    wall = max(r["end"] for r in ok) - t0 if ok else float("nan")
    itl = sorted(x for r in ok for x in r["itl"])
    ttft = sorted(r["ttft"] for r in ok)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

    return {"streams": streams, "errors": len(results) - len(ok), "tok_s": sum(r["n"] for r in ok) / wall,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p95_ms": pct(ttft, 0.95),
            "itl_p50_ms": pct(itl, 0.5), "itl_p95_ms": pct(itl, 0.95), "itl_p99_ms": pct(itl, 0.99)}


def run_config(name: str, model_dir: Path, streams: list[int], tokens: int, workdir: Path) -> dict:
    lab = Lab()
    mesh = None
    try:
        mesh = MeshLab(lab, workdir / name)
        n = 1 if name == "single" else 3
        hosts = [lab.add_host() for _ in range(n)]
        profile = PROFILES.get(name)
        extra: tuple[str, ...] = ()
        if profile:
            netem = has_netem(hosts[0])
            for h in hosts:
                shape(h, profile, netem)
            if not netem:
                extra = ("--debug-link-delay-ms", str(profile["delay_ms"]),
                         "--debug-link-jitter-ms", str(profile["jitter_ms"]))
        threads = "2" if n == 1 else "1"
        daemons = [mesh.start(h, model=str(model_dir) if i == 0 else model_dir.name, vram=(n - i) << 30,
                              extra=extra, env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
                   for i, h in enumerate(hosts)]
        # Placement may keep every layer on the supernode when hops cost more than they
        # save (a slow link): that is a result to report, not a failure.
        view = mesh.wait_converged(daemons, timeout=300)
        entry = daemons[-1]
        rows = [asyncio.run(load(entry.url, s, tokens)) for s in streams]
        rss = {d.name: round(peak_rss_mb(d.pid), 1) for d in daemons}
        plan = " ".join(f"{a['node'][:6]}[{a['start']}:{a['stop']})" for a in view["plan"])
        return {"name": name, "rows": rows, "peak_rss_mb": rss, "plan": plan}
    finally:
        if mesh is not None:
            mesh.close()
        lab.close()


def llama_cpp_row(gguf: Path, tokens: int) -> dict | None:
    """llama.cpp on the same GGUF with 2 threads, batch 1, where llama-cpp-python is importable
    (in this venv, or the interpreter named by $LLAMA_CPP_PYTHON)."""
    python = os.environ.get("LLAMA_CPP_PYTHON", sys.executable)
    code = f"""
import time, llama_cpp
m = llama_cpp.Llama(model_path={str(gguf)!r}, n_threads=2, n_ctx=512, verbose=False)
m("Warm up.", max_tokens=4, temperature=0)
t0 = time.monotonic(); out = m({PROMPTS[0]!r}, max_tokens={tokens}, temperature=0)
print(out["usage"]["completion_tokens"] / (time.monotonic() - t0))
"""
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None
    return {"tok_s": float(proc.stdout.strip().splitlines()[-1])}


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = [row["streams"] for row in r["rows"]]
        ax.plot(xs, [row["tok_s"] for row in r["rows"]], marker="o", label=r["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("meshd throughput, SmolLM2-135M, 2 cores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(ap)
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--configs", default="single,mesh3,mesh3-lan,mesh3-wifi")
    ap.add_argument("--out", type=Path, default=OUT, help="where the plot and figures go (default: %(default)s)")
    args = ap.parse_args()
    need_model(args.model)
    if not netlab_available():
        print("bench_throughput needs root and ip netns", file=sys.stderr)
        return 2
    streams = [int(s) for s in args.streams.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    results = []
    for name in args.configs.split(","):
        print(f"== {name}", flush=True)
        r = run_config(name, args.model, streams, args.tokens, workdir)
        results.append(r)
        print(f"   plan {r['plan']}  peak RSS MB {r['peak_rss_mb']}")
        for row in r["rows"]:
            print("   {streams:>3} streams  {tok_s:7.1f} tok/s  TTFT p50 {ttft_p50_ms:7.0f} ms p95 {ttft_p95_ms:7.0f}"
                  "  ITL p50 {itl_p50_ms:6.0f} p95 {itl_p95_ms:6.0f} p99 {itl_p99_ms:6.0f}  errors {errors}"
                  .format(**row), flush=True)
    by = {r["name"]: {row["streams"]: row for row in r["rows"]} for r in results}
    print("\n== ratios (targets in brackets)")
    for name in by:
        rows = by[name]
        if 1 in rows and 16 in rows:
            print(f"   {name}: 16 streams / 1 stream = {rows[16]['tok_s'] / rows[1]['tok_s']:.2f}x tok/s [>= 6x];"
                  f" TTFT 16 / 1 = {rows[16]['ttft_p50_ms'] / rows[1]['ttft_p50_ms']:.2f}x [< 1.5x]")
    if "single" in by:
        for name in by:
            if name != "single" and 16 in by[name] and 16 in by["single"]:
                print(f"   {name} / single at 16 streams = {by[name][16]['tok_s'] / by['single'][16]['tok_s']:.2f}x"
                      " [>= 0.9x]")
    gguf = gguf_file(SMOLLM2_GGUF)
    llama = llama_cpp_row(gguf, args.tokens) if gguf else None
    if llama and "single" in by and 1 in by["single"]:
        print(f"   meshd single / llama.cpp at 1 stream = {by['single'][1]['tok_s'] / llama['tok_s']:.2f}x"
              f" (llama.cpp {llama['tok_s']:.1f} tok/s)")
    elif gguf is None:
        print(f"   llama.cpp: skipped, no {SMOLLM2_GGUF} in the state dir's cache/ (`make test` fetches it)")
    else:
        print("   llama.cpp: skipped, llama-cpp-python not importable (set LLAMA_CPP_PYTHON to a venv that has it)")
    png = args.out / "throughput.png"
    plot(results, png)
    (args.out / "throughput.json").write_text(json.dumps(results, indent=2))
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
