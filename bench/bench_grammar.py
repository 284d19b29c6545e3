"""The grammar mask's cost: decode tok/s of the supernode's scheduler with and without a
json_schema constraint, at batch 1 and 16, side by side in one run (interleaved rounds),
plus the mask's own time per step (llguidance's compute + our bool tensor).

One whole-model local stage of SmolLM2-135M (fp32, CPU) behind the real Scheduler and
Pipeline, so the mask runs where it runs in the mesh: in ``_pick`` on the engine's thread,
once per session per step. End-of-turn tokens are biased out (-100) in both arms, so
every free session runs exactly --tokens tokens; the schema (a list of log records) keeps most
constrained ones going that long (one that closes its JSON early ends: tok/s counts tokens made).

    .venv/bin/python bench/bench_grammar.py                      # batch 1 and 16, 64 tokens, 2 rounds
    .venv/bin/python bench/bench_grammar.py --batches 1,16 --tokens 32 --rounds 1 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time

import torch
from locate import add_model_flag, need_model  # bench/: also puts the repo on sys.path

from meshd.control.runner import LocalRunner
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Scheduler
from protocol.messages import Assignment, NodeId
from shards import grammar
from shards.engine import StageEngine
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.span import Span
from shards.tokenizer import MeshTokenizer

SCHEMA = {"type": "object", "properties": {"log": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "level": {"enum": ["info", "warn", "error"]},
                                     "note": {"type": "string", "maxLength": 40}},
    "required": ["id", "level", "note"], "additionalProperties": False}}}, "required": ["log"]}
PROMPT = "Write a JSON log of what a small cluster did today:"


class Timed:
    """Wraps Constraint.allowed to add up the mask's own time."""

    seconds = 0.0
    calls = 0

    @classmethod
    def install(cls) -> None:
        inner = grammar.Constraint.allowed

        def allowed(self, vocab):
            t0 = time.perf_counter()
            try:
                return inner(self, vocab)
            finally:
                cls.seconds += time.perf_counter() - t0
                cls.calls += 1

        grammar.Constraint.allowed = allowed


async def one_run(sched: Scheduler, tok: MeshTokenizer, batch: int, tokens: int, constrained: bool) -> float:
    g = grammar.json_schema_grammar(SCHEMA, "bench") if constrained else None
    bias = tuple((t, -100.0) for t in sorted(tok.eos_ids))
    ids = tok.encode(PROMPT)

    async def session(i: int) -> int:
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=tokens, logit_bias=bias, grammar=g)
        n = 0
        async for chunk in sched.generate(ids, params):
            n += len(chunk.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(session(i) for i in range(batch)))
    dt = time.perf_counter() - t0
    # A constrained answer may close its JSON (then only an end-of-turn is allowed) before --tokens.
    return sum(counts) / dt


async def main(args) -> None:
    model = need_model(args.model)
    n = Manifest.load(model).n_layers
    engine = await asyncio.to_thread(StageEngine.load, model, Span(0, n), True, True, "cpu", "float32")
    pipeline = Pipeline(lambda: engine)
    await pipeline.serve(1, (Assignment(NodeId("me"), Span(0, n)),), {NodeId("me"): LocalRunner(engine)})
    tok = MeshTokenizer.load(model)
    grammar.grammar_tokenizer(tok)
    sched = Scheduler(pipeline, tok)
    runner = asyncio.get_running_loop().create_task(sched.run())
    Timed.install()
    try:
        await one_run(sched, tok, 1, 4, True)  # warm-up
        results: dict[tuple[int, bool], list[float]] = {}
        mask: dict[int, list[float]] = {}
        for _ in range(args.rounds):
            for batch in args.batches:
                for constrained in (False, True):
                    Timed.seconds, Timed.calls = 0.0, 0
                    rate = await one_run(sched, tok, batch, args.tokens, constrained)
                    results.setdefault((batch, constrained), []).append(rate)
                    if constrained:
                        mask.setdefault(batch, []).append(Timed.seconds / max(1, Timed.calls) * 1e3)
        print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, {args.tokens} tokens/session, "
              f"best of {args.rounds}, load average {os.getloadavg()[0]:.1f}")
        print("| batch | free tok/s | json_schema tok/s | ratio | mask ms/session-step |")
        print("|---:|---:|---:|---:|---:|")
        for batch in args.batches:
            free, cons = max(results[(batch, False)]), max(results[(batch, True)])
            print(f"| {batch} | {free:.1f} | {cons:.1f} | {cons / free:.2f} | {min(mask[batch]):.3f} |")
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
        engine.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flag(p)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    asyncio.run(main(a))
