"""meshd on a GPU beside its own engine, transformers and the card's bandwidth limit.

For each shape, a random-weight Llama model is made on the device with ``transformers`` (no
download), saved, and converted by meshd's own converter. Then, side by side in one run:

- ``engine``: one whole-model ``StageEngine`` stage, prefill of 512 tokens and batch-1 greedy
  decode (the loop with nothing around it);
- ``transformers``: its eager greedy loop with its KV cache, on the same weights;
- ``limit``: the decode rate the card's measured copy bandwidth allows (every weight read once
  per step: bytes of the weights / bytes per second);
- ``daemon``: ``meshd run`` on the converted model, N concurrent streaming completions on
  loopback: aggregate tokens/s and p50/p99 inter-token latency per N.

    .venv/bin/python bench/bench_gpu.py                       # 1b and 8b shapes on cuda
    .venv/bin/python bench/bench_gpu.py --shapes tiny --device cpu --streams 1,4   # a smoke run

Shapes: ``1b`` is Llama-3.2-1B's (16 layers, 2048 wide, 128k vocabulary), ``8b``
Llama-3.1-8B's (32 layers, 4096 wide), ``tiny`` a small one for machines without a GPU.
The issue's targets (issue 28) are printed beside the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from locate import add_model_flag, need_model, one_node_daemon  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=49152),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}
PREFILL = 512
DECODE = 128


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def padded_tokenizer(src_dir: Path, vocab: int, out: Path) -> None:
    """The default model's byte-level tokenizer, its vocabulary padded with placeholder tokens
    up to ``vocab`` so that every id a random model samples decodes."""
    tok = json.loads((src_dir / "tokenizer.json").read_text())
    table = tok["model"]["vocab"]
    for i in range(len(table), vocab):
        table[f"<|pad_{i}|>"] = i
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>"}))


def make_model(shape: str, device: str, dtype: str, work: Path, tokenizer_src: Path):
    """The HF model in memory (for the transformers column) and meshd's converted directory."""
    import torch
    import transformers

    from shards.convert import convert

    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rope_theta=500000.0,
                                   bos_token_id=1, eos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    hf_dir = work / f"hf-{shape}"
    model.save_pretrained(hf_dir, safe_serialization=True)
    padded_tokenizer(tokenizer_src, cfg.vocab_size, hf_dir)
    out = convert(hf_dir, work / f"meshd-{shape}", dtype=dtype, name=f"bench-{shape}", progress=False)
    shutil.rmtree(hf_dir)
    return model, out


def engine_figures(model_dir: Path, device: str, dtype: str) -> dict:
    import torch

    from shards.engine import StageEngine
    from shards.manifest import Manifest
    from shards.span import Span

    n = Manifest.load(model_dir).n_layers
    eng = StageEngine.load(model_dir, Span(0, n), True, True, device=device, dtype=dtype, verify=False)
    stage = eng.stage
    prompt = torch.tensor([(i * 131) % 40000 + 100 for i in range(PREFILL)], device=stage.device)

    def prefill() -> float:
        caches = stage.new_caches()
        sync(device)
        t0 = time.perf_counter()
        stage.head(stage(stage.embed(prompt), 0, caches)[-1:])
        sync(device)
        return time.perf_counter() - t0

    def decode() -> float:
        caches = stage.new_caches()
        x = stage(stage.embed(prompt[:16]), 0, caches)
        tok = int(stage.head(x[-1:]).argmax())
        sync(device)
        t0 = time.perf_counter()
        for i in range(DECODE):
            x = stage(stage.embed(torch.tensor([tok], device=stage.device)), 16 + i, caches)
            tok = int(stage.head(x).argmax())
        sync(device)
        return time.perf_counter() - t0

    def run() -> tuple[float, float]:
        with torch.inference_mode():
            prefill()  # warm-up
            return min(prefill() for _ in range(3)), min(decode() for _ in range(2))

    p, d = eng.run_sync(run)
    eng.close()
    return {"prefill_tok_s": PREFILL / p, "decode_tok_s": DECODE / d}


