"""The supernode's pipeline, in process, on real engines of the tiny model split in two
stages: a step through the plan gives the tokens one engine gives; a stage lost mid-way
makes the step wait for the next plan and replay the session's history through the new
owner (whose caches are empty), and the tokens go on unchanged; a stage that answers
Fail asks for a new plan; no plan in time is a NoCapacity naming why; a burst of new
prompts goes through the stages as a wave of session groups."""

from __future__ import annotations

import asyncio
import random

import pytest

from meshd.control.runner import LocalRunner
from meshd.errors import NoCapacity, PeerLost, StageFailed
from meshd.serving.pipeline import Pipeline
from meshd.serving.scheduler import Session, _pick
from protocol.messages import Assignment, NodeId
from shards.engine import StageEngine, generate_greedy
from shards.manifest import Manifest
from shards.sampling import Sampler, SamplingParams
from shards.span import Span

pytestmark = pytest.mark.timeout(60)
PROMPT = [5, 17, 42, 99, 7, 3]
TOKENS = 8
SPLIT = 3


def load(model_dir, span, embed=False, head=False) -> StageEngine:
    return StageEngine.load(model_dir, span, embed, head, "cpu", "float32")


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    """The tokens one engine of the whole model gives."""
    whole = load(tiny_model_dir, Span(0, Manifest.load(tiny_model_dir).n_layers), True, True)
    try:
        return whole.run_sync(lambda: generate_greedy(whole, PROMPT, TOKENS))
    finally:
        whole.close()


@pytest.fixture
async def parts(tiny_model_dir, reference):
    made = []

    def engine(span, embed=False, head=False) -> StageEngine:
        made.append(load(tiny_model_dir, span, embed, head))
        return made[-1]

    yield engine, Manifest.load(tiny_model_dir).n_layers, reference
    for e in made:
        e.close()


class Failing:
    """A stage whose peer goes away (or answers Fail) at its ``after``-th call."""

    def __init__(self, inner: LocalRunner, after: int, error: PeerLost, then=None):
        self.inner, self.after, self.error, self.then = inner, after, error, then
        self.calls = 0

    async def forward_batch(self, term, segments, hidden):
        self.calls += 1
        if self.calls == self.after:
            if self.then is not None:
                self.then()
            raise self.error
        return await self.inner.forward_batch(term, segments, hidden)

    async def drop(self, term, session):
        await self.inner.drop(term, session)


def plan(n: int, a: str = "a", b: str = "b") -> tuple[Assignment, ...]:
    return (Assignment(NodeId(a), Span(0, SPLIT)), Assignment(NodeId(b), Span(SPLIT, n)))


async def generate(pipeline: Pipeline, n: int = TOKENS) -> tuple[list[int], Session]:
    s = Session("s1", list(PROMPT), len(PROMPT), SamplingParams(temperature=0.0, max_tokens=n),
                sampler=Sampler(SamplingParams(temperature=0.0)))
    while len(s.generated) < n:
        token = (await pipeline.step([s], _pick))[s.id]
        if token is not None:
            s.tokens.append(token)
    return s.generated, s


async def test_a_step_through_two_stages_gives_what_one_engine_gives(parts):
    engine, n, reference = parts
    pipeline = Pipeline(lambda: head)
    head = engine(None, True, True)
    await pipeline.serve(1, plan(n), {"a": LocalRunner(engine(Span(0, SPLIT))),
                                      "b": LocalRunner(engine(Span(SPLIT, n)))})
    got, _ = await generate(pipeline)
    assert got == reference and pipeline.replays == 0


LONG = 17  # tokens of the look-ahead tests: a first token, then steps of a decode row and DRAFT drafts
DRAFT = 2


