"""Greedy continuations through meshd beside llama.cpp's on the same GGUF file, per quant type.

For each file (the default SmolLM2 Q4_1, and Q4_0 / Q8_0 files that ``llama-quantize
--allow-requantize`` makes of it: one set of weights, three block formats), each of five
prompts is continued greedily for ``--tokens`` tokens by a one-node ``meshd run`` of the
file kept quantized (``/v1/completions``, temperature 0), by ``llama-completion``
(``--temp 0``, one thread, ``--no-repack``), and by transformers on the same file
dequantized to float32 (its own GGUF reader), the arbiter of what the file's weights say.
Printed per file: for each prompt whether meshd and llama.cpp agree all the way, else the
character where the texts part and what each said; and how many prompts meshd continues
exactly as transformers does. Each side stops at an end token.

Why meshd and llama.cpp can part: llama.cpp's CPU kernels for these types quantize each
activation row to 8 bits (Q8_0 / Q8_1 blocks) before the dot product; meshd multiplies by
the file's exact dequantized weights in float32 with float32 activations, as transformers
does. Where the top two tokens are within that rounding of each other, greedy choices differ.

    .venv/bin/python bench/bench_greedy_llamacpp.py [--tokens 32] [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from locate import SMOLLM2_GGUF, add_llama_cpp_flags, gguf_file, llama_cpp, one_node_daemon

PROMPTS = [
    "The quick brown fox",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def meshd_text(url: str, prompt: str, tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def llama_text(folder: Path, gguf: Path, prompt: str, tokens: int) -> str:
    cmd = [str(folder / "bin" / "llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(tokens),
           "--temp", "0", "-t", "1", "--no-repack", "-no-cnv", "--no-display-prompt", "--simple-io"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(f"llama-completion exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def transformers_texts(gguf: Path, tokens: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=tokens, do_sample=False)
            out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def parting(a: str, b: str) -> int | None:
    """The first character where ``a`` and ``b`` differ (None: one is a prefix of the other;
    llama-completion ends its output with a blank line of its own)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--types", default="Q4_1,Q4_0,Q8_0", help="quant types, the first the file's own")
    add_llama_cpp_flags(ap)
    args = ap.parse_args()
    folder, why = llama_cpp(args.llama_cpp, args.build_llama_cpp, ("llama-completion", "llama-quantize"))
    if folder is None:
        print(f"llama.cpp is needed: {why}", file=sys.stderr)
        return 2
    source = gguf_file(SMOLLM2_GGUF)
    if source is None:
        print("no SmolLM2 GGUF in the state dir's cache: run `make model` first", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from shards.convert import convert

    summary = {}
    with tempfile.TemporaryDirectory(prefix="bench-greedy-") as tmp:
        work = Path(tmp)
        for i, qtype in enumerate(args.types.split(",")):
            gguf = source
            if i > 0:
                gguf = work / f"smollm2-{qtype.lower()}.gguf"
                subprocess.run([str(folder / "bin" / "llama-quantize"), "--allow-requantize", str(source), str(gguf),
                                qtype], check=True, capture_output=True, timeout=600)
            model = convert(gguf, work / f"model-{qtype}", name=f"smollm2-{qtype.lower()}", progress=False)
            (work / qtype).mkdir()
            with one_node_daemon(model, work / qtype, "--threads", "1") as url:
                ours = [meshd_text(url, p, args.tokens) for p in PROMPTS]
            theirs = [llama_text(folder, gguf, p, args.tokens) for p in PROMPTS]
            arbiter = transformers_texts(gguf, args.tokens)
            as_transformers = sum(a == t for a, t in zip(ours, arbiter))
            agree = 0
            print(f"\n{qtype} ({gguf.name}): {args.tokens} greedy tokens per prompt")
            for prompt, a, b in zip(PROMPTS, ours, theirs):
                at = parting(a, b)
                if at is None:
                    agree += 1
                    print(f"  same    {prompt!r} -> {a[:60]!r}...")
                else:
                    print(f"  differ  {prompt!r} at character {at}: common {a[:at]!r}\n"
                          f"          meshd {a[at:at + 40]!r}\n          llama.cpp {b[at:at + 40]!r}")
            summary[qtype] = (f"llama.cpp: {agree}/{len(PROMPTS)} prompts the same for {args.tokens} tokens; "
                              f"transformers on the dequantized file: {as_transformers}/{len(PROMPTS)}")
    print("\n" + json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
