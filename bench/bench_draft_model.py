"""Does a draft model pay? Batch-1 decode of free text (where prompt lookup has nothing to
guess from) on one daemon pinned to core 0 with one thread: the target is the default
model dequantized to float32 (``make test`` makes it), the draft model the default model
itself (SmolLM2 Q4_1 kept quantized: the same tokenizer, about a fifth of the bytes a
token reads). The draft model's worker thread shares the daemon's core.

Configurations, all started first and measured in turns (the order reversed every other
round):

- ``off``: ``--speculate off``
- ``lookup``: the default (prompt lookup, as many as pay)
- ``draft``: ``--speculate always --draft-model`` (every step drafts 4 tokens)
- ``draft-auto``: ``--draft-model`` with the default speculation (as many as pay on the
  measured step costs, each drafted token also costing the draft model's forward)

Prints the median decode tok/s of each, the ratios against ``off``, the draft model's
drafted/taken counts, and checks that each configuration's text equals ``off``'s.

    .venv/bin/python bench/bench_draft_model.py [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench_pipeline import client, pinned_workdir, start_meshd, stream, wait_http
from bench_speculative import FREE
from locate import DEFAULT_MODEL, OUT, model_dir, need_model


async def measure(url: str, tokens: int) -> tuple[float, dict]:
    rates, texts = [], {}
    async with client() as http:
        await stream(http, url, {"prompt": "Warm up.", "max_tokens": 4})
        for i, prompt in enumerate(FREE):
            r = await stream(http, url, {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens},
                             chat=True)
            rates.append((r["n"] - 1) / (r["last"] - r["first"]) if r["n"] > 1 else float("nan"))
            texts[i] = r["text"]
    return statistics.median(rates), texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=model_dir(DEFAULT_MODEL + "-float32"), help="the target")
    ap.add_argument("--draft-model", type=Path, default=model_dir(DEFAULT_MODEL), help="the draft model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT, help="where the figures go (default: %(default)s)")
    args = ap.parse_args()
    need_model(args.model, DEFAULT_MODEL + "-float32")
    need_model(args.draft_model)
    if (workdir := pinned_workdir("bench_draft_model")) is None:
        return 2
    configs = {"off": ("--speculate", "off"), "lookup": (),
               "draft": ("--speculate", "always", "--draft-model", str(args.draft_model)),
               "draft-auto": ("--draft-model", str(args.draft_model))}
    print(f"conditions: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, one daemon pinned to core 0, "
          f"1 thread; greedy free-text chat streams of {args.tokens} tokens; target {args.model.name}, draft "
          f"{args.draft_model.name}; logs in {workdir}", flush=True)
    running, rows, texts = {}, {name: [] for name in configs}, {}
    try:
        for name, extra in configs.items():
            print(f"== starting {name}", flush=True)
            running[name] = start_meshd(1, args, workdir, name=f"meshd-{name}", extra=extra)
        for name in ("draft", "draft-auto"):  # loaded once the peer serves: wait for it
            wait_http(running[name].url + "/status",
                      lambda v: v["node"]["scheduler"]["speculation"]["draft_model"] is not None, 120,
                      running[name].procs, "draft model")
        for round_no in range(args.rounds):
            for name in list(configs) if round_no % 2 == 0 else list(configs)[::-1]:
                t0 = time.monotonic()
                rate, texts[name] = asyncio.run(measure(running[name].url, args.tokens))
                rows[name].append(rate)
                print(f"   round {round_no} {name}: {rate:.1f} tok/s ({time.monotonic() - t0:.0f} s)", flush=True)
        spec = {name: wait_http(r.url + "/status", lambda v: True, 10, r.procs, "status")
                ["node"]["scheduler"]["speculation"] for name, r in running.items()}
    finally:
        for r in running.values():
            r.stop()
    med = {name: statistics.median(rs) for name, rs in rows.items()}
    print("\n| config | free tok/s | vs off | drafted (by the model) | taken (by the model) | tokens per checked step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        s = spec[name]
        print(f"| {name} | {m:.1f} | {m / med['off']:.2f}x | {s['drafted']} ({s['model_drafted']}) "
              f"| {s['accepted']} ({s['model_accepted']}) | {s['tokens_per_step'] or '-'} |")
    same = {name: texts[name] == texts["off"] for name in configs}
    print("texts equal off's (greedy): " + ", ".join(f"{n} {ok}" for n, ok in same.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_model.json").write_text(json.dumps({"medians": med, "speculation": spec, "same_text": same},
                                                          indent=2))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
