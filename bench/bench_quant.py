"""fp32 against weight-only int8 / int4 shards, side by side in one run: batch-1 prefill and
decode tok/s, the aggregate of 16 streams decoded through one batched forward, peak RSS.

Peak RSS: each configuration alone in a child process (VmHWM). Speed: all of them in one
child, timed in interleaved rounds, best of each. The quantized model directories are
converted from the GGUF file next to the fp32 model on first use (a no-op later).
llama.cpp on the same Q4_1 file with the same thread count runs when llama-cpp-python is
importable (one sequence per context through that binding: no 16-stream figure).

    .venv/bin/python bench/bench_quant.py [--model DIR] [--gguf FILE] [--threads 2] [--configs ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from locate import SMOLLM2_GGUF, add_model_flag, gguf_file, need_model

PROMPT_TOKENS = 128
DECODE_TOKENS = 48
STREAMS = 16
STREAM_STEPS = 16

# name -> (convert kwargs or None for the fp32 directory itself)
CONFIGS = {
    "fp32": {"dtype": "float32"},
    "gguf": None,  # the default model as fetched: the GGUF's own Q4_1 / Q8_0 kept
    "int8": {"quantize": "int8"},
    "int8+head8": {"quantize": "int8", "quantize_head": True},
    "int4": {"quantize": "int4"},
    "int4+head8": {"quantize": "int4", "quantize_head": "int8"},
    "int4+head4": {"quantize": "int4", "quantize_head": True},
}


def _peak_rss_mb() -> float:
    """This process's own high-water RSS (VmHWM; getrusage's maxrss survives exec, so a
    child would report its parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


PROMPT = [(i * 131) % 40000 + 100 for i in range(PROMPT_TOKENS)]


class TorchRunner:
    def __init__(self, model_dir: str):
        import torch

        from shards.engine import StageEngine
        from shards.manifest import Manifest
        from shards.span import Span

        self.torch = torch
        self.manifest = Manifest.load(Path(model_dir))
        self.engine = StageEngine.load(Path(model_dir), Span(0, self.manifest.n_layers), True, True,
                                       device="cpu", dtype="auto", verify=False)
        self.stage = self.engine.stage
        self.weights_mb = sum(e.size for e in self.manifest.files.values()) / 1e6

    def _ids(self, t):
        return self.torch.tensor(t)

    def prefill(self) -> float:
        st = self.stage
        with self.torch.inference_mode():
            caches = st.new_caches()
            t0 = time.perf_counter()
            st.head(st(st.embed(self._ids(PROMPT)), 0, caches)[-1:])
            return time.perf_counter() - t0

    def decode(self) -> float:
        st = self.stage
        with self.torch.inference_mode():
            caches = st.new_caches()
            x = st(st.embed(self._ids(PROMPT[:16])), 0, caches)
            tok = int(st.head(x[-1:]).argmax())
            t0 = time.perf_counter()
            for i in range(DECODE_TOKENS):
                x = st(st.embed(self._ids([tok])), 16 + i, caches)
                tok = int(st.head(x).argmax())
            return time.perf_counter() - t0

    def streams(self) -> float:
        """STREAMS sessions, each a 16-token prompt, then STREAM_STEPS decode steps, each one
        batched forward over every session's row (attention per session) and one head."""
        st = self.stage
        with self.torch.inference_mode():
            caches = [st.new_caches() for _ in range(STREAMS)]
            toks = [int(st.head(st(st.embed(self._ids(PROMPT[s:s + 16])), 0, caches[s])[-1:]).argmax())
                    for s in range(STREAMS)]
            t0 = time.perf_counter()
            for step in range(STREAM_STEPS):
                x = st.forward_batch(st.embed(self._ids(toks)), [(16 + step, 1, c) for c in caches])
                toks = st.head(x).argmax(-1).tolist()
            return time.perf_counter() - t0


class LlamaRunner:
    def __init__(self, gguf: str, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                         n_batch=PROMPT_TOKENS, verbose=False)
        self.weights_mb = os.path.getsize(gguf) / 1e6

    def prefill(self) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(PROMPT)
        return time.perf_counter() - t0

    def decode(self) -> float:
        self.llm.reset()
        self.llm.eval(PROMPT[:16])
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            self.llm.eval([self.llm.sample(temp=0.0)])
        return time.perf_counter() - t0

    def streams(self) -> float:
        return float("nan")  # one sequence per context through this binding


def _runner(kind: str, path: str, threads: int):
    return TorchRunner(path) if kind == "torch" else LlamaRunner(path, threads)


