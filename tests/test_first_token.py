"""Time to first token under load: a new session's first token comes from a step of its
own (the first-token lane), whose engine calls go before the queued decode batches, so it
waits for the call in progress at most, not for a full decode step of every running stream.
A long prompt goes in chunks that running streams step between.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from meshd.control.runner import LocalRunner
from meshd.serving.pipeline import PREFILL_CHUNK, SHARED_CHUNK, Pipeline
from meshd.serving.scheduler import Scheduler
from protocol.messages import Assignment, NodeId
from shards.engine import URGENT, StageEngine
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.span import Span
from shards.tokenizer import MeshTokenizer

pytestmark = pytest.mark.timeout(60)

LONG_PROMPT = [(7 * i + 3) % 200 + 10 for i in range(300)]  # a forward long enough to step into


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

    async def recorded(sessions, pick, *times):
        steps.append([(s.id, len(s.generated)) for s in sessions])
        return await step(sessions, pick, *times)

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


async def _between_layers(engine, long_session: str, urgent_call, forward=None):
    """A long forward of ``long_session`` (not urgent; ``forward``, default the engine's
    ``forward_batch``) runs; once it is past its first layer, ``urgent_call()`` is made
    with URGENT set. Returns the two results and the order in which they finished."""
    forward = forward or engine.forward_batch
    started, release = threading.Event(), threading.Event()
    real = engine._pool.run_urgent

    def held() -> None:  # the first layer boundary waits until the urgent call is queued
        if not started.is_set():
            started.set()
            release.wait(10)
        real()

    engine._pool.run_urgent = held
    order: list[str] = []

    async def long() -> object:
        hidden = await engine.embed(LONG_PROMPT)
        out = await forward([(long_session, 0, len(LONG_PROMPT))], hidden)
        order.append("long")
        return out

    async def urgent() -> object:
        URGENT.set(True)
        out = await urgent_call()
        order.append("urgent")
        return out

    try:
        first = asyncio.create_task(long())
        await asyncio.to_thread(started.wait, 10)
        second = asyncio.create_task(urgent())
        await asyncio.sleep(0.1)  # queued on the engine by now
        release.set()
        a, b = await asyncio.gather(first, second)
    finally:
        engine._pool.run_urgent = real
    return a, b, order


async def test_an_urgent_step_runs_between_the_layers_of_a_running_forward(engine):
    """A new session's first-token step queued while a long forward runs goes in after
    the layer in progress, not after the whole forward; both answer what they answer alone."""
    tokens = [5, 17, 42, 9]

    async def step():
        return await engine.step([("new", 0, len(tokens))], tokens, None, [len(tokens) - 1], lambda lg: lg.clone())

    long_out, (logits, _), order = await _between_layers(engine, "long", step)
    assert order == ["urgent", "long"], "the urgent step waited for the whole forward"
    alone_logits, _ = await engine.step([("new-alone", 0, len(tokens))], tokens, None, [len(tokens) - 1],
                                        lambda lg: lg.clone())
    assert torch.equal(logits, alone_logits)
    alone = await engine.forward_batch([("long-alone", 0, len(LONG_PROMPT))], await engine.embed(LONG_PROMPT))
    assert torch.equal(long_out, alone)


async def test_an_urgent_call_on_the_running_forwards_session_waits_for_it(engine):
    """An urgent call that reaches a session the running forward holds does not run inside
    it (the caches would change under it): it runs after, and both come out right."""
    async def more():
        return await engine.forward_batch([("long", len(LONG_PROMPT), 1)], await engine.embed([11]))

    long_out, one_more, order = await _between_layers(engine, "long", more)
    assert order == ["long", "urgent"]
    assert engine.cached_length("long") == len(LONG_PROMPT) + 1
    alone = await engine.forward_batch([("ref", 0, len(LONG_PROMPT))], await engine.embed(LONG_PROMPT))
    assert torch.equal(long_out, alone)
    ref_next = await engine.forward_batch([("ref", len(LONG_PROMPT), 1)], await engine.embed([11]))
    assert torch.equal(one_more, ref_next)


async def test_a_forwards_own_seconds_leave_out_urgent_calls_run_between_its_layers(engine):
    """A follower's forward seconds (meshd_stage_forward_seconds) are its own forward's, as
    a step's are: an urgent call run between its layers is not counted in them."""
    async def slow_urgent():
        return await engine._run(lambda: time.sleep(0.4))

    began = time.monotonic()
    (out, seconds), _, order = await _between_layers(engine, "long", slow_urgent, engine.forward_timed)
    wall = time.monotonic() - began
    assert order == ["urgent", "long"]
    assert wall > 0.4 and seconds < wall - 0.35, f"{seconds:.3f} s of {wall:.3f} s counted the urgent call"
    alone = await engine.forward_batch([("ref", 0, len(LONG_PROMPT))], await engine.embed(LONG_PROMPT))
    assert torch.equal(out, alone)


