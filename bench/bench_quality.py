"""Perplexity through the API of a running mesh, by llama.cpp's own method, beside llama.cpp's
``llama-perplexity`` on the same GGUF and transformers on the same float32 weights.

The text is ``bench/data/shakespeare-coriolanus.txt`` (the opening of Shakespeare's
Coriolanus, public domain, as in karpathy/char-rnn's tinyshakespeare; 20,590 SmolLM2 tokens).
The method is ``llama-perplexity``'s: the text's tokens (the supernode's ``/tokenize``, without
special tokens) cut into ``--chunks`` chunks of ``--ctx`` tokens, no overlap (stride = ctx);
where the model wants a BOS, it replaces each chunk's first token; within a chunk the first
half is context only and the tokens at positions ctx/2 + 1 .. ctx - 1 are scored. PPL =
exp(mean negative log-likelihood of the scored tokens). Each chunk is one request:
``{"prompt": ids, "echo": true, "logprobs": 0, "max_tokens": 0}``, whose ``token_logprobs``
are the prompt's own (the head on every row, computed where the mesh computes it).

    .venv/bin/python bench/bench_quality.py                      # a one-node daemon on the default model
    .venv/bin/python bench/bench_quality.py --url http://HOST:8470   # a running mesh
    .venv/bin/python bench/bench_quality.py --model DIR --gguf FILE --hf DIR --ctx 512 --chunks 40 --cost 5

``--hf DIR`` (a float32 model directory of a Llama-family model, as ``meshd model convert
--dtype float32`` writes it) adds transformers' perplexity of the same chunks, on the same
weights; ``--hf-gguf FILE`` the same with transformers reading the GGUF itself (any family it
reads, Gemma 3 too); ``--gguf FILE`` (default: the file the model came from) with llama.cpp's tools adds
``llama-perplexity -c CTX --chunks N`` on it; ``--cost PAIRS`` what scoring a chunk costs over
sending it as a plain prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from locate import (ROOT, SMOLLM2_GGUF, add_llama_cpp_flags, add_model_flag, gguf_file, llama_cpp, need_model,
                    one_node_daemon)

TEXT = ROOT / "bench" / "data" / "shakespeare-coriolanus.txt"


def post(url: str, path: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def chunks_of(url: str, text: str, ctx: int, n_chunks: int) -> tuple[list[list[int]], int]:
    """llama-perplexity's chunks of the text's tokens (BOS first where the model wants it),
    and the text's token count."""
    plain = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
    special = post(url, "/tokenize", {"prompt": "x", "add_special_tokens": True})["tokens"]
    bare = post(url, "/tokenize", {"prompt": "x", "add_special_tokens": False})["tokens"]
    bos = special[0] if len(special) > len(bare) else None
    count = min(n_chunks, len(plain) // ctx) if n_chunks > 0 else len(plain) // ctx
    out = []
    for i in range(count):
        ids = plain[i * ctx:(i + 1) * ctx]
        if bos is not None:
            ids = [bos] + ids[1:]
        out.append(ids)
    return out, len(plain)


def api_perplexity(url: str, chunks: list[list[int]], ctx: int) -> dict:
    first = ctx // 2
    nll, scored = 0.0, 0
    began = time.perf_counter()
    for ids in chunks:
        answer = post(url, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
        lps = answer["choices"][0]["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids), (len(lps), len(ids))
        part = lps[first + 1:]
        nll -= sum(part)
        scored += len(part)
    seconds = time.perf_counter() - began
    return {"ppl": math.exp(nll / scored), "scored": scored, "seconds": seconds,
            "tok_s": sum(len(c) for c in chunks) / seconds}


def scoring_cost(url: str, chunks: list[list[int]], pairs: int) -> dict:
    """Seconds of one chunk scored (echo, logprobs, max_tokens 0) against the same chunk as a
    plain prompt (max_tokens 1, no logprobs: the head on its last row only), in alternating
    pairs, every request on a chunk of its own (no cached prefix to reuse), best of each.
    Run it before the perplexity pass, which leaves the chunks cached."""
    scored, plain = [], []
    for i in range(min(pairs, len(chunks) // 2)):
        a, b = chunks[2 * i], chunks[2 * i + 1]
        t0 = time.perf_counter()
        post(url, "/v1/completions", {"prompt": a, "echo": True, "logprobs": 0, "max_tokens": 0})
        t1 = time.perf_counter()
        post(url, "/v1/completions", {"prompt": b, "max_tokens": 1, "temperature": 0})
        scored.append(t1 - t0)
        plain.append(time.perf_counter() - t1)
    return {"scored_s": min(scored), "plain_s": min(plain), "ratio": min(scored) / min(plain)}


def hf_from_shards(fp32_dir: Path):
    from tests.test_parity_transformers import hf_model_from_shards

    return hf_model_from_shards(fp32_dir)


def hf_from_gguf(gguf: Path):
    """transformers' own reader of the GGUF, dequantized to float32: what the file's weights say."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def hf_perplexity(model, chunks: list[list[int]], ctx: int) -> dict:
    import torch

    first = ctx // 2
    nll, scored = 0.0, 0
    began = time.perf_counter()
    with torch.inference_mode():
        for ids in chunks:
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
            rows = torch.arange(first, len(ids) - 1)
            nll -= float(logp[rows, torch.tensor(ids)[rows + 1]].double().sum())
            scored += len(rows)
    return {"ppl": math.exp(nll / scored), "scored": scored, "seconds": time.perf_counter() - began}


def llama_perplexity(folder: Path, gguf: Path, ctx: int, n_chunks: int, threads: int) -> dict:
    # --no-repack: ggml's plain CPU kernels. Its AMX repack of Q4_1 dies (SIGSEGV in
    # tinygemm_kernel_amx) on a CPU with AMX as the one these figures were taken on.
    cmd = [str(folder / "bin" / "llama-perplexity"), "-m", str(gguf.resolve()), "-f", str(TEXT), "-c", str(ctx),
           "--chunks", str(n_chunks), "-t", str(threads), "--no-repack"]
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        how = (f"was killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exited {done.returncode}")
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return {"error": f"llama-perplexity {how} (its last line: {tail[0].strip()[:160]!r})"}
    return {"ppl": float(found.group(1)), "seconds": time.perf_counter() - began}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running mesh's API (default: start a one-node daemon on --model)")
    add_model_flag(ap)
    ap.add_argument("--dtype", default="auto", help="the started daemon's --dtype")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    ap.add_argument("--chunks", type=int, default=0, help="chunks to score (0: all the text holds)")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF for llama-perplexity (default: the "
                    "default model's source file in the state dir's cache)")
    ap.add_argument("--hf", type=Path, default=None, help="a float32 model directory for transformers' figure")
    ap.add_argument("--hf-gguf", type=Path, default=None,
                    help="a GGUF file for transformers' figure, dequantized by transformers' own reader (any "
                         "family it reads): what the file's weights say, without llama.cpp's activation rounding")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost", type=int, default=0, metavar="PAIRS",
                    help="also time PAIRS chunks scored against as many plain prompts of the same length")
    add_llama_cpp_flags(ap)
    args = ap.parse_args()

    text = TEXT.read_text()
    figures: dict = {"text": TEXT.name, "ctx": args.ctx, "stride": args.ctx}
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            model = need_model(args.model)
            url = stack.enter_context(one_node_daemon(model, Path(stack.enter_context(tempfile.TemporaryDirectory())),
                                                     "--dtype", args.dtype))
            figures["model"] = str(model)
        chunks, total = chunks_of(url, text, args.ctx, args.chunks)
        figures |= {"text_tokens": total, "chunks": len(chunks)}
        print(f"{TEXT.name}: {total} tokens; {len(chunks)} chunks of {args.ctx}, stride {args.ctx}, "
              f"the last {args.ctx - args.ctx // 2 - 1} of each scored")
        if args.cost:
            figures["cost"] = scoring_cost(url, chunks, args.cost)
            print(f"a chunk scored {figures['cost']['scored_s']:.2f} s, as a plain prompt "
                  f"{figures['cost']['plain_s']:.2f} s (x{figures['cost']['ratio']:.2f}, best of {args.cost})")
        figures["meshd"] = api_perplexity(url, chunks, args.ctx)
        print(f"meshd API:       PPL {figures['meshd']['ppl']:.4f}  ({figures['meshd']['scored']} tokens scored, "
              f"{figures['meshd']['tok_s']:.0f} prompt tok/s)")
    if args.hf is not None:
        figures["transformers"] = hf_perplexity(hf_from_shards(args.hf), chunks, args.ctx)
        ref = figures["transformers"]["ppl"]
        print(f"transformers:    PPL {ref:.4f}  (float32, {args.hf.name}); meshd / transformers - 1 = "
              f"{figures['meshd']['ppl'] / ref - 1:+.2e}")
    if args.hf_gguf is not None:
        figures["transformers_gguf"] = hf_perplexity(hf_from_gguf(args.hf_gguf), chunks, args.ctx)
        ref = figures["transformers_gguf"]["ppl"]
        print(f"transformers:    PPL {ref:.4f}  ({args.hf_gguf.name} dequantized by transformers); "
              f"meshd / transformers - 1 = {figures['meshd']['ppl'] / ref - 1:+.2e}")
    gguf = args.gguf or gguf_file(SMOLLM2_GGUF)
    folder, why = llama_cpp(args.llama_cpp, args.build_llama_cpp, ("llama-perplexity",))
    if folder is None or gguf is None:
        figures["llama.cpp"] = {"error": why or "no GGUF file: pass --gguf"}
    else:
        figures["llama.cpp"] = llama_perplexity(folder, gguf, args.ctx, len(chunks), args.threads) | {"gguf": gguf.name}
    lc = figures["llama.cpp"]
    if "ppl" in lc:
        print(f"llama-perplexity: PPL {lc['ppl']:.4f}  ({lc['gguf']}); meshd / llama.cpp - 1 = "
              f"{figures['meshd']['ppl'] / lc['ppl'] - 1:+.2e}")
    else:
        print(f"llama-perplexity skipped: {lc['error']}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
