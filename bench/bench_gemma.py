"""Gemma 3 270M on one node against llama.cpp's llama-bench on the same GGUF file with the
same threads, side by side in one run: prefill and decode tok/s, peak RSS.

meshd runs the model as ``meshd model fetch gemma3-270m`` converts it (the Q4_K_M file's
quantization kept, shards/ggml_blocks.py), one stage holding every layer, with fp32 and
with bf16 activations.
llama-bench runs the file as shipped. Speed: the configurations take turns, round after
round (meshd in one worker process loaded once, llama-bench one repetition a round), and
each one's best round counts, so what else shares the cores weighs on all of them alike.
Peak RSS: each configuration alone in a process of its own (VmHWM for meshd; the rusage
high-water mark of the llama-bench child).

    .venv/bin/python bench/bench_gemma.py [--state-dir DIR] [--threads 2] [--prompt 128]
                                          [--decode 64] [--rounds 3] [--llama-cpp DIR] [--build-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from locate import ROOT, add_llama_cpp_flags, llama_cpp, state_dir
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
DTYPES = ("float32", "bfloat16")


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _prompt(n: int) -> list[int]:
    return [2] + [(i * 7919) % 200000 + 1000 for i in range(n - 1)]  # <bos>, then ordinary tokens


# -- the meshd worker (a child process) ------------------------------------------------------------


class Worker:
    """One whole-model stage; ``prefill`` and ``decode`` return seconds."""

    def __init__(self, model_dir: str, dtype: str, threads: int, prompt: int, decode: int):
        import torch

        from shards.engine import StageEngine
        from shards.manifest import Manifest
        from shards.span import Span

        torch.set_num_threads(threads)
        self.torch = torch
        n = Manifest.load(Path(model_dir)).n_layers
        # The engine's own thread runs the forwards (as a daemon does), with this thread count.
        self.engine = StageEngine.load(Path(model_dir), Span(0, n), True, True, device="cpu", dtype=dtype, verify=False)
        self.prompt, self.n_decode = _prompt(prompt), decode

    def _ids(self, ids):
        return self.torch.tensor(ids)

    def prefill(self) -> float:
        def run():
            st = self.engine.stage
            caches = st.new_caches()
            t0 = time.perf_counter()
            st.head(st(st.embed(self._ids(self.prompt)), 0, caches)[-1:])
            return time.perf_counter() - t0
        return self.engine.run_sync(run)

    def decode(self) -> float:
        def run():
            st = self.engine.stage
            caches = st.new_caches()
            x = st(st.embed(self._ids(self.prompt[:16])), 0, caches)
            tok = int(st.head(x[-1:]).argmax())
            t0 = time.perf_counter()
            for i in range(self.n_decode):
                x = st(st.embed(self._ids([tok])), 16 + i, caches)
                tok = int(st.head(x).argmax())
            return time.perf_counter() - t0
        return self.engine.run_sync(run)


def worker_main(model_dir: str, dtype: str, threads: int, prompt: int, decode: int, once: bool) -> None:
    w = Worker(model_dir, dtype, threads, prompt, decode)
    if once:  # peak RSS of load + one prefill + one decode
        w.prefill(), w.decode()
        print(json.dumps({"peak_rss_mb": _peak_rss_mb()}), flush=True)
        return
    w.prefill()  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps({"prefill_s": w.prefill(), "decode_s": w.decode()}), flush=True)


# -- llama-bench --------------------------------------------------------------------------------


# Runs a command and reports its peak RSS: RUSAGE_CHILDREN in a process whose only child it is.
_WRAP = ("import resource, subprocess, sys; d = subprocess.run(sys.argv[1:]); "
         "print('peak_rss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
         "sys.exit(d.returncode)")


def llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, decode: int, reps: int) -> dict:
    """One llama-bench run: prefill (pp) and decode (tg) tok/s, and its peak RSS."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(decode),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed:\n{out.stderr[-2000:]}")
    peak = next(int(ln.split()[1]) for ln in out.stderr.splitlines() if ln.startswith("peak_rss_kb"))
    rate = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.loads(out.stdout)}
    return rate | {"peak_rss_mb": peak / 1024}