async def drafted(pipeline: Pipeline, want: list[int], guesses) -> list[int]:
    """Greedy tokens in steps that each check the next DRAFT tokens of ``want`` (drafts that
    are all taken); ``guesses(generated, draft)``: what the pipeline's look-ahead is told the
    next step's rows will be."""
    s = Session("s1", list(PROMPT), len(PROMPT), SamplingParams(temperature=0.0, max_tokens=LONG),
                sampler=Sampler(SamplingParams(temperature=0.0)))
    pipeline.next_rows = lambda session: guesses(len(session.generated), len(session.draft))
    while len(s.generated) < LONG:
        g = len(s.generated)
        s.draft = want[g:g + min(DRAFT, LONG - g - 1)] if g else []
        got = (await pipeline.step([s], _pick))[s.id]
        s.draft = []
        s.tokens += got if isinstance(got, list) else [got]
    await pipeline.release(s)
    return s.generated


@pytest.mark.parametrize("right", [True, False], ids=["guessed", "missed"])
async def test_a_next_steps_first_span_run_ahead_gives_the_same_tokens(parts, right):
    """The supernode's own first span runs a lone session's next step while the later span
    runs this one (Pipeline._look_ahead): where the guess of the next rows is right, the next
    step uses that output instead of running the span again; where it is wrong, the span runs
    again over the rows the guess left in its cache. The tokens are one engine's either way."""
    engine, n, _ = parts
    whole = engine(Span(0, n), True, True)
    want = whole.run_sync(lambda: generate_greedy(whole, PROMPT, LONG))
    first, second = engine(Span(0, SPLIT), True, True), engine(Span(SPLIT, n))
    pipeline = Pipeline(lambda: first)
    await pipeline.serve(1, plan(n), {"a": LocalRunner(first), "b": LocalRunner(second)})

    def guesses(generated: int, draft: int) -> list[int]:
        at = generated + draft  # the token after this step's draft, then the next step's draft
        rows = want[at:at + 1 + DRAFT]
        return rows if right else [(t + 1) % 50 for t in rows]

    got = await drafted(pipeline, want, guesses)
    assert got == want
    steps = 1 + (LONG - 1 + DRAFT) // (DRAFT + 1)  # the prompt's (its last row decodes too), then drafted ones
    assert pipeline.ahead_started == steps
    assert pipeline.ahead_used == (steps - 1 if right else 0)


async def test_a_stage_lost_mid_way_is_replayed_through_the_new_owner(parts):
    engine, n, reference = parts
    head = engine(None, True, True)
    pipeline = Pipeline(lambda: head, wait_s=10)
    first = LocalRunner(engine(Span(0, SPLIT)))

    def replan() -> None:  # what the leader does on the loss: a new plan, "c" for the lost span
        asyncio.get_running_loop().create_task(
            pipeline.serve(2, plan(n, b="c"), {"a": first, "c": LocalRunner(engine(Span(SPLIT, n)))}))

    lost = Failing(LocalRunner(engine(Span(SPLIT, n))), after=5, error=PeerLost("b: socket closed"), then=replan)
    await pipeline.serve(1, plan(n), {"a": first, "b": lost})
    got, session = await generate(pipeline)
    assert got == reference, "the replay changed the tokens"
    assert pipeline.replays == 1 and session.term == 2 and session.cached == len(session.tokens) - 1


async def test_a_stage_that_fails_the_step_asks_for_a_new_plan(parts):
    engine, n, reference = parts
    head = engine(None, True, True)
    asked = []
    pipeline = Pipeline(lambda: head, wait_s=10, on_stage_failed=asked.append)
    first, second = LocalRunner(engine(Span(0, SPLIT))), LocalRunner(engine(Span(SPLIT, n)))

    def replan() -> None:
        asyncio.get_running_loop().create_task(pipeline.serve(2, plan(n), {"a": first, "b": second}))

    failing = Failing(second, after=3, error=StageFailed("b failed the step: out of memory"), then=replan)
    await pipeline.serve(1, plan(n), {"a": first, "b": failing})
    got, _ = await generate(pipeline)
    assert got == reference and len(asked) == 1 and "out of memory" in asked[0]


