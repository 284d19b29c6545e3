"""How long long prompts stall a daemon's event loop (issue 15, finding 8).

A real in-process node on the default model; a ticker task on its loop records the
longest gap between its 10 ms ticks (what a heartbeat, /healthz or another request
would wait), while, side by side in one run:

  on-loop   the old path: each prompt tokenized on the event loop (``tokenizer.encode``)
  api-big   the same prompts POSTed to /v1/completions now (refused by the byte bound;
            0.95 MiB by default so that the body stays under max_body_bytes, 1 MiB)
  api-long  prompts just under the bound, POSTed (tokenized on the worker thread, then
            refused for exceeding the context: the tokenizer's full cost is paid)

    .venv/bin/python bench/bench_prompt_stall.py [--model DIR] [--prompts 5] [--mib 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from locate import add_model_flag, need_model  # noqa: E402
from tests.fixtures.daemon import running_node  # noqa: E402

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]  # ASCII: no JSON escapes


def text(chars: int, seed: int) -> str:
    rnd = random.Random(seed)
    out, n = [], 0
    while n < chars:
        w = rnd.choice(WORDS) + " "
        out.append(w)
        n += len(w)
    return "".join(out)[:chars]


class Ticker:
    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - 0.01)
            last = now

    def __enter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


async def main(args) -> None:
    model = need_model(args.model)
    with tempfile.TemporaryDirectory() as state:
        async with running_node(model, Path(state), threads=args.threads) as served, aiohttp.ClientSession() as http:
            tokenizer, context = served.node.serving_parts()
            bound = context * tokenizer.max_token_chars
            big = [text(int(args.mib * 2**20), i) for i in range(args.prompts)]
            under = [text(bound - 16, 100 + i) for i in range(args.prompts)]

            async def post(prompt: str) -> int:
                async with http.post(served.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
                    await r.read()
                    return r.status

            rows = []
            with Ticker() as t:
                t0 = time.monotonic()
                for p in big:
                    tokenizer.encode_prompt(p)
                    await asyncio.sleep(0)
                rows.append(("on-loop", len(big[0]), time.monotonic() - t0, t.worst, "-"))
            with Ticker() as t:
                t0 = time.monotonic()
                statuses = await asyncio.gather(*(post(p) for p in big))
                rows.append(("api-big", len(big[0]), time.monotonic() - t0, t.worst, statuses))
            with Ticker() as t:
                t0 = time.monotonic()
                statuses = await asyncio.gather(*(post(p) for p in under))
                rows.append(("api-long", len(under[0]), time.monotonic() - t0, t.worst, statuses))
    print(f"{args.prompts} prompts at once, model {model.name}, context {context}, byte bound {bound} chars, "
          f"torch threads {args.threads}")
    print(f"{'path':<10} {'chars':>9} {'wall s':>8} {'worst loop stall s':>19}  statuses")
    for name, chars, wall, worst, statuses in rows:
        print(f"{name:<10} {chars:>9} {wall:>8.2f} {worst:>19.3f}  {statuses}")
    print(f"stall on-loop / api-long: x{rows[0][3] / max(rows[2][3], 1e-3):.0f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_model_flag(ap)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--mib", type=float, default=0.95)  # the body stays under max_body_bytes
    ap.add_argument("--threads", type=int, default=2)
    asyncio.run(main(ap.parse_args()))