def transformers_decode(model, device: str) -> float:
    import torch

    ids = torch.tensor([[(i * 131) % 40000 + 100 for i in range(16)]], device=device)

    def once() -> float:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(DECODE):
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                int(tok)  # the token goes to the host each step, as a server's does
            sync(device)
            return time.perf_counter() - t0

    once()
    return DECODE / min(once() for _ in range(2))


def copy_rate(device: str) -> float:
    """Bytes per second the device moves (read + write) copying a 1 GiB buffer."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() / best


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


async def one_stream(http, url: str, prompt: str, tokens: int, eos: int) -> list[float]:
    """Arrival times of each streamed token."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(eos): -100}}
    times = []
    async with http.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


async def streams_figures(url: str, n: int, tokens: int, eos: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await one_stream(http, url, "warm up", 4, eos)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(http, url, f"Stream {i} says", tokens, eos) for i in range(n)))
        wall = time.perf_counter() - t0
    gaps = sorted(b - a for t in runs for a, b in zip(t, t[1:]))
    produced = sum(len(t) for t in runs)
    pick = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000 if gaps else float("nan")  # noqa: E731
    return {"streams": n, "tok_s": produced / wall, "itl_p50_ms": pick(0.50), "itl_p99_ms": pick(0.99)}


def daemon_figures(model_dir: Path, device: str, dtype: str, streams: list[int], tokens: int, work: Path) -> list[dict]:
    with one_node_daemon(model_dir, work, "--device", device, "--dtype", dtype) as url:
        return [asyncio.run(streams_figures(url, n, tokens, eos=0)) for n in streams]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 elsewhere")
    ap.add_argument("--streams", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument("--skip-daemon", action="store_true")
    add_model_flag(ap, what="the model whose tokenizer the random models borrow")
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --shapes tiny for a smoke run", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    tokenizer_src = need_model(args.model)
    streams = [int(s) for s in args.streams.split(",") if s]
    rate = copy_rate(args.device)
    print(f"device {args.device}: copy rate {rate / 1e9:.0f} GB/s; dtype {dtype}")
    for shape in [s for s in args.shapes.split(",") if s]:
        with tempfile.TemporaryDirectory(prefix=f"bench-gpu-{shape}-") as tmp:
            work = Path(tmp)
            model, model_dir = make_model(shape, args.device, dtype, work, tokenizer_src)
            hf = transformers_decode(model, args.device)
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            eng = engine_figures(model_dir, args.device, dtype)
            limit = rate / weight_bytes(model_dir)
            print(f"\n== {shape}: {weight_bytes(model_dir) / 1e9:.2f} GB of weights")
            print(f"engine prefill {PREFILL}: {eng['prefill_tok_s']:.0f} tok/s")
            print(f"batch-1 decode tok/s: engine {eng['decode_tok_s']:.1f}, transformers {hf:.1f}, limit {limit:.0f}")
            print(f"  engine / limit {eng['decode_tok_s'] / limit:.2f} (target >= {0.3 if shape == '1b' else 0.6}), "
                  f"engine / transformers {eng['decode_tok_s'] / hf:.2f}")
            if args.skip_daemon:
                continue
            rows = daemon_figures(model_dir, args.device, dtype, streams, args.tokens, work)
            one = next((r["tok_s"] for r in rows if r["streams"] == 1), None)
            print("daemon streams | tok/s | x 1 stream | ITL p50 ms | p99 ms | p99/p50")
            for r in rows:
                ratio = f"{r['tok_s'] / one:.1f}" if one else "-"
                print(f"{r['streams']:>14} | {r['tok_s']:6.1f} | {ratio:>10} | {r['itl_p50_ms']:10.2f} | "
                      f"{r['itl_p99_ms']:6.2f} | {r['itl_p99_ms'] / r['itl_p50_ms']:.2f}")
            if one:
                print(f"  daemon 1 stream / engine batch-1 {one / eng['decode_tok_s']:.2f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
