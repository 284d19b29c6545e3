"""Time to first token under load: a new session's first token comes from a step of its
own (the first-token lane), whose engine calls go before the queued decode batches, so it
waits for the call in progress at most, not for a full decode step of every running stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from meshd.control.runner import LocalRunner
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Scheduler
from protocol.messages import Assignment, NodeId
from shards.engine import URGENT, StageEngine
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.span import Span
from shards.tokenizer import MeshTokenizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def engine(tiny_model_dir):
    n = Manifest.load(tiny_model_dir).n_layers
    eng = await asyncio.to_thread(StageEngine.load, tiny_model_dir, Span(0, n), True, True, "cpu", "float32")
    yield eng
    eng.close()


async def test_urgent_engine_calls_go_before_queued_ones(engine):
    gate, order = threading.Event(), []

    async def call(name: str, urgent: bool) -> None:
        URGENT.set(urgent)  # this task's own context
        await engine._run(lambda: order.append(name))

    busy = asyncio.create_task(engine._run(gate.wait))  # the call in progress
    await asyncio.sleep(0.05)
    tasks = [asyncio.create_task(call("decode-1", False)), asyncio.create_task(call("decode-2", False))]
    await asyncio.sleep(0.05)
    tasks.append(asyncio.create_task(call("first-token", True)))
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.gather(busy, *tasks)
    assert order == ["first-token", "decode-1", "decode-2"]


async def test_a_new_sessions_first_step_carries_no_decode_rows_and_answers_the_same(engine, tiny_model_dir):
    n = engine.span.stop
    pipeline = Pipeline(lambda: engine)
    # A per-layer delay keeps the streams decoding while the new request comes in.
    await pipeline.serve(1, (Assignment(NodeId("me"), Span(0, n)),), {NodeId("me"): LocalRunner(engine, delay_ms=3.0)})
    tok = MeshTokenizer.load(tiny_model_dir)
    sched = Scheduler(pipeline, tok)
    steps: list[list[tuple[str, int]]] = []  # per step: (session, tokens generated so far)
    step = pipeline.step

    async def recorded(sessions, pick):
        steps.append([(s.id, len(s.generated)) for s in sessions])
        return await step(sessions, pick)

    pipeline.step = recorded
    runner = asyncio.get_running_loop().create_task(sched.run())

    async def gen(prompt: str, n_tokens: int) -> tuple[str, list[int]]:
        session = sched.open(tok.encode(prompt), SamplingParams(temperature=0.0, max_tokens=n_tokens))
        ids = []
        async for chunk in sched.stream(session):
            ids.extend(chunk.token_ids)
        return session.id, ids

    try:
        _, alone = await gen("a new request", 6)
        streams = [asyncio.create_task(gen(f"stream {i} says", 40)) for i in range(6)]
        await asyncio.sleep(0.3)  # they decode now
        sid, busy = await gen("a new request", 6)
        await asyncio.gather(*streams)
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    assert busy == alone
    first = next(s for s in steps if any(i == sid for i, _ in s))
    assert all(generated == 0 for _, generated in first), f"its first step carried decode rows: {first}"
