"""Batch jobs: a job of short requests on one node and on a 3-peer mesh, against the
16-stream figure of bench_throughput.py, and the interactive TTFT while the job runs.

Each configuration runs in network namespaces built here (tests/netlab.py), side by
side in one run, on the real default model, greedy:

- ``single``: one daemon (2 torch threads; the whole machine)
- ``mesh3``: three daemons on a bridge (1 torch thread each), the job sent to a peer
  that is not the supernode (its lines go through that peer's proxy)

Per configuration, in order: 16 concurrent streams as bench_throughput measures them
(tok/s); the interactive TTFT and inter-token latency of single streamed requests with
the mesh idle; then a batch job of ``--requests`` lines (OpenAI Batch API, ``--tokens``
each): its first half alone, its second half while a prober sends one interactive
streamed request at a time (``--probe-every``). Prints the job's tok/s in each half
against the 16-stream figure, and the interactive TTFT and ITL idle against beside the job.

    sudo .venv/bin/python bench/bench_batch.py [--requests 500] [--tokens 32] [--configs single,mesh3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_throughput import PROMPTS, load, one_stream  # noqa: E402
from locate import OUT, add_model_flag, need_model  # noqa: E402
from tests.meshlab import MeshLab  # noqa: E402
from tests.netlab import Lab, netlab_available  # noqa: E402

PROBE_TOKENS = 16
IDLE_PROBES = 5


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def submit(http: aiohttp.ClientSession, url: str, requests: int, tokens: int) -> str:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0}}
             for i in range(requests)]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "".join(json.dumps(ln) + "\n" for ln in lines).encode(), filename="bench.jsonl")
    async with http.post(url + "/v1/files", data=form) as resp:
        uploaded = await resp.json()
        assert resp.status == 200, uploaded
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    async with http.post(url + "/v1/batches", json=body) as resp:
        batch = await resp.json()
        assert resp.status == 200, batch
    return batch["id"]


async def batch_run(url: str, requests: int, tokens: int, probe_every: float) -> dict:
    """The job in two halves: alone (its own tok/s), then with an interactive prober
    (the TTFT a person sees meanwhile, and what the job keeps of its rate)."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        idle = [await one_stream(http, url, PROMPTS[i % len(PROMPTS)], PROBE_TOKENS) for i in range(IDLE_PROBES)]
        batch_id = await submit(http, url, requests, tokens)
        probes: list[dict] = []
        done = asyncio.Event()

        async def prober() -> None:
            i = 0
            while not done.is_set():
                probes.append(await one_stream(http, url, PROMPTS[i % len(PROMPTS)], PROBE_TOKENS))
                i += 1
                try:
                    await asyncio.wait_for(done.wait(), probe_every)
                except TimeoutError:
                    pass

        marks: list[tuple[float, int]] = []  # (time, output tokens): job start, the switch, the end
        task = None
        shown = 0.0
        while True:
            async with http.get(f"{url}/v1/batches/{batch_id}") as resp:
                b = await resp.json()
            c, now = b["request_counts"], time.monotonic()
            finished = b["status"] in ("completed", "failed", "expired", "cancelled")
            if not marks and b["status"] == "in_progress":
                marks.append((now, b["usage"]["output_tokens"]))
            if task is None and marks and (c["completed"] + c["failed"] >= requests // 2 or finished):
                marks.append((now, b["usage"]["output_tokens"]))
                task = asyncio.create_task(prober())
            if finished:
                marks.append((now, b["usage"]["output_tokens"]))
                break
            if now - shown >= 10:
                print(f"   batch {c['completed'] + c['failed']}/{c['total']} {b['status']}", flush=True)
                shown = now
            await asyncio.sleep(0.25)
        done.set()
        if task is not None:
            await task
    ok = [p for p in probes if "error" not in p]
    idle_ok = [p for p in idle if "error" not in p]
    (t0, k0), (t1, k1), (t2, k2) = marks
    return {
        "status": b["status"], "requests": b["request_counts"], "output_tokens": k2, "wall_s": round(t2 - t0, 1),
        "tok_s": (k2 - k0) / (t2 - t0), "tok_s_alone": (k1 - k0) / max(t1 - t0, 1e-3),
        "tok_s_with_probes": (k2 - k1) / max(t2 - t1, 1e-3),
        "idle_ttft_p50_ms": pct([p["ttft"] for p in idle_ok], 0.5),
        "idle_itl_p50_ms": pct([x for p in idle_ok for x in p["itl"]], 0.5),
        "probes": len(probes), "probe_errors": len(probes) - len(ok),
        "ttft_p50_ms": pct([p["ttft"] for p in ok], 0.5), "ttft_p95_ms": pct([p["ttft"] for p in ok], 0.95),
        "itl_p50_ms": pct([x for p in ok for x in p["itl"]], 0.5),
    }


def run_config(name: str, model_dir: Path, args, workdir: Path) -> dict:
    lab = Lab()
    mesh = None
    try:
        mesh = MeshLab(lab, workdir / name)
        n = 1 if name == "single" else 3
        threads = str(args.single_threads) if n == 1 else "1"
        daemons = [mesh.start(h, model=str(model_dir) if i == 0 else model_dir.name, vram=(n - i) << 30,
                              env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
                   for i, h in enumerate(lab.add_host() for _ in range(n))]
        view = mesh.wait_converged(daemons, timeout=300)
        entry = daemons[-1]
        streams16 = asyncio.run(load(entry.url, 16, args.tokens))
        job = asyncio.run(batch_run(entry.url, args.requests, args.tokens, args.probe_every))
        plan = " ".join(f"{a['node'][:6]}[{a['start']}:{a['stop']})" for a in view["plan"])
        return {"name": name, "plan": plan, "streams16": streams16, "batch": job}
    finally:
        if mesh is not None:
            mesh.close()
        lab.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(ap)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--probe-every", type=float, default=1.0, help="seconds between interactive probes")
    ap.add_argument("--configs", default="single,mesh3")
    ap.add_argument("--single-threads", type=int, default=2,
                    help="torch threads of the single daemon (bench_throughput's 2; 1 on a busy machine)")
    ap.add_argument("--out", type=Path, default=OUT, help="where the figures go (default: %(default)s)")
    args = ap.parse_args()
    need_model(args.model)
    if not netlab_available():
        print("bench_batch needs root and ip netns", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="meshd-bench-batch-"))
    results = []
    for name in args.configs.split(","):
        print(f"== {name}: {args.requests} requests x {args.tokens} tokens", flush=True)
        r = run_config(name, args.model, args, workdir)
        results.append(r)
        s, b = r["streams16"], r["batch"]
        print(f"   plan {r['plan']}")
        print(f"   16 streams: {s['tok_s']:.1f} tok/s (TTFT p50 {s['ttft_p50_ms']:.0f} ms, errors {s['errors']})")
        print(f"   batch job:  {b['tok_s']:.1f} tok/s over the job ({b['output_tokens']} tokens in {b['wall_s']} s, "
              f"{b['status']}, counts {b['requests']}); first half alone {b['tok_s_alone']:.1f} tok/s, "
              f"second half beside interactive probes {b['tok_s_with_probes']:.1f} tok/s")
        print(f"   batch alone / 16 streams = {b['tok_s_alone'] / s['tok_s']:.2f}x; "
              f"beside probes / 16 streams = {b['tok_s_with_probes'] / s['tok_s']:.2f}x")
        print(f"   interactive idle: TTFT p50 {b['idle_ttft_p50_ms']:.0f} ms, ITL p50 {b['idle_itl_p50_ms']:.0f} ms; "
              f"beside the job: TTFT p50 {b['ttft_p50_ms']:.0f} ms p95 {b['ttft_p95_ms']:.0f} ms "
              f"(x{b['ttft_p50_ms'] / b['idle_ttft_p50_ms']:.2f} p50), ITL p50 {b['itl_p50_ms']:.0f} ms; "
              f"{b['probes']} probes, {b['probe_errors']} errors", flush=True)
    (args.out / "batch.json").write_text(json.dumps(results, indent=2))
    print(f"\nfigures: {args.out / 'batch.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
