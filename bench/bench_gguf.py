"""GGUF files kept as shipped against llama.cpp on the same files, side by side in one run.

For each GGUF file: its tensor bytes; converted with its quantization kept (`meshd model
convert`, the default); one whole-model stage loaded in a child process of its own, as a
node loads it (the engine, its device layouts built): the bytes its weights hold resident
(every tensor the stage references once, packed layouts included), its peak RSS (VmHWM) and
its batch-1 decode tok/s (a 16-token prompt, then single-token steps, best of --rounds);
and llama.cpp's `llama-bench` decode (tg) on the same file with the same thread count.
The two engines run in alternating rounds so that other work on the machine weighs on both.
``--step-by-step`` adds a third engine to each round: meshd with ``Kernels.ROWS`` (decode
rows through a block's steps one C call at a time, as before shards/rowops.c's ro_block).

    .venv/bin/python bench/bench_gguf.py [--threads 2] [--tokens 64] [--rounds 3] [--step-by-step]
                                         [--llama-cpp DIR] [--build-llama-cpp] [FILE.gguf ...]

Default files, where ``make test`` leaves them (the state dir's cache/, bench/locate.py):
SmolLM2's Q4_1 (the default model's source), a SmolLM2 Q4_K_M that `llama-quantize` makes
from it (once, beside it), Gemma 3 270M Q4_K_M (``--gemma``); a file that is absent, or of a
family not supported yet, is a row that says so. llama.cpp's tools: ``--llama-cpp DIR``,
``$LLAMA_CPP_HOME``, or ``../shared/tools/llama-cpp``'s folder once built (``--build-llama-cpp``
builds it); without them the llama.cpp column is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from locate import GEMMA_GGUF, SMOLLM2_GGUF, add_llama_cpp_flags, gguf_file, llama_cpp, state_dir

PROMPT = [(i * 131) % 40000 + 100 for i in range(16)]


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model_dir: str, threads: int, tokens: int, rounds: int, kernels: str) -> dict:
    import torch

    torch.set_num_threads(threads)
    from shards.engine import StageEngine
    from shards.manifest import Manifest
    from shards.rowops import Kernels
    from shards.qlinear import held_bytes
    from shards.span import Span

    n = Manifest.load(Path(model_dir)).n_layers
    t0 = time.perf_counter()
    eng = StageEngine.load(Path(model_dir), Span(0, n), True, True, "cpu", "float32", kernels=Kernels(kernels))
    load_s = time.perf_counter() - t0
    rss_loaded = _status_mb("VmRSS")
    stage = eng.stage
    out = {"load_s": round(load_s, 2), "resident_weight_bytes": held_bytes(stage),
           "rss_after_load_mb": round(rss_loaded, 1)}
    paths: dict[str, int] = {}
    for m in stage.modules():
        if hasattr(m, "path"):
            paths[m.path] = paths.get(m.path, 0) + 1
    out["paths"] = paths

    def decode() -> float:
        with torch.inference_mode():
            caches = stage.new_caches()
            x = stage(stage.embed(torch.tensor(PROMPT)), 0, caches)
            tok = int(stage.head(x[-1:])[0].argmax())
            pos = len(PROMPT)
            t = time.perf_counter()
            for _ in range(tokens):
                x = stage(stage.embed(torch.tensor([tok])), pos, caches)
                tok = int(stage.head(x)[0].argmax())
                pos += 1
            return tokens / (time.perf_counter() - t)

    eng.run_sync(decode)  # warm-up, on the engine's thread like every round (see shards/engine.py default_threads)
    out["decode_tok_s"] = [round(eng.run_sync(decode), 2) for _ in range(rounds)]
    out["peak_rss_mb"] = round(_status_mb("VmHWM"), 1)
    eng.close()
    return out


def llama_bench(llama: Path, gguf: Path, threads: int, tokens: int) -> float:
    cmd = [str(llama / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
           "-n", str(tokens), "-r", "2", "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(res.stdout)[0]["avg_ts"])


def tensor_bytes(gguf: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors)


def default_files(llama: Path | None, gemma: Path) -> list[Path]:
    q4_1 = gguf_file(SMOLLM2_GGUF)
    files = [q4_1] if q4_1 else []
    k_m = (q4_1.parent if q4_1 else state_dir() / "cache") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if q4_1 and llama and not k_m.exists():
        tmp = k_m.with_suffix(".f16.tmp")
        q = str(llama / "bin" / "llama-quantize")
        subprocess.run([q, "--allow-requantize", str(q4_1), str(tmp), "F16"], check=True, capture_output=True)
        subprocess.run([q, str(tmp), str(k_m), "Q4_K_M"], check=True, capture_output=True)
        tmp.unlink()
    if k_m.exists():
        files.append(k_m)
    return files + [gemma]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    add_llama_cpp_flags(ap)
    ap.add_argument("--gemma", type=Path, default=gguf_file(GEMMA_GGUF) or state_dir() / "cache" / GEMMA_GGUF,
                    help="Gemma 3 270M's GGUF file (default: %(default)s, where `make test` puts it)")
    ap.add_argument("--step-by-step", action="store_true", help="also meshd without the whole-block kernel")
    ap.add_argument("--child", nargs=1)
    ap.add_argument("--kernels", default="whole-block", help=argparse.SUPPRESS)  # the child's
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.threads, a.tokens, a.rounds, a.kernels)))
        return
    llama, why_not = llama_cpp(a.llama_cpp, a.build_llama_cpp, tools=("llama-bench", "llama-quantize"))
    if llama is None:
        print(f"llama.cpp column skipped: {why_not}", flush=True)
    files = [Path(f) for f in a.files] or default_files(llama, a.gemma)
    from shards.convert import convert

    rows = []
    for f in files:
        row = {"file": f.name}
        rows.append(row)
        if not f.exists():
            row["skipped"] = f"file absent ({f}; `make test` fetches the default ones)"
            continue
        row["tensor_mb"] = tensor_bytes(f) / 1e6
        row["file_mb"] = f.stat().st_size / 1e6
        try:
            out = convert(f, state_dir() / "models" / f"bench-{f.stem.lower()}", name=f"bench-{f.stem.lower()}",
                          progress=False)
        except Exception as e:  # noqa: BLE001 - a family not supported yet is a result here
            row["skipped"] = f"convert: {e}"[:160]
            continue
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        ours, steps, theirs = [], [], []

        def meshd(kernels: str = "whole-block") -> dict:
            res = subprocess.run([sys.executable, __file__, "--child", str(out), "--threads", str(a.threads),
                                  "--tokens", str(a.tokens), "--rounds", "1", "--kernels", kernels],
                                 capture_output=True, text=True, env=env, check=True)
            return json.loads(res.stdout.strip().splitlines()[-1])
        for _ in range(a.rounds):  # alternate the engines so that other load weighs on both
            r = meshd()
            ours.append(r["decode_tok_s"][0])
            row |= {k: v for k, v in r.items() if k != "decode_tok_s"}
            if a.step_by_step:
                steps.append(meshd("rows")["decode_tok_s"][0])
            if llama:
                theirs.append(llama_bench(llama, f, a.threads, a.tokens))
        row["decode_tok_s"] = max(ours)
        row["step_by_step_tok_s"] = max(steps) if steps else None
        row["llama_tok_s"] = max(theirs) if theirs else None
    print(f"\nthreads {a.threads}, {a.tokens} decode tokens, best of {a.rounds} alternating rounds\n")
    sbs = a.step_by_step
    print("| file | tensor MB | resident weights MB (x tensor) | peak RSS MB | meshd decode tok/s | "
          + ("step by step tok/s (x) | " if sbs else "") + "llama.cpp tok/s | x llama.cpp | kernel paths |")
    print("|---|---:|---:|---:|---:|" + ("---:|" if sbs else "") + "---:|---:|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['file']} | {r.get('tensor_mb', float('nan')):.1f} | skipped: {r['skipped']} | | | | | |")
            continue
        w = r["resident_weight_bytes"] / 1e6
        lt, ours, st = r["llama_tok_s"], r["decode_tok_s"], r["step_by_step_tok_s"]
        vs = f"x{ours / lt:.2f}" if lt else "n/a"
        step = f"{st:.1f} (x{ours / st:.2f}) | " if sbs else ""
        print(f"| {r['file']} | {r['tensor_mb']:.1f} | {w:.1f} (x{w / r['tensor_mb']:.2f}) | {r['peak_rss_mb']:.0f} | "
              f"{ours:.1f} | {step}{'n/a' if lt is None else f'{lt:.1f}'} | {vs} | {r['paths']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
