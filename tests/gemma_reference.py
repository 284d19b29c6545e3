"""Gemma 3 270M through meshd (3 spans) and through transformers loading the same GGUF,
in a process of its own: the two fp32 copies of the model peak near 4 GB, and a test
process that grew so big hands that high-water mark on to every process it starts later
(Linux keeps ru_maxrss across exec; the atheris fuzz test then runs out of its 2 GB limit).

    python -m tests.gemma_reference [--kept KEPT_DIR] MODEL_DIR GGUF_FILE DEVICE TOKENS PROMPT... > result.json

Prints one JSON object: for each prompt the token ids of both and the largest logit
difference on the prompt; for each text of the tokenizer check the differences found.
MODEL_DIR is the file converted to float32 (``--dtype float32``). With ``--kept``, the
same file converted keeping its quantization is run too: its greedy tokens, and how often
its top-1 agrees with the float32 model's along the prompt and transformers' continuation.

transformers reads GGUF metadata with llama.cpp's GGUFReader, which takes a minute on
Gemma's 262k-token vocabulary here; the reference runs with meshd's FastGGUFReader in its
place, which reads the same fields and tensors (test_fast_reader_reads_what_llama_cpp_reads).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

EXTRA_TEXTS = ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>", "a\n\n\n\nb",
               "x     y", "\u2581odd", "<unused3> ok"]


def main(model_dir: Path, gguf: Path, device: str, tokens: int, prompts: list[str], kept: Path | None = None) -> dict:
    import gguf as gguf_lib
    import transformers

    from shards.engine import generate_greedy
    from shards.gguf_source import FastGGUFReader
    from shards.model import load_stage
    from shards.span import Span
    from shards.tokenizer import MeshTokenizer
    from tests.tinyfamilies import TEXTS, reference_greedy

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    gguf_lib.GGUFReader = FastGGUFReader  # (see the module's note)
    tok = MeshTokenizer.load(model_dir)
    out: dict = {"prompts": [], "tokenizer": []}

    t0 = time.perf_counter()
    ref_tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in TEXTS + EXTRA_TEXTS:
        ids = ref_tok.encode(text, add_special_tokens=False)
        wrong = [what for what, ours, theirs in (
            ("encode_prompt", tok.encode_prompt(text), ref_tok(text)["input_ids"]),
            ("encode", tok.encode(text), ids),
            ("decode", tok.decode(ids), ref_tok.decode(ids, skip_special_tokens=False))) if ours != theirs]
        if wrong:
            out["tokenizer"].append([text, wrong])
    del ref_tok
    out["seconds"] = {"tokenizer": time.perf_counter() - t0}
    t0 = time.perf_counter()

    spans = [Span(0, 6), Span(6, 12), Span(12, 18)]
    stages = [load_stage(model_dir, s, i == 0, i == 2, device, torch.float32)[0] for i, s in enumerate(spans)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32).to(device).eval()
    out["seconds"]["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for prompt in prompts:
        ids = tok.encode_prompt(prompt)
        want, want_logits = reference_greedy(reference, ids, tokens)
        got = generate_greedy(stages, ids, tokens)
        with torch.inference_mode():
            x = stages[0].embed(torch.tensor(ids, device=stages[0].device))
            for s in stages:
                x = s(x, 0, s.new_caches())
            diff = (stages[-1].head(x).cpu() - want_logits).abs().max().item()
        out["prompts"].append({"prompt": prompt, "ids": ids, "meshd": got, "transformers": want, "max_logit_diff": diff,
                               "text": tok.decode(got)})
    out["seconds"]["greedy"] = time.perf_counter() - t0
    if kept is not None:
        del reference
        t0 = time.perf_counter()
        quantized = [load_stage(kept, s, i == 0, i == 2, device, torch.float32)[0] for i, s in enumerate(spans)]
        for r in out["prompts"]:
            seq = r["ids"] + r["transformers"]
            want, got = (_logits(stages, seq).argmax(-1), _logits(quantized, seq).argmax(-1))
            r["kept"] = generate_greedy(quantized, r["ids"], tokens)
            r["kept_top1"] = (want == got).float().mean().item()
            r["kept_text"] = tok.decode(r["kept"])
        out["seconds"]["kept"] = time.perf_counter() - t0
    return out


def _logits(stages, ids: list[int]):
    import torch

    with torch.inference_mode():
        x = stages[0].embed(torch.tensor(ids, device=stages[0].device))
        for s in stages:
            x = s(x, 0, s.new_caches())
        return stages[-1].head(x).cpu()


if __name__ == "__main__":
    args = sys.argv[1:]
    kept = Path(args[1]) if args[0] == "--kept" else None
    model_dir, gguf, device, tokens, *prompts = args[2:] if kept else args
    print(json.dumps(main(Path(model_dir), Path(gguf), device, int(tokens), prompts, kept)))
