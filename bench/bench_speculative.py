"""Does speculative decoding pay? Batch-1 decode with prompt lookup drafts and without, on
1 and 2 peers, on an extraction workload (the answer repeats much of its prompt) and on
free text, each daemon pinned to its own core with one thread (bench_pipeline.py's set-up).

Configurations, all started first and measured in turns (a round of each at a time, the
order reversed every other round: this shared box's speed drifts over minutes):

- ``1-off`` / ``1-on``: one daemon on core 0, ``--speculate off`` or the default (auto)
- ``2-off`` / ``2-on``: two daemons, the supernode on core 0, the second peer on core 1

Each request is a greedy stream of ``--tokens`` tokens; decode tok/s runs from its first
token to its last. Where llama.cpp is built (``../shared/tools/llama-cpp``), the same prompts
(the chat template's text) on the same GGUF through its ``llama-lookup`` (prompt lookup,
``--spec-draft-n-max 8``) and with 0 (no drafts), pinned to core 0 with one thread:
its "decoded" speed, which also leaves the prompt out. Prints the medians, the ratios against the issue's targets (extraction
with drafts >= 1.8x without; 2 peers >= 1.0x one peer on extraction with drafts; free text
>= 0.95x: drafts step aside where they do not pay), and each speculating supernode's
drafted/accepted counters. Checks that each configuration's text equals ``1-off``'s.

    .venv/bin/python bench/bench_speculative.py [--rounds 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_pipeline import client, pinned_workdir, start_meshd, stream, wait_http
from locate import OUT, SMOLLM2_GGUF, add_llama_cpp_flags, add_model_flag, gguf_file, llama_cpp, need_model

RECORD = {"id": 4187, "name": "Ada Lovelace", "born": "1815-12-10", "city": "London", "country": "England",
          "field": "mathematics", "languages": ["English", "French", "Italian"],
          "known_for": ["the first published algorithm", "notes on the Analytical Engine", "poetical science"],
          "parents": {"father": "Lord Byron", "mother": "Anne Isabella Milbanke"}}
CODE = '''def load(path):
    with open(path) as f:
        return json.load(f)


def save(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge(a, b):
    out = dict(a)
    out.update(b)
    return out
'''
EXTRACTION = [
    "Rewrite this JSON with the city changed to Paris, keeping every other field as it is:\n"
    + json.dumps(RECORD) + "\nRewritten JSON:\n",
    "Here is a Python module:\n\n" + CODE + "\nThe same module with the function save renamed to store:\n\n",
    "Copy this list exactly, one item per line:\n" + "\n".join(f"- item {i}: {w}" for i, w in enumerate(
        ["apples", "bread", "cheese", "dates", "eggs", "flour", "grapes", "honey"])) + "\nCopy:\n",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "Describe a walk through a forest in autumn.",
]
CONFIGS = {"1-off": (1, ("--speculate", "off")), "1-on": (1, ()), "2-off": (2, ("--speculate", "off")), "2-on": (2, ())}
TARGETS = {"extraction on/off, 1 peer": 1.8, "extraction on/off, 2 peers": 1.8,
           "extraction 2 peers / 1 peer, on": 1.0, "free on/off, 1 peer": 0.95, "free on/off, 2 peers": 0.95}


async def measure(url: str, args) -> tuple[dict, dict]:
    """Median decode tok/s per workload, and the texts answered (for the equality check)."""
    out, texts = {}, {}
    async with client() as http:
        await stream(http, url, {"prompt": "Warm up.", "max_tokens": 4})
        for kind, prompts in (("extraction", EXTRACTION), ("free", FREE)):
            rates = []
            for i, prompt in enumerate(prompts):
                r = await stream(http, url, {"messages": [{"role": "user", "content": prompt}],
                                             "max_tokens": args.tokens}, chat=True)
                rates.append((r["n"] - 1) / (r["last"] - r["first"]) if r["n"] > 1 else float("nan"))
                texts[f"{kind}{i}"] = r["text"]
                out[f"{kind}{i}"] = rates[-1]
            out[kind] = statistics.median(rates)
    return out, texts


def repeated(prompt: str, answer: str, n: int = 12) -> float:
    """The share of the answer's characters inside a run of ``n`` or more that the prompt
    holds too: how much of it a lookup of the prompt could draft."""
    covered = [False] * len(answer)
    for i in range(len(answer) - n + 1):
        if answer[i:i + n] in prompt:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(answer) if answer else 0.0


def llama_lookup(args, workdir: Path) -> dict | None:
    """Median decode tok/s of llama.cpp's llama-lookup per workload, with drafts and without,
    and its drafted/accepted counts; None (said why) where llama.cpp or the GGUF is missing."""
    folder, why = llama_cpp(args.llama_cpp, args.build_llama_cpp, ("llama-lookup",))
    gguf = gguf_file(SMOLLM2_GGUF)
    if folder is None or gguf is None:
        print(f"\nllama-lookup skipped: {why or 'no SmolLM2 GGUF in the fetch cache'}")
        return None
    from shards.tokenizer import MeshTokenizer

    tok = MeshTokenizer.load(args.model)
    out: dict = {"drafted": 0, "accepted": 0}
    for draft in (8, 0):
        for kind, prompts in (("extraction", EXTRACTION), ("free", FREE)):
            rates = []
            for i, prompt in enumerate(prompts):
                text = workdir / f"lookup-{kind}{i}.txt"
                text.write_text(tok.render_chat([{"role": "user", "content": prompt}]))
                done = subprocess.run(["taskset", "-c", "0", str(folder / "bin" / "llama-lookup"), "-m", str(gguf),
                                       "-f", str(text), "-n", str(args.tokens), "-t", "1", "-c", "2048",
                                       "--temp", "0", "--top-k", "1", "--spec-draft-n-max", str(draft)],
                                      capture_output=True, text=True, timeout=600)
                log = done.stdout + done.stderr
                speed = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", log)
                if done.returncode != 0 or speed is None:
                    print(f"\nllama-lookup failed (--spec-draft-n-max {draft}): {log.strip()[-400:]}")
                    return None
                rates.append(float(speed.group(1)))
                if draft:
                    out["drafted"] += int(re.search(r"n_drafted\s+=\s+(\d+)", log).group(1))
                    out["accepted"] += int(re.search(r"n_accept\s+=\s+(\d+)", log).group(1))
            out[f"{kind}-{'on' if draft else 'off'}"] = statistics.median(rates)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(ap)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT, help="where the figures go (default: %(default)s)")
    add_llama_cpp_flags(ap)
    args = ap.parse_args()
    need_model(args.model)
    if (workdir := pinned_workdir("bench_speculative")) is None:
        return 2
    print(f"conditions: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, each daemon pinned to its "
          f"own core, 1 thread; greedy chat streams of {args.tokens} tokens; logs in {workdir}", flush=True)
    running, rows, texts = {}, {name: [] for name in CONFIGS}, {}
    try:
        for name, (peers, extra) in CONFIGS.items():
            print(f"== starting {name}", flush=True)
            running[name] = start_meshd(peers, args, workdir, name=f"meshd-{name}", extra=extra)
            print(f"   plan {running[name].plan}", flush=True)
        for round_no in range(args.rounds):
            for name in list(CONFIGS) if round_no % 2 == 0 else list(CONFIGS)[::-1]:
                t0 = time.monotonic()
                row, texts[name] = asyncio.run(measure(running[name].url, args))
                rows[name].append(row)
                print(f"   round {round_no} {name}: extraction {row['extraction']:.1f} tok/s, free "
                      f"{row['free']:.1f} tok/s ({time.monotonic() - t0:.0f} s)", flush=True)
        spec = {name: wait_http(r.url + "/status", lambda v: True, 10, r.procs, "status")
                ["node"]["scheduler"]["speculation"] for name, r in running.items()}
    finally:
        for r in running.values():
            r.stop()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    print(f"\n| config | extraction tok/s | free tok/s | drafted | accepted | tokens per checked step "
          f"| step ms | ms per drafted row |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        s = spec[name]
        print(f"| {name} | {m['extraction']:.1f} | {m['free']:.1f} | {s['drafted']} | {s['accepted']} "
              f"| {s['tokens_per_step'] or '-'} | {s.get('step_ms') or '-'} | {s.get('draft_row_ms') or '-'} |")
    ratios = {"extraction on/off, 1 peer": med["1-on"]["extraction"] / med["1-off"]["extraction"],
              "extraction on/off, 2 peers": med["2-on"]["extraction"] / med["2-off"]["extraction"],
              "extraction 2 peers / 1 peer, on": med["2-on"]["extraction"] / med["1-on"]["extraction"],
              "free on/off, 1 peer": med["1-on"]["free"] / med["1-off"]["free"],
              "free on/off, 2 peers": med["2-on"]["free"] / med["2-off"]["free"]}
    print()
    for what, ratio in ratios.items():
        target = TARGETS[what]
        print(f"{what}: {ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})")
    print("\nper extraction prompt (1 peer): how much of the answer repeats the prompt, and what drafts gave")
    print("| prompt | answer repeats prompt | 1-off tok/s | 1-on tok/s | on/off |")
    print("|---|---:|---:|---:|---:|")
    for i, prompt in enumerate(EXTRACTION):
        off, on = med["1-off"][f"extraction{i}"], med["1-on"][f"extraction{i}"]
        print(f"| {prompt.splitlines()[0][:48]!r} | {repeated(prompt, texts['1-off'][f'extraction{i}']):.0%} "
              f"| {off:.1f} | {on:.1f} | {on / off:.2f}x |")
    same = {name: texts[name] == texts["1-off"] for name in CONFIGS}
    print("texts equal 1-off's (greedy): " + ", ".join(f"{n} {ok}" for n, ok in same.items()))
    llama = llama_lookup(args, workdir)
    if llama is not None:
        print("\nllama.cpp llama-lookup, same GGUF and prompts, core 0, 1 thread (decode tok/s):")
        print("| | extraction | free |")
        print("|---|---:|---:|")
        for mode in ("off", "on"):
            print(f"| llama-lookup --spec-draft-n-max {8 if mode == 'on' else 0} | {llama['extraction-' + mode]:.1f} "
                  f"| {llama['free-' + mode]:.1f} |")
        print(f"| meshd 1-on | {med['1-on']['extraction']:.1f} | {med['1-on']['free']:.1f} |")
        print(f"llama-lookup on/off: extraction {llama['extraction-on'] / llama['extraction-off']:.2f}x, free "
              f"{llama['free-on'] / llama['free-off']:.2f}x ({llama['accepted']} of {llama['drafted']} drafts taken); "
              f"meshd 1-on / llama-lookup on: extraction {med['1-on']['extraction'] / llama['extraction-on']:.2f}x, "
              f"free {med['1-on']['free'] / llama['free-on']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps({"medians": med, "ratios": ratios, "speculation": spec,
                                                           "same_text": same, "llama_lookup": llama}, indent=2))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