def _line(p: subprocess.Popen, wanted) -> str:
    """The worker's next stdout line that ``wanted`` accepts (its log lines go there too)."""
    for line in p.stdout:
        if wanted(line.strip()):
            return line.strip()
    raise SystemExit(f"a meshd worker ended (exit {p.wait()})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", type=Path, default=state_dir(),
                    help="where `meshd model fetch gemma3-270m` finds or puts the model (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    add_llama_cpp_flags(ap)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "DTYPE"))
    ap.add_argument("--once", action="store_true")
    a = ap.parse_args()
    if a.worker:
        return worker_main(a.worker[0], a.worker[1], a.threads, a.prompt, a.decode, a.once)

    state = Path(a.state_dir)
    fetch = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "model", "fetch", "gemma3-270m", "--state-dir",
                            str(state)], capture_output=True, text=True, cwd=ROOT)
    if fetch.returncode != 0:
        raise SystemExit(f"meshd model fetch gemma3-270m failed:\n{fetch.stderr[-2000:]}")
    model_dir, gguf = Path(fetch.stdout.strip().splitlines()[-1]), state / "cache" / GGUF_NAME
    llama, why_not = llama_cpp(a.llama_cpp, a.build_llama_cpp)
    have_llama = llama is not None
    binary = llama / "bin" / "llama-bench" if llama else None
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads)}
    common = ["--threads", str(a.threads), "--prompt", str(a.prompt), "--decode", str(a.decode)]

    rss = {}
    for dt in DTYPES:
        out = subprocess.run([sys.executable, __file__, *common, "--worker", str(model_dir), dt, "--once"],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"meshd {dt} failed:\n{out.stderr[-2000:]}")
        rss[f"meshd {dt}"] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    if have_llama:
        rss["llama.cpp Q4_K_M"] = llama_bench(binary, gguf, a.threads, a.prompt, a.decode, 1)["peak_rss_mb"]

    workers = {}
    for dt in DTYPES:
        p = subprocess.Popen([sys.executable, __file__, *common, "--worker", str(model_dir), dt],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        _line(p, lambda ln: ln == "ready")
        workers[f"meshd {dt}"] = p
    best: dict[str, dict[str, float]] = {}
    try:
        for _ in range(a.rounds):
            for name, p in workers.items():  # one worker busy at a time
                p.stdin.write("go\n"), p.stdin.flush()
                r = json.loads(_line(p, lambda ln: ln.startswith('{"prefill_s"')))
                b = best.setdefault(name, {})
                b["prefill"] = max(b.get("prefill", 0), a.prompt / r["prefill_s"])
                b["decode"] = max(b.get("decode", 0), a.decode / r["decode_s"])
            if have_llama:
                r = llama_bench(binary, gguf, a.threads, a.prompt, a.decode, 1)
                b = best.setdefault("llama.cpp Q4_K_M", {})
                b["prefill"] = max(b.get("prefill", 0), r["prefill"])
                b["decode"] = max(b.get("decode", 0), r["decode"])
    finally:
        for p in workers.values():
            p.stdin.close()
            p.wait(timeout=60)

    ref = best.get("llama.cpp Q4_K_M")
    print(f"Gemma 3 270M, {a.threads} threads, prompt {a.prompt} tokens, decode {a.decode} tokens, "
          f"best of {a.rounds} interleaved rounds; load {os.getloadavg()[0]:.1f}")
    print(f"{'config':<20}{'prefill tok/s':>14}{'decode tok/s':>14}{'peak RSS MB':>13}"
          f"{'prefill vs llama':>18}{'decode vs llama':>17}")
    for name, b in best.items():
        ratio = (lambda k: f"{b[k] / ref[k]:.2f}x" if ref else "-")  # noqa: E731
        print(f"{name:<20}{b['prefill']:>14.1f}{b['decode']:>14.1f}{rss.get(name) or float('nan'):>13.0f}"
              f"{ratio('prefill'):>18}{ratio('decode'):>17}")
    if not have_llama:
        print(f"llama.cpp column skipped: {why_not}")
    print(json.dumps({"best": best, "peak_rss_mb": rss}))


if __name__ == "__main__":
    main()
