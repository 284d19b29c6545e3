"""What exact failover costs: the default model (SmolLM2 Q4_1 kept quantized) on the block
kernel (the file's own scales, a row's bits whatever runs beside it: the default) against
torch's int4 kernel (group scales rounded to bf16, sums that depend on how many rows run
together: what ran before issue 34), side by side in one process, timed in interleaved
rounds (best of each): prefill of 128 tokens, batch-1 decode, 16 streams decoded through
one batched forward. Then the replay experiment on each: generate 32 greedy tokens one row
at a time, restart from the prompt plus the first k in one prefill (what a failover's replay
does) and count the restarts that continue differently. Last, what a prompt's rows cost when
they attend row by row as decode rows do (the default, so a row's bits never depend on the
chunk it ran in) against torch's SDPA over the chunk, for prompts of 128, 512 and 1024.
And the same file dequantized to float32 (where ``make test`` made it): its linears on
qblocks.c's row-invariant float kernel (the default on a CPU) against torch's GEMM (MKL,
whose sums depend on how many rows run), with the replay experiment on each.

    .venv/bin/python bench/bench_invariance.py [--model DIR] [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time

from bench_quant import DECODE_TOKENS, PROMPT_TOKENS, STREAM_STEPS, STREAMS, TorchRunner
from locate import DEFAULT_MODEL, add_model_flag, model_dir, need_model

PROMPTS = [[(i * 131 + 7 * p) % 40000 + 100 for i in range(12 + 5 * p)] for p in range(4)]
REPLAY_TOKENS = 32
ATTENTION_PROMPTS = (128, 512, 1024)


def _divergent_restarts(stage) -> tuple[int, int]:
    from shards.engine import generate_greedy

    restarts = diverged = 0
    for ids in PROMPTS:
        stream = generate_greedy(stage, ids, REPLAY_TOKENS)
        for k in range(1, REPLAY_TOKENS - 1, 2):
            restarts += 1
            diverged += generate_greedy(stage, ids + stream[:k], REPLAY_TOKENS - k) != stream[k:]
    return restarts, diverged


def _attention_costs(runner, rounds: int) -> dict[int, tuple[float, float]]:
    """Prefill of n tokens with a chunk's rows attending row by row (ro_attend_rows, what a
    decode row computes: the default) and with torch's SDPA over the chunk, interleaved; and
    whether the last row's hidden state equals the same row decoded alone after the rest."""
    import torch

    import shards.rowops as rowops

    st, out = runner.stage, {}
    for n in ATTENTION_PROMPTS:
        ids = torch.tensor([(i * 131 + 7) % 40000 + 100 for i in range(n)])
        best = {True: float("inf"), False: float("inf")}
        same = {}
        for _ in range(rounds):
            for exact in (True, False):
                rowops.EXACT_ROWS = exact
                try:
                    with torch.inference_mode():
                        caches = st.new_caches()
                        t0 = time.perf_counter()
                        whole = st(st.embed(ids), 0, caches)
                        best[exact] = min(best[exact], time.perf_counter() - t0)
                        caches = st.new_caches()
                        st(st.embed(ids[:-1]), 0, caches)
                        same[exact] = torch.equal(whole[-1:], st(st.embed(ids[-1:]), n - 1, caches))
                finally:
                    rowops.EXACT_ROWS = True
        out[n] = (n / best[True], n / best[False], same[True], same[False])
    return out


def _phases(r, rounds: int, flag) -> dict[bool, dict[str, float]]:
    """Best time of each phase with ``flag(True)`` and ``flag(False)``, in interleaved rounds."""
    best: dict[bool, dict[str, float]] = {True: {}, False: {}}
    for _ in range(rounds):
        for on in (True, False):
            flag(on)
            try:
                for phase in ("prefill", "decode", "streams"):
                    best[on][phase] = min(best[on].get(phase, float("inf")), getattr(r, phase)())
            finally:
                flag(True)
    return best