def child_rss(kind: str, path: str, threads: int) -> dict:
    """Load one configuration alone and run each phase once: its own peak RSS."""
    import torch

    torch.set_num_threads(threads)
    r = _runner(kind, path, threads)
    r.prefill()
    r.decode()
    r.streams()
    return {"peak_rss_mb": _peak_rss_mb(), "weights_mb": r.weights_mb}


def child_speed(specs: list[str], threads: int, rounds: int) -> dict:
    """Every configuration in one process, timed in interleaved rounds (best of each), so
    that whatever else shares the cores weighs on all of them alike."""
    import torch

    torch.set_num_threads(threads)
    runners = {}
    for spec in specs:
        name, kind, path = spec.split("|")
        runners[name] = _runner(kind, path, threads)
    best: dict[str, dict[str, float]] = {n: {} for n in runners}
    for n, r in runners.items():  # warm-up
        r.prefill()
    for _ in range(rounds):
        for n, r in runners.items():
            for phase in ("prefill", "decode", "streams"):
                t = getattr(r, phase)()
                b = best[n]
                b[phase] = t if t != t else min(b.get(phase, float("inf")), t)  # nan: no such phase
    rate = lambda n, t: n / t if t == t and t != float("inf") else None  # noqa: E731 (None: not measured)
    return {n: {"prefill_tok_s": rate(PROMPT_TOKENS, b["prefill"]), "decode_tok_s": rate(DECODE_TOKENS, b["decode"]),
                "streams_tok_s": rate(STREAMS * STREAM_STEPS, b["streams"])} for n, b in best.items()}


def _run_child(args: list[str], threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--threads", str(threads), "--child", *args],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_dir_for(name: str, fp32_dir: Path, gguf: Path | None) -> Path:
    """(``fp32_dir`` is the default model's directory, which is now the GGUF kept as shipped.)"""
    kwargs = CONFIGS[name]
    if kwargs is None:
        return fp32_dir
    if gguf is None:
        raise SystemExit(f"{name}: no GGUF file to convert from (--gguf)")
    from shards.convert import convert
    from shards.manifest import Manifest

    out = fp32_dir.parent / f"{fp32_dir.name}-{name.replace('+', '-')}"
    return convert(gguf, out, name=Manifest.load(fp32_dir).name, progress=False, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_flag(ap)
    ap.add_argument("--gguf", type=Path, default=gguf_file(SMOLLM2_GGUF),
                    help="the Q4_1 GGUF file (default: %(default)s, the model's source as fetched)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--child", nargs="*")
    a = ap.parse_args()
    if a.child is not None:
        what, *rest = a.child
        res = child_rss(rest[0], rest[1], a.threads) if what == "rss" else child_speed(rest, a.threads, a.rounds)
        print(json.dumps(res))
        return

    fp32 = need_model(a.model)
    gguf = a.gguf
    runs = {n: ("torch", str(model_dir_for(n, fp32, gguf))) for n in a.configs.split(",")}
    try:
        import llama_cpp  # noqa: F401
        have_llama = gguf is not None
    except ImportError:
        have_llama = False
    if have_llama:
        runs["llama.cpp Q4_1"] = ("llama", str(gguf))
    rss = {n: _run_child(["rss", kind, path], a.threads) for n, (kind, path) in runs.items()}
    speed = _run_child(["speed", *(f"{n}|{k}|{p}" for n, (k, p) in runs.items())], a.threads)
    print(f"SmolLM2-135M, {a.threads} threads, CPU; best of {a.rounds} interleaved rounds; prefill "
          f"{PROMPT_TOKENS} tokens, batch-1 decode {DECODE_TOKENS} tokens, {STREAMS} streams x "
          f"{STREAM_STEPS} steps through one batched forward")
    print(f"| config | weights MB | prefill tok/s | decode tok/s | {STREAMS}-stream tok/s | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    f = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    for n in runs:
        r = speed[n] | rss[n]
        print(f"| {n} | {r['weights_mb']:.0f} | {f(r['prefill_tok_s'])} | {f(r['decode_tok_s'])} | "
              f"{f(r['streams_tok_s'])} | {r['peak_rss_mb']:.0f} |")
    ref = speed.get("llama.cpp Q4_1")
    for n in runs:
        if ref and n != "llama.cpp Q4_1":
            print(f"{n} / llama.cpp: decode x{speed[n]['decode_tok_s'] / ref['decode_tok_s']:.2f}, "
                  f"prefill x{speed[n]['prefill_tok_s'] / ref['prefill_tok_s']:.2f}")
    if not have_llama:
        print("llama.cpp row skipped: " + ("llama-cpp-python is not importable (pip install llama-cpp-python)"
                                           if gguf else f"no {SMOLLM2_GGUF} in the state dir's cache/ (`make test`)"))


if __name__ == "__main__":
    main()
