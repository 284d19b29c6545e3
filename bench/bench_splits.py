"""Which split of the layers pays? Two pinned peers at forced splits against one peer, in turns.

Placement picks one split for decode and prefill alike, and they want different ones: a
decode step pays the head (which only the supernode runs) at every step, a prefill once per
prompt. This bench forces each split of ``--splits`` (layers on the supernode; the rest on
the second peer) with ``--mem-budget``, and sets each against one peer on the same core:

- ``meshd-1``: one daemon on core 0
- ``split-K``: two daemons, the supernode on core 0 holding layers [0, K), the second peer on
  core 1 holding the rest

All meshes are started first and measured a round each in turns (the order reversed every
other round), one busy while the others idle, since this kind of box drifts by 20-30% over
minutes. Per round: the aggregate tok/s of ``--streams`` greedy streams x ``--tokens``,
batch-1 decode tok/s, and the time to first token of a new ~``--long``-token prompt. It
prints each split's medians and their ratios to one peer (issue 13's targets: aggregate
>= 1.7x, long-prompt TTFT <= 0.65x, decode >= 0.95x).

    .venv/bin/python bench/bench_splits.py                        # 10, 12, 14 of 30; 3 rounds, ~10 min
    .venv/bin/python bench/bench_splits.py --splits 11,13 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # (the same daemons, client and prompts)
from locate import OUT, add_model_flag, need_model

from shards.manifest import Manifest


async def measure(url: str, args, tag: str) -> dict:
    async with bp.client() as http:
        await bp.stream(http, url, {"prompt": "Warm up.", "max_tokens": 4})
        return {"agg": await bp.agg16(http, url, args, tag), "decode1": await bp.decode1(http, url, args, tag),
                "ttft_long": await bp.ttft_long(http, url, args, tag)}


def budgets(manifest: Manifest, k: int) -> list[int]:
    """--mem-budget for the supernode (the head and k layers) and the second peer (the rest),
    each half a layer over, so that placement can give each exactly that many and no more."""
    layer = max(manifest.layer_bytes(i) for i in range(manifest.n_layers))
    return [manifest.embed_bytes + k * layer + layer // 2, (manifest.n_layers - k) * layer + layer // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(ap)
    ap.add_argument("--splits", default="10,12,14", help="layers on the supernode, one mesh each")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--long", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT, help="where the figures go (default: %(default)s)")
    args = ap.parse_args()
    need_model(args.model)
    manifest = Manifest.load(args.model)
    splits = [int(k) for k in args.splits.split(",")]
    if any(not 0 < k < manifest.n_layers for k in splits):
        print(f"each split must leave layers on both peers (1..{manifest.n_layers - 1})", file=sys.stderr)
        return 2
    if (workdir := bp.pinned_workdir("bench_splits")) is None:
        return 2
    print(f"conditions: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, {manifest.name} "
          f"({manifest.n_layers} layers), each daemon pinned to its own core, 1 thread; logs in {workdir}", flush=True)
    running: list[bp.Running] = []
    try:
        running.append(bp.start_meshd(1, args, workdir))
        for k in splits:
            r = bp.start_meshd(2, args, workdir, name=f"split-{k}", budgets=budgets(manifest, k))
            if f"[0:{k})" not in r.plan:
                print(f"   split-{k}: placement gave {r.plan}, not {k} layers on the supernode", flush=True)
            running.append(r)
        for r in running:
            print(f"   {r.name}: plan {r.plan}", flush=True)
        for round_no in range(args.rounds):
            for r in running if round_no % 2 == 0 else running[::-1]:
                row = asyncio.run(measure(r.url, args, f"{round_no}{r.name}"))
                r.rows.append(row)
                print(f"   round {round_no} {r.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    finally:
        for r in running:
            r.stop()
    med = {r.name: bp.median_rows(r.rows) for r in running}
    one = med["meshd-1"]
    print(f"\n== medians of {args.rounds} and ratios to one peer ({args.streams} streams x {args.tokens}; "
          f"long prompt ~{args.long} tokens)")
    print(f"   {'':<10}{'agg tok/s':>12}{'decode tok/s':>14}{'ttft_long s':>13}   ratios (agg >= 1.7, decode >= 0.95, ttft <= 0.65)")
    for name, m in med.items():
        ratios = "" if name == "meshd-1" else \
            f"   {m['agg'] / one['agg']:.2f}x  {m['decode1'] / one['decode1']:.2f}x  {m['ttft_long'] / one['ttft_long']:.2f}x"
        print(f"   {name:<10}{m['agg']:>12.1f}{m['decode1']:>14.1f}{m['ttft_long']:>13.3f}{ratios}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "splits.json").write_text(json.dumps(
        {r.name: {"plan": r.plan, "median": med[r.name], "rounds": r.rows} for r in running}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