def _float_rows(rounds: int) -> dict[str, dict] | None:
    import shards.qlinear as qlinear

    where = model_dir(DEFAULT_MODEL + "-float32")
    if not (where / "manifest.json").exists():
        print(f"\nno float32 model at {where} (make test makes it): float section skipped")
        return None

    def exact(on: bool) -> None:
        qlinear.EXACT_FLOAT = on

    runner = TorchRunner(str(where))
    runner.prefill()
    best = _phases(runner, rounds, exact)
    rows = {}
    for on, name in ((True, "row-invariant (C)"), (False, "torch GEMM")):
        exact(on)
        try:
            restarts, diverged = _divergent_restarts(runner.stage)
        finally:
            exact(True)
        b = best[on]
        rows[name] = {"prefill_tok_s": PROMPT_TOKENS / b["prefill"], "decode_tok_s": DECODE_TOKENS / b["decode"],
                      "streams_tok_s": STREAMS * STREAM_STEPS / b["streams"], "restarts": restarts,
                      "diverged": diverged}
    return rows


def _table(rows: dict[str, dict]) -> None:
    print(f"| kernel | prefill {PROMPT_TOKENS} tok/s | decode b1 tok/s | {STREAMS} streams tok/s "
          f"| replays that diverge |")
    print("|---|---:|---:|---:|---:|")
    for n, v in rows.items():
        print(f"| {n} | {v['prefill_tok_s']:.0f} | {v['decode_tok_s']:.1f} | {v['streams_tok_s']:.0f} "
              f"| {v['diverged']} of {v['restarts']} |")
    (a, e), (b, i) = rows.items()
    print(f"{a} / {b}: prefill {e['prefill_tok_s'] / i['prefill_tok_s']:.2f}x, "
          f"decode {e['decode_tok_s'] / i['decode_tok_s']:.2f}x, streams {e['streams_tok_s'] / i['streams_tok_s']:.2f}x")
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_flag(ap)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = need_model(args.model)

    import torch

    import shards.qlinear as qlinear
    import shards.quant as quant

    torch.set_num_threads(args.threads)
    exact_runs = quant.BLOCK_RUNS
    runners = {"exact (blocks)": TorchRunner(str(model))}
    quant.BLOCK_RUNS = qlinear.BLOCK_RUNS = tuple(t for t in exact_runs if t not in quant.INT4_BLOCKS)
    try:
        runners["int4pack"] = TorchRunner(str(model))
    finally:
        quant.BLOCK_RUNS = qlinear.BLOCK_RUNS = exact_runs
    best: dict[str, dict[str, float]] = {n: {} for n in runners}
    for r in runners.values():
        r.prefill()
    for _ in range(args.rounds):
        for n, r in runners.items():
            for phase in ("prefill", "decode", "streams"):
                best[n][phase] = min(best[n].get(phase, float("inf")), getattr(r, phase)())
    rows = {}
    for n, r in runners.items():
        b = best[n]
        restarts, diverged = _divergent_restarts(r.stage)
        rows[n] = {"prefill_tok_s": PROMPT_TOKENS / b["prefill"], "decode_tok_s": DECODE_TOKENS / b["decode"],
                   "streams_tok_s": STREAMS * STREAM_STEPS / b["streams"], "restarts": restarts,
                   "diverged": diverged}
    print(f"threads {args.threads}, best of {args.rounds} interleaved rounds, {time.strftime('%Y-%m-%d %H:%M')}")
    _table(rows)
    costs = _attention_costs(runners["exact (blocks)"], args.rounds)
    print("\nattention of a prompt's rows (block kernel): row by row as decode rows attend, or torch's SDPA")
    print("| prompt | row by row tok/s | SDPA tok/s | ratio | last row = decoded alone (row by row / SDPA) |")
    print("|---:|---:|---:|---:|---|")
    for n, (exact, sdpa, same_exact, same_sdpa) in costs.items():
        print(f"| {n} | {exact:.0f} | {sdpa:.0f} | {exact / sdpa:.2f}x | {same_exact} / {same_sdpa} |")
    floats = _float_rows(args.rounds)
    if floats is not None:
        print("\nthe same model dequantized to float32: its linears row-invariant in C, or on torch's GEMM")
        _table(floats)


if __name__ == "__main__":
    main()
