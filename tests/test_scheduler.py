"""The supernode's scheduler, in process, on the tiny model as one local stage: the KV
admission budget (a request that would overrun it, counted in the stages' cache chunks,
is refused with NoCapacity, the 503, until a running one finishes and gives them back), max_tokens and stop
strings, and a pipeline with no plan ending a generation with the reason, its
reservation freed."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from meshd.control.runner import LocalRunner
from meshd.errors import NoCapacity
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Scheduler
from protocol.messages import Assignment, NodeId
from shards.engine import StageEngine
from shards.layers import KVCache
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.span import Span
from shards.tokenizer import MeshTokenizer

pytestmark = pytest.mark.timeout(60)
PROMPT = "the cat sat on"


@pytest.fixture
async def scheduler(tiny_model_dir):
    n = Manifest.load(tiny_model_dir).n_layers
    engine = await asyncio.to_thread(StageEngine.load, tiny_model_dir, Span(0, n), True, True, "cpu", "float32")
    pipeline = Pipeline(lambda: engine, wait_s=0.3)
    await pipeline.serve(1, (Assignment(NodeId("me"), Span(0, n)),), {"me": LocalRunner(engine)})
    finished = []
    sched = Scheduler(pipeline, MeshTokenizer.load(tiny_model_dir), on_finished=lambda: finished.append(1))
    sched.finished = finished
    runner = asyncio.get_running_loop().create_task(sched.run())
    yield sched
    runner.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await runner
    engine.close()


async def run(sched: Scheduler, params: SamplingParams) -> tuple[str, list[int], str | None]:
    text, ids, finish = [], [], None
    async for chunk in sched.generate(sched.tokenizer.encode(PROMPT), params):
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        finish = chunk.finish_reason or finish
    return "".join(text), ids, finish


async def test_kv_budget_refuses_what_would_overrun_it_until_positions_come_back(scheduler):
    """A session is charged the whole cache chunks its stages allocate for prompt +
    max_tokens (a chunk of 256 here), not the positions alone."""
    prompt = len(scheduler.tokenizer.encode(PROMPT))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    scheduler.kv_budget_tokens = KVCache.CHUNK + prompt + 8  # a chunk and a bit: room for one such request
    first = scheduler.generate(scheduler.tokenizer.encode(PROMPT), params)
    await first.__anext__()  # admitted and generating: its positions are reserved
    assert scheduler.reserved_tokens == KVCache.CHUNK
    budget = KVCache.CHUNK + prompt + 8
    with pytest.raises(NoCapacity, match=rf"KV cache budget full: {KVCache.CHUNK} of {budget} positions in use, "
                                         rf"this request needs {KVCache.CHUNK}"):
        await run(scheduler, params)
    assert len(scheduler.active) == 1, "the refused request left a session behind"
    async for _ in first:
        pass
    assert scheduler.reserved_tokens == 0 and not scheduler.active
    _, ids, finish = await run(scheduler, params)  # admitted now
    assert len(ids) == 8 and finish == "length"


async def test_max_tokens_and_stop_strings_end_a_generation(scheduler):
    text, ids, finish = await run(scheduler, SamplingParams(temperature=0.0, max_tokens=6))
    assert len(ids) == 6 and finish == "length"
    stop = text[2:4] if len(text) >= 4 else text
    cut, _, why = await run(scheduler, SamplingParams(temperature=0.0, max_tokens=6, stop=(stop,)))
    assert why == "stop" and cut == text[:text.index(stop)]
    assert scheduler.finished and not scheduler.active


async def test_no_plan_ends_the_generation_with_the_reason_and_frees_its_positions(scheduler):
    await scheduler.pipeline.suspend("supernode moved to b")
    with pytest.raises(NoCapacity, match="supernode moved to b"):
        await run(scheduler, SamplingParams(temperature=0.0, max_tokens=4))
    assert scheduler.reserved_tokens == 0 and not scheduler.active