async def test_a_step_queued_across_a_replan_that_keeps_the_engine_is_replayed_not_failed(engine):
    """A re-plan that keeps the supernode's span clears its caches (``drop_all``); a decode
    step of the old term still queued then finds its session's cache gone. That is a
    PeerLost (the pipeline replays under the new plan), not a ModelError (a 500)."""
    from meshd.errors import PeerLost, StageFailed
    from protocol.messages import Segment

    runner = LocalRunner(engine)
    await engine.step([("s", 0, 3)], [5, 6, 7])
    gate = threading.Event()
    busy = asyncio.create_task(engine._run(gate.wait))  # the call in progress
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(runner.step(1, [Segment("s", 3, 1)], [8]))
    await asyncio.sleep(0.05)
    engine.drop_all()  # the new plan keeps this engine
    gate.set()
    await busy
    with pytest.raises(PeerLost):
        await queued
    # The same call with no re-plan under it: a Fail, as a peer's stage answers a missing
    # cache (the pipeline asks for a new plan and replays), not a model error that ends it.
    with pytest.raises(StageFailed, match="no cache here"):
        await runner.step(1, [Segment("s", 3, 1)], [8])


async def test_a_long_prompt_arriving_while_streams_decode_goes_in_chunks_between_their_steps(engine, tiny_model_dir):
    """A prompt of 300 tokens while a stream decodes: its steps take SHARED_CHUNK rows each,
    those before its last chunk queue behind the stream's (not urgent), so the stream gets
    tokens between them, instead of waiting for the whole prompt; both answers are the
    same tokens as alone. Alone (in a decode lane at once) the prompt goes PREFILL_CHUNK rows a step."""
    n = engine.span.stop
    pipeline = Pipeline(lambda: engine)
    await pipeline.serve(1, (Assignment(NodeId("me"), Span(0, n)),), {NodeId("me"): LocalRunner(engine, delay_ms=2.0)})
    tok = MeshTokenizer.load(tiny_model_dir)
    sched = Scheduler(pipeline, tok, prefix_entries=0)  # (the prompt again finds no cached prefix)
    steps: list[tuple[list[tuple[str, int, int]], int, bool]] = []  # (session, cached, generated), chunk, urgent
    step = pipeline.step

    async def recorded(sessions, pick, times=None, chunk=PREFILL_CHUNK):
        steps.append(([(s.id, s.cached, len(s.generated)) for s in sessions], chunk, URGENT.get()))
        return await step(sessions, pick, times, chunk)

    pipeline.step = recorded
    runner = asyncio.get_running_loop().create_task(sched.run())

    async def gen(prompt: list[int], n_tokens: int) -> tuple[str, list[int]]:
        session = sched.open(prompt, SamplingParams(temperature=0.0, max_tokens=n_tokens))
        ids = []
        async for chunk in sched.stream(session):
            ids.extend(chunk.token_ids)
        return session.id, ids

    try:
        long_alone_id, long_alone = await gen(LONG_PROMPT, 4)
        _, stream_alone = await gen(tok.encode("a stream says"), 60)
        stream = asyncio.create_task(gen(tok.encode("a stream says"), 60))
        await asyncio.sleep(0.2)  # it decodes now
        long_id, long_busy = await gen(LONG_PROMPT, 4)
        stream_id, stream_busy = await stream
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    assert long_busy == long_alone and stream_busy == stream_alone
    alone = [(chunk, urgent) for rows, chunk, urgent in steps if rows[0][0] == long_alone_id]
    assert [chunk for chunk, _ in alone] == [PREFILL_CHUNK] * (-(-len(LONG_PROMPT) // PREFILL_CHUNK) + 3)
    prefill = [(i, chunk, urgent) for i, (rows, chunk, urgent) in enumerate(steps)
               if rows[0][0] == long_id and rows[0][2] == 0]  # its steps before its first token
    assert len(prefill) == -(-len(LONG_PROMPT) // SHARED_CHUNK)
    assert all(chunk == SHARED_CHUNK for _, chunk, _ in prefill)
    assert [urgent for _, _, urgent in prefill] == [False] * (len(prefill) - 1) + [True]
    # the stream went on between the prompt's first and last chunks (a step of its spans at
    # most two chunks: its engine calls queue between theirs)
    first, last = prefill[0][0], prefill[-1][0]
    between = [rows for rows, _, _ in steps[first:last] if any(s == stream_id for s, _, _ in rows)]
    assert len(between) >= len(prefill) // 2, (len(between), len(prefill))