async def test_no_plan_in_time_is_no_capacity_saying_why(parts):
    engine, n, _ = parts
    head = engine(None, True, True)
    pipeline = Pipeline(lambda: head, wait_s=0.2)
    await pipeline.suspend("peers have room for 2 of 6 layers")
    with pytest.raises(NoCapacity, match="room for 2 of 6"):
        await generate(pipeline, 1)


class OneAtATime:
    """A stage as a peer runs it: one call at a time, each taking a while (``hold_s``);
    records when each call ran and which sessions it carried."""

    def __init__(self, inner: LocalRunner, name: str, calls: list, hold_s: float = 0.03):
        self.inner, self.name, self.calls, self.hold_s = inner, name, calls, hold_s
        self.lock = asyncio.Lock()

    async def forward_batch(self, term, segments, hidden):
        async with self.lock:
            began = asyncio.get_running_loop().time()
            await asyncio.sleep(self.hold_s)
            out = await self.inner.forward_batch(term, segments, hidden)
            self.calls.append((self.name, began, asyncio.get_running_loop().time(), len(segments)))
            return out

    async def drop(self, term, session):
        await self.inner.drop(term, session)


def burst(engine, n: int, seed: int, tokens: int) -> tuple[list[Session], list[list[int]]]:
    """Four new sessions of 70-token prompts (a wave of four groups over two stages), greedy
    for ``tokens``, and the tokens one engine of the whole model gives each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 100) for _ in range(70)] for _ in range(4)]
    whole = engine(Span(0, n), True, True)
    expected = [whole.run_sync(lambda p=p: generate_greedy(whole, p, tokens)) for p in prompts]
    sessions = [Session(f"s{i}", list(p), len(p), SamplingParams(temperature=0.0, max_tokens=tokens),
                        sampler=Sampler(SamplingParams(temperature=0.0))) for i, p in enumerate(prompts)]
    return sessions, expected


async def test_a_burst_of_new_prompts_goes_through_two_stages_as_a_wave(parts):
    """Streams arriving at once put their prompts in one step (the first-token lane's): over
    two stages it is cut into groups of sessions, the second stage working on one while the
    first runs the next (the burst's time to first token falls), and every session gets one
    engine's tokens."""
    engine, n, _ = parts
    sessions, expected = burst(engine, n, 7, 3)
    head = engine(None, True, True)
    pipeline = Pipeline(lambda: head)
    calls: list = []
    await pipeline.serve(1, plan(n), {"a": OneAtATime(LocalRunner(engine(Span(0, SPLIT))), "a", calls),
                                      "b": OneAtATime(LocalRunner(engine(Span(SPLIT, n))), "b", calls)})
    first = await pipeline.step(sessions, _pick)
    wave = list(calls)
    while any(len(s.generated) < 3 for s in sessions):
        for s in sessions:
            if (token := first.get(s.id)) is not None:
                s.tokens.append(token)
        if all(len(s.generated) >= 3 for s in sessions):
            break
        first = await pipeline.step(sessions, _pick)
    assert [s.generated for s in sessions] == expected
    a_calls = [c for c in wave if c[0] == "a"]
    b_calls = [c for c in wave if c[0] == "b"]
    assert len(a_calls) == len(b_calls) > 1, f"the burst went as one batch: {wave}"
    assert b_calls[0][1] < a_calls[-1][2], "the second stage waited for the first to finish every group"


async def test_a_wave_that_loses_a_peer_picks_each_session_once(parts):
    """A group that finished before a sibling lost its peer is replayed with the rest; its
    sessions' samplers must take their token once (a grammar's matcher would take it twice),
    and the tokens are one engine's."""
    engine, n, _ = parts
    sessions, expected = burst(engine, n, 11, 1)
    head = engine(None, True, True)
    pipeline = Pipeline(lambda: head, wait_s=10)
    first = LocalRunner(engine(Span(0, SPLIT)))

    def replan() -> None:
        asyncio.get_running_loop().create_task(
            pipeline.serve(2, plan(n, b="c"), {"a": first, "c": LocalRunner(engine(Span(SPLIT, n)))}))

    # The third group's call at stage b fails: the first two groups are through by then.
    lost = Failing(OneAtATime(LocalRunner(engine(Span(SPLIT, n))), "b", []), after=3,
                   error=PeerLost("b: socket closed"), then=replan)
    await pipeline.serve(1, plan(n), {"a": OneAtATime(first, "a", []), "b": lost})
    picks: dict[str, int] = {}

    def pick(s, logits):
        picks[s.id] = picks.get(s.id, 0) + 1
        return _pick(s, logits)

    got = await pipeline.step(sessions, pick)
    assert lost.calls == 3 and pipeline.plan.term == 2 and all(s.term == 2 for s in sessions)
    assert picks == {s.id: 1 for s in sessions}, f"a session was picked more than once: {picks}"
    assert [[got[s.id]] for s in sessions] == expected


def test_a_wave_has_no_group_under_the_minimum_chunk():
    """A long prompt's last chunk beside a few decode rows stays one batch (a group of five
    rows would pay a pass through every stage and a head call of its own); sixteen short
    prompts make groups of at least MIN_WAVE_CHUNK rows."""
    from meshd.serving.pipeline import MIN_WAVE_CHUNK, _waves
    rows = lambda groups: [sum(r for _, _, r in g) for g in groups]  # noqa: E731
    assert rows(_waves([(None, 0, n) for n in (250, 5, 5, 5, 5)], 2)) == [270]
    sizes = rows(_waves([(None, 0, 20) for _ in range(16)], 2))
    assert sum(sizes) == 320 and len(sizes) > 1 and min(sizes) >= MIN_WAVE_CHUNK
    assert rows(_waves([(None, 0, 20) for _ in range(16)], 1)) == [320]


async def test_prompt_logprobs_survive_a_stage_lost_mid_prompt(parts):
    """A prompt longer than a chunk, whose logprobs are asked for, goes over two stages as a
    pipelined prefill, the head scoring each chunk behind the last stage; the stage is lost
    when part of it is scored. The replay scores what is missing, and every prompt token's
    logprob is one whole engine's log-softmax of the prompt."""
    import torch

    engine, n, _ = parts
    prompt = [random.Random(5).randrange(3, 100) for _ in range(300)]
    whole = engine(Span(0, n), True, True)
    st = whole.stage
    want = whole.run_sync(lambda: torch.log_softmax(st.head(st(st.embed(torch.tensor(prompt)), 0, st.new_caches())), -1))
    head = engine(None, True, True)
    pipeline = Pipeline(lambda: head, wait_s=10)
    first = LocalRunner(engine(Span(0, SPLIT)))

    def replan() -> None:
        asyncio.get_running_loop().create_task(
            pipeline.serve(2, plan(n, b="c"), {"a": first, "c": LocalRunner(engine(Span(SPLIT, n)))}))

    lost = Failing(LocalRunner(engine(Span(SPLIT, n))), after=3, error=PeerLost("b: socket closed"), then=replan)
    await pipeline.serve(1, plan(n), {"a": first, "b": lost})
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    s = Session("s1", list(prompt), len(prompt), params, sampler=Sampler(params), prompt_scores={})
    token = (await pipeline.step([s], _pick))[s.id]
    assert token == int(want[-1].argmax()) and lost.calls == 3 and pipeline.plan.term == 2
    assert sorted(s.prompt_scores) == list(range(1, len(prompt)))
    got = torch.tensor([s.prompt_scores[p].logprob for p in range(1, len(prompt))])
    expect = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert float((got - expect).abs().max()) < 1e-4
    assert [t for t, _ in s.prompt_scores[7].top] == want[6].topk(2).indices.tolist()
