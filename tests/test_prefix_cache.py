"""The prefix cache and the pipelined prefill, in process, on real engines of the tiny
model split in two stages behind the supernode's scheduler: a chat's turn 2 takes over
turn 1's caches on both stages, computes only its new rows and answers what it answers
without the cache; a stage lost while a cached prefix is in use replays and still
answers the same; the cache gives its positions back when a request needs them, and a
new plan's term invalidates it (its caches dropped on the stages). A long prompt's
chunks are in flight at both stages at once and give one engine's greedy tokens, also
when a stage is lost in the middle of the prefill."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from meshd.control.runner import LocalRunner
from meshd.errors import NoCapacity, PeerLost
from meshd.serving.pipeline import Pipeline
from meshd.serving.prefix import KV_CHUNK, MIN_REUSE
from meshd.serving.scheduler import Scheduler
from protocol.messages import Assignment, NodeId
from shards.engine import StageEngine, generate_greedy
from shards.manifest import Manifest
from shards.sampling import SamplingParams
from shards.span import Span
from shards.tokenizer import MeshTokenizer

pytestmark = pytest.mark.timeout(90)
SPLIT = 3
TURN1 = [(7 * i + 3) % 200 + 10 for i in range(40)]  # a 40-token first turn
REPLY = 12
TURN2_MORE = [50, 60, 70, 80]  # turn 2 runs to max_tokens (no end token) on the tiny model
GREEDY = SamplingParams(temperature=0.0, max_tokens=REPLY)


class Counting:
    """A stage that counts the rows it computes (and can lose its peer once)."""

    def __init__(self, engine: StageEngine, inflight: list[int] | None = None):
        self.inner = LocalRunner(engine)
        self.engine = engine
        self.rows = 0
        self.fail_at: int | None = None  # from this call on, PeerLost (the peer is gone)
        self.on_fail = None
        self.calls = 0
        self.inflight = inflight if inflight is not None else [0, 0]  # [now, most], shared by the stages

    async def forward_batch(self, term, segments, hidden):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            if self.calls == self.fail_at:
                self.on_fail()
            raise PeerLost("b: socket closed")
        self.rows += hidden.shape[0]
        self.inflight[0] += 1
        self.inflight[1] = max(self.inflight[1], self.inflight[0])
        try:
            return await self.inner.forward_batch(term, segments, hidden)
        finally:
            self.inflight[0] -= 1

    async def drop(self, term, session):
        await self.inner.drop(term, session)


@contextlib.asynccontextmanager
async def two_stage_mesh(model_dir):
    """``make(entries)``: builds a scheduler over two stages of ``model_dir`` and returns it
    with its two stage runners (every engine closed on exit)."""
    n = Manifest.load(model_dir).n_layers
    engines, tasks = [], []

    def load(span, embed=False, head=False) -> StageEngine:
        engines.append(StageEngine.load(model_dir, span, embed, head, "cpu", "float32"))
        return engines[-1]

    tokenizer = MeshTokenizer.load(model_dir)

    async def make(entries: int = 32) -> tuple[Scheduler, Counting, Counting]:
        head = await asyncio.to_thread(load, None, True, True)
        a = Counting(await asyncio.to_thread(load, Span(0, SPLIT)))
        b = Counting(await asyncio.to_thread(load, Span(SPLIT, n)), a.inflight)
        pipeline = Pipeline(lambda: head, wait_s=10)
        await pipeline.serve(1, (Assignment(NodeId("a"), Span(0, SPLIT)), Assignment(NodeId("b"), Span(SPLIT, n))),
                             {"a": a, "b": b})
        sched = Scheduler(pipeline, tokenizer, prefix_entries=entries)
        tasks.append(asyncio.get_running_loop().create_task(sched.run()))
        return sched, a, b

    try:
        yield make
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for e in engines:
            e.close()


@pytest.fixture
async def mesh(tiny_model_dir):
    async with two_stage_mesh(tiny_model_dir) as make:
        yield make


async def generate(sched: Scheduler, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    ids = []
    async for chunk in sched.generate(prompt, params):
        ids.extend(chunk.token_ids)
    return ids


async def test_turn_two_takes_over_turn_ones_caches_and_answers_the_same(mesh):
    plain, _, _ = await mesh(entries=0)
    want1 = await generate(plain, TURN1)
    turn2 = TURN1 + want1 + TURN2_MORE
    want2 = await generate(plain, turn2)
    assert plain.prefix.stats()["hits"] == 0

    sched, a, b = await mesh()
    assert await generate(sched, TURN1) == want1
    held = len(TURN1) + len(want1) - 1  # the last reply token was sampled, never fed
    assert sched.prefix.stats() | {"misses": 0} == {"entries": 1, "tokens": held, "held": KV_CHUNK, "hits": 0,
                                                     "misses": 0, "tokens_saved": 0, "evictions": 0}
    assert a.engine.sessions == b.engine.sessions == 1, "turn 1's caches were not kept on both stages"
    assert a.engine.held_positions() == b.engine.held_positions() == KV_CHUNK, "the entry counts what they hold"
    rows_before = a.rows, b.rows
    got2 = await generate(sched, turn2)
    assert got2 == want2, "the cached prefix changed the tokens"
    assert len(got2) == REPLY, "turn 2 should run to max_tokens for the row count below"
    stats = sched.prefix.stats()
    assert stats["hits"] == 1 and stats["tokens_saved"] == held
    # Turn 2 computed its new prompt rows and its decode rows, not turn 1's again.
    new_rows = (len(turn2) - held) + (len(got2) - 1)
    assert (a.rows - rows_before[0], b.rows - rows_before[1]) == (new_rows, new_rows)
    # One entry again: turn 2's longer caches, under the key turn 1's started.
    assert stats["entries"] == 1 and stats["tokens"] == len(turn2) + len(got2) - 1
    assert stats["held"] == a.engine.held_positions() == b.engine.held_positions()
    assert a.engine.sessions == b.engine.sessions == 1

    # A prompt sharing less than MIN_REUSE tokens takes nothing over.
    await generate(sched, TURN1[: MIN_REUSE - 1] + [1, 2, 3])
    assert sched.prefix.stats()["hits"] == 1 and sched.prefix.stats()["entries"] == 2


@pytest.mark.real_model
@pytest.mark.timeout(300)
async def test_on_the_quantized_default_a_cached_prefix_gives_the_tokens_it_would_without(real_model_dir):
    """Issue 34: SmolLM2 Q4_1 kept quantized (the block kernel). Turn 2 that takes over turn
    1's caches computes its new rows in a chunk of another length than a prefill of the
    whole conversation would: the same tokens all the same, turn after turn."""
    async with two_stage_mesh(real_model_dir) as make:
        plain, _, _ = await make(entries=0)
        cached, _, _ = await make()
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        tok = cached.tokenizer
        convo = tok.encode("Write a short poem about a lighthouse keeper and the sea.")
        for turn in range(3):
            want = await generate(plain, convo, params)
            got = await generate(cached, convo, params)
            assert got == want, f"turn {turn + 1}: the cached prefix changed the tokens"
            convo = convo + want + tok.encode(" And then?")
        assert cached.prefix.stats()["hits"] == 2 and plain.prefix.stats()["hits"] == 0


async def test_a_stage_lost_while_a_cached_prefix_is_in_use_replays_to_the_same_tokens(mesh, tiny_model_dir):
    plain, _, _ = await mesh(entries=0)
    want1 = await generate(plain, TURN1)
    turn2 = TURN1 + want1 + TURN2_MORE
    want2 = await generate(plain, turn2, SamplingParams(temperature=0.0, max_tokens=24))

    sched, a, b = await mesh()
    await generate(sched, TURN1)
    pipeline = sched.pipeline
    # The new owner of b's span, with empty caches.
    c = LocalRunner(await asyncio.to_thread(StageEngine.load, tiny_model_dir, b.engine.span, False, False,
                                            "cpu", "float32"))
    assignments = (pipeline.plan.assignments[0], Assignment(NodeId("c"), b.engine.span))

    def replan() -> None:  # the leader's answer to the loss
        asyncio.get_running_loop().create_task(pipeline.serve(2, assignments, {"a": a, "c": c}))

    b.fail_at, b.on_fail = b.calls + 4, replan  # mid-decode of turn 2
    got2 = await generate(sched, turn2, SamplingParams(temperature=0.0, max_tokens=24))
    assert sched.prefix.stats()["hits"] == 1, "turn 2 did not use the cached prefix"
    assert pipeline.replays == 1
    c.engine.close()
    assert got2 == want2, "a replay with a cached prefix changed the tokens"


async def test_the_cache_gives_positions_back_and_a_new_term_invalidates_it(mesh):
    sched, a, b = await mesh()
    reply = await generate(sched, TURN1)
    held = len(TURN1) + len(reply) - 1
    # Room for the running request (a chunk) plus exactly what the cache holds: admitted, nothing evicted.
    assert sched.prefix.held == KV_CHUNK and held < KV_CHUNK and len(TURN1) + REPLY <= KV_CHUNK
    sched.kv_budget_tokens = 2 * KV_CHUNK
    other = [t + 1 for t in TURN1]
    await generate(sched, other)
    assert sched.prefix.stats()["entries"] == 2 and sched.prefix.stats()["evictions"] == 0
    # A request that needs the room of one cached entry evicts the least recently used.
    await generate(sched, [t + 2 for t in TURN1])
    assert sched.prefix.stats()["evictions"] >= 1
    await asyncio.sleep(0.05)  # the eviction's drops run beside the admission
    assert a.engine.sessions == b.engine.sessions == sched.prefix.stats()["entries"]
    # Running requests alone over the budget: a 503, whatever the cache holds.
    with pytest.raises(NoCapacity, match="KV cache budget full"):
        await generate(sched, TURN1, SamplingParams(temperature=0.0, max_tokens=sched.kv_budget_tokens))

    # A new plan: what the old term cached is not taken, and leaves the stages.
    plan = sched.pipeline.plan
    await sched.pipeline.serve(plan.term + 1, plan.assignments, dict(plan.runners))
    hits = sched.prefix.stats()["hits"]
    await generate(sched, TURN1 + reply + TURN2_MORE)
    assert sched.prefix.stats()["hits"] == hits
    assert sched.prefix.stats()["entries"] == 1 and a.engine.sessions == b.engine.sessions == 1


async def test_an_entry_counts_the_chunks_its_caches_hold_and_its_taker_holds_them_too(mesh):
    """A stage's cache grows in chunks and keeps them when cut back: an entry that reached
    past one chunk counts two, and the short turn 2 that takes it over holds two as well.
    Where the budget has no room for them the prefix is computed again instead (same
    tokens); with room, it is taken over and the cache still counts what the stages hold."""
    plain, _, _ = await mesh(entries=0)
    sched, a, b = await mesh()
    first = [(5 * i + 1) % 200 + 10 for i in range(KV_CHUNK - 4)]  # its reply crosses into a second chunk
    await generate(sched, first)
    assert sched.prefix.held == a.engine.held_positions() == b.engine.held_positions() == 2 * KV_CHUNK
    short = first[:100] + [1, 2, 3]
    want = await generate(plain, short)

    sched.kv_budget_tokens = 2 * KV_CHUNK - 1  # room for the request's 115 positions, not for the entry's memory
    assert await generate(sched, short) == want
    assert sched.prefix.stats()["hits"] == 0 and sched.prefix.stats()["evictions"] == 1
    await asyncio.sleep(0.05)  # the eviction's drops run beside the admission
    assert sched.prefix.held == a.engine.held_positions() == b.engine.held_positions() == KV_CHUNK

    sched.kv_budget_tokens = None
    await generate(sched, first)  # takes short's entry over (100 tokens shared) and grows it to two chunks
    assert sched.prefix.stats()["hits"] == 1
    assert sched.prefix.held == a.engine.held_positions() == b.engine.held_positions() == 2 * KV_CHUNK
    turn2 = first[:150] + [4]
    want = await generate(plain, turn2)
    sched.kv_budget_tokens = 2 * KV_CHUNK
    assert await generate(sched, turn2) == want
    assert sched.prefix.stats()["hits"] == 2, "turn 2 did not take the entry over"
    # 162 positions cached, in the two chunks the stages still hold.
    assert sched.prefix.stats()["tokens"] == len(turn2) + REPLY - 1
    assert sched.prefix.held == a.engine.held_positions() == b.engine.held_positions() == 2 * KV_CHUNK
    assert sched.reserved_tokens == 0


LONG = [(11 * i + 5) % 250 + 20 for i in range(300)]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 rows, so that the tiny model's 512 positions hold a prompt of several."""
    import meshd.serving.pipeline as pipeline_mod
    import meshd.serving.scheduler as scheduler_mod

    monkeypatch.setattr(pipeline_mod, "PREFILL_CHUNK", 64)
    monkeypatch.setattr(scheduler_mod, "PREFILL_CHUNK", 64)


