"""Batch-1 prefill and decode speed of one whole-model stage, per dtype, with peak RSS.

Each configuration runs in a child process so its peak RSS is its own. If llama-cpp-python
is importable, llama.cpp on the same GGUF file is measured too and the ratios printed.

    .venv/bin/python bench/bench_single.py [--model DIR] [--gguf FILE] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from locate import SMOLLM2_GGUF, add_model_flag, gguf_file, need_model

PROMPT_TOKENS = 128
DECODE_TOKENS = 48


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def child_torch(model_dir: str, dtype: str, threads: int, device: str) -> dict:
    import torch

    torch.set_num_threads(threads)
    from shards.engine import StageEngine
    from shards.manifest import Manifest
    from shards.span import Span

    n = Manifest.load(Path(model_dir)).n_layers
    eng = StageEngine.load(Path(model_dir), Span(0, n), True, True, device=device, dtype=dtype, verify=False)
    stage = eng.stage
    prompt = [(i * 131) % 40000 + 100 for i in range(PROMPT_TOKENS)]

    def sync():
        if stage.device.type == "cuda":
            torch.cuda.synchronize()

    def prefill() -> float:
        caches = stage.new_caches()
        sync()
        t0 = time.perf_counter()
        stage.head(stage(stage.embed(torch.tensor(prompt, device=stage.device)), 0, caches)[-1:])
        sync()
        return time.perf_counter() - t0

    def decode() -> float:
        caches = stage.new_caches()
        x = stage(stage.embed(torch.tensor(prompt[:16], device=stage.device)), 0, caches)
        tok = int(stage.head(x[-1:]).argmax())
        sync()
        t0 = time.perf_counter()
        for i in range(DECODE_TOKENS):
            x = stage(stage.embed(torch.tensor([tok], device=stage.device)), 16 + i, caches)
            tok = int(stage.head(x).argmax())
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        prefill()  # warm-up
        p = min(prefill() for _ in range(3))
        d = min(decode() for _ in range(2))
    eng.close()
    return {"engine": f"torch {dtype}", "prefill_tok_s": PROMPT_TOKENS / p, "decode_tok_s": DECODE_TOKENS / d,
            "peak_rss_mb": _rss_mb()}


def child_llama_cpp(gguf: str, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_ctx=512, verbose=False)
    prompt = [(i * 131) % 40000 + 100 for i in range(PROMPT_TOKENS)]
    t0 = time.perf_counter()
    llm.eval(prompt)
    p = time.perf_counter() - t0
    llm.reset()
    llm.eval(prompt[:16])
    t0 = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    d = time.perf_counter() - t0
    return {"engine": "llama.cpp Q4_1", "prefill_tok_s": PROMPT_TOKENS / p, "decode_tok_s": DECODE_TOKENS / d,
            "peak_rss_mb": _rss_mb()}


def _run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_flag(ap)
    ap.add_argument("--gguf", type=Path, default=gguf_file(SMOLLM2_GGUF),
                    help="GGUF file for the llama.cpp comparison (default: %(default)s, the model's source as fetched)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--child", nargs="*")
    a = ap.parse_args()
    if a.child is not None:
        kind, *rest = a.child
        res = child_torch(rest[0], rest[1], a.threads, a.device) if kind == "torch" \
            else child_llama_cpp(rest[0], a.threads)
        print(json.dumps(res))
        return

    results = [_run_child(["torch", str(need_model(a.model)), dt]) for dt in a.dtypes.split(",")]
    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False
    gguf = a.gguf
    if have_llama and gguf:
        results.append(_run_child(["llama", str(gguf)]))
    print(f"SmolLM2-135M batch 1, {a.threads} threads, device {a.device}; "
          f"prefill {PROMPT_TOKENS} tokens, decode {DECODE_TOKENS} tokens")
    print(f"{'engine':18} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MB':>12}")
    for r in results:
        print(f"{r['engine']:18} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} {r['peak_rss_mb']:12.0f}")
    base = results[0]
    for r in results[1:]:
        print(f"{r['engine']} / {base['engine']}: prefill x{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}, "
              f"decode x{r['decode_tok_s'] / base['decode_tok_s']:.2f}")
    if not have_llama:
        print("llama.cpp comparison skipped: llama-cpp-python is not importable (pip install llama-cpp-python)")
    elif gguf is None:
        print(f"llama.cpp comparison skipped: no {SMOLLM2_GGUF} in the state dir's cache/ "
              "(`make test` fetches it; or --gguf FILE)")


if __name__ == "__main__":
    main()