@pytest.fixture(scope="module")
def long_reference(tiny_model_dir) -> list[int]:
    whole = StageEngine.load(tiny_model_dir, Span(0, Manifest.load(tiny_model_dir).n_layers), True, True,
                             "cpu", "float32")
    try:
        return whole.run_sync(lambda: generate_greedy(whole, LONG, REPLY))
    finally:
        whole.close()


async def test_a_long_prompts_chunks_are_at_both_stages_at_once_and_answer_the_same(mesh, small_chunks,
                                                                                      long_reference):
    sched, a, b = await mesh(entries=0)
    got = await generate(sched, LONG)
    assert got == long_reference[:len(got)] and len(got) >= 4, (got, long_reference)
    assert a.inflight[1] == 2, "no chunk of the prompt was at stage b while another was at stage a"
    # The prompt (all but its last token) went through as chunks, not in the lane's steps.
    assert sum(lane.steps for lane in sched.lanes) == len(got)


async def test_a_stage_lost_mid_prefill_replays_through_the_same_path(mesh, small_chunks, long_reference,
                                                                      tiny_model_dir):
    sched, a, b = await mesh(entries=0)
    pipeline = sched.pipeline
    c = Counting(await asyncio.to_thread(StageEngine.load, tiny_model_dir, b.engine.span, False, False,
                                         "cpu", "float32"), a.inflight)
    assignments = (pipeline.plan.assignments[0], Assignment(NodeId("c"), b.engine.span))

    def replan() -> None:
        asyncio.get_running_loop().create_task(pipeline.serve(2, assignments, {"a": a, "c": c}))

    b.fail_at, b.on_fail = 3, replan  # the third chunk at stage b
    got = await generate(sched, LONG)
    c.engine.close()
    assert got == long_reference[:len(got)] and len(got) >= 4, (got, long_reference)
    # The replay went through the new owner as chunks in flight at both stages too.
    assert c.rows >= len(LONG) - 1 and a.inflight[1] == 2
