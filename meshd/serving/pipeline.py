"""Runs one step of a session through the active plan: embed, every span in
order (local call or a ForwardBatch over that peer's link), then the head.

A prompt longer than a chunk, over a plan of several stages, is prefilled as a
wavefront (``prefill``): chunk k+1 enters stage A as soon as chunk k has left it,
so the chunks of one prompt are in flight at several stages at once and time to
first token falls as stages are added. A replay after a peer loss is the same call.

The retry loop here is one of the three places errors are caught: a step that
loses a peer waits for the next plan and replays the session's history through
it, so the caller only ever sees the right next-token logits or NoCapacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import structlog
import torch

from meshd.control.runner import LocalRunner, StageRunner
from meshd.control.timing import SAMPLE, STEP_TIMES, StepTimes, Totals
from meshd.errors import NoCapacity, PeerLost, StageFailed, SupernodeChanged
from protocol.messages import Assignment, NodeId, Segment
from shards.engine import Score, StageEngine
from shards.sampling import prompt_scores

log = structlog.get_logger()

# Prompt rows a session sends per step: bounds frame size, and keeps a long
# prompt from stalling the streams decoding beside it (chunked prefill).
PREFILL_CHUNK = 256
# Prompt rows a step of the first-token lane takes while other streams decode on this
# stage: its steps before a prompt's last chunk then queue behind theirs (not urgent), so
# they get a step every chunk rather than wait for the whole prompt (a 1432-token prompt on
# one core held a running stream for 6.3 s); a chunk of 64 rows is about 0.3 s there.
SHARED_CHUNK = 64
# A pipelined prefill cuts a prompt into about this many chunks per stage, of at least
# MIN_WAVE_CHUNK rows: with C chunks over S stages it takes (C + S - 1) chunk-times of
# one stage instead of C * S.
WAVE_CHUNKS_PER_STAGE = 4
MIN_WAVE_CHUNK = 64
MAX_STEP_ATTEMPTS = 4  # re-plans one step may wait through before its sessions get a 503


# A scheduler Session (serving/scheduler.py, which imports this module): the pipeline reads
# its tokens, draft and cache position, and sets where its caches stand.
Session = Any


class Pick(Protocol):
    """A session's next token from its logits [V] (``scheduler._pick``); ``after``: the
    drafted tokens taken before this row in the same step."""

    def __call__(self, session: Session, logits: torch.Tensor, after: list[int] | None = None, /) -> int: ...


_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class ActivePlan:
    term: int
    assignments: tuple[Assignment, ...]
    # node id -> how to reach its span; the supernode's own span is a local runner.
    runners: Mapping[NodeId, StageRunner]


@dataclass(frozen=True, slots=True)
class _Ahead:
    """A session's next step through the first span, started while the later spans run this
    one (``Pipeline._look_ahead``): its rows from ``start`` and their output (``done``)."""

    term: int
    start: int
    tokens: list[int]
    done: asyncio.Future


class Pipeline:
    def __init__(self, head_engine_fn: Callable[[], StageEngine | None], wait_s: float = 30.0,
                 on_stage_failed: Callable[[str], None] | None = None, node: str = ""):
        self.on_stage_failed = on_stage_failed
        self.node = node  # this peer's id: its head work in a step's times
        self.totals = Totals()  # every timed step's parts, summed (live figures, /metrics)
        # A callable, because the supernode's engine is replaced when its own span changes.
        self._head_engine = head_engine_fn
        self._plan: ActivePlan | None = None
        self._changed = asyncio.Condition()
        self._wait_s = wait_s
        self._unavailable = "no plan is active yet"
        self._moved: str | None = None  # this peer yielded or stops: steps fail at once with it
        self.replays = 0
        # Called after every change of plan, in the order added (the scheduler's prefix cache,
        # the node's KV budget): each part that follows the plan subscribes, none replaces another.
        self.plan_listeners: list[Callable[[ActivePlan | None], None]] = []
        # The scheduler's guess of a session's next step's rows, were this step's draft all
        # taken and the token after it the one lookup expects ([]: no guess); None: no look-ahead.
        self.next_rows: Callable[[Session], list[int]] | None = None
        self._aheads: dict[str, _Ahead] = {}  # by session id
        self.ahead_started = 0  # look-ahead steps run, and those a next step used
        self.ahead_used = 0

    @property
    def plan(self) -> ActivePlan | None:
        return self._plan

    async def serve(self, term: int, assignments: Sequence[Assignment], runners: Mapping[NodeId, StageRunner]
                    ) -> None:
        """Steps run under this plan from now on (a step that failed under an older one retries here)."""
        await self._set(ActivePlan(term, tuple(assignments), runners))

    async def suspend(self, reason: str, moved: bool = False) -> None:
        """No plan: steps wait (bounded) for the next one, then fail with ``reason``;
        ``moved`` (another peer is supernode now, or this one stops): they fail at once
        with SupernodeChanged, so their requests go on at the next supernode."""
        await self._set(None, reason, moved)

    async def _set(self, plan: ActivePlan | None, reason: str = "", moved: bool = False) -> None:
        async with self._changed:
            self._plan = plan
            self._moved = reason if moved else None
            if plan is None:
                self._unavailable = reason or "the mesh has no active plan"
            self._changed.notify_all()
        for listener in self.plan_listeners:
            listener(plan)

    async def _wait_plan(self, newer_than: int | None, failed: str = "") -> ActivePlan:
        """The active plan, waiting (bounded) for one whose term is above ``newer_than``
        (``failed``: why the waiting step failed under that term, for the error if none comes)."""
        deadline = time.monotonic() + self._wait_s

        def ready() -> bool:
            return self._plan is not None and (newer_than is None or self._plan.term > newer_than)

        async with self._changed:
            while not ready():
                if self._moved is not None:
                    raise SupernodeChanged(self._moved)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoCapacity(self._why_waiting(newer_than, failed))
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    raise NoCapacity(self._why_waiting(newer_than, failed)) from None
            assert self._plan is not None
            return self._plan

    def _why_waiting(self, newer_than: int | None, failed: str) -> str:
        if self._plan is None or newer_than is None:
            return self._unavailable
        return (f"a step failed under plan term {newer_than} ({failed}) and no new plan came "
                f"within {self._wait_s:.0f} s")

    async def step(self, sessions: list, pick: Pick, times: StepTimes | None = None,
                   chunk: int = PREFILL_CHUNK) -> dict[str, int | list[int] | None]:
        """One forward of a batch through the plan: each session contributes the
        rows its stages have not cached yet (at most ``chunk`` of them). Returns
        per session its next token, ``pick(session, logits [V])`` (run on the engine's
        thread), or None while its prompt (or replay) still has rows to go. A session in
        decode with a ``draft`` (speculative decoding) sends a row per drafted token beside
        its own and gets a list: the tokens it picks row by row while they match the draft,
        then its own pick where one does not (``_verify``): what one row at a time gives. A lost peer makes the step wait for the next plan and
        replay every session of the batch from position 0. ``times`` (ended here) gets
        where the step's time went."""
        if times is None:
            return await self._step(sessions, pick, chunk)
        with self._timed(times):
            return await self._step(sessions, pick, chunk)

    @contextlib.contextmanager
    def _timed(self, times: StepTimes):
        """The runners' calls in this block add their share to ``times`` (``STEP_TIMES``)."""
        token = STEP_TIMES.set(times)
        try:
            yield
        finally:
            STEP_TIMES.reset(token)
            times.ended = time.monotonic()
            self.totals.add(times)

    async def _step(self, sessions: list, pick: Pick, chunk: int) -> dict[str, int | list[int] | None]:
        failed_term: int | None = None
        failed = ""  # why the step failed under failed_term
        attempts = 0
        while True:
            plan = await self._wait_plan(failed_term, failed)
            # The engine this step embeds with and samples from: a yield can swap the
            # peer's engine (a headless stage of the next supernode's plan) mid-step.
            engine = self._head_engine()
            work = []  # (session, start, rows)
            for s in sessions:
                start = s.cached if s.term == plan.term else 0
                if start == 0 and s.cached:
                    self.replays += 1
                    log.info("session_replay", session=s.id, term=plan.term, tokens=len(s.tokens))
                    s.cached = 0
                if start != len(s.tokens) - 1:
                    s.draft = []  # a draft rides only beside a decode row (not a prompt's or a replay's)
                work.append((s, start, min(len(s.tokens) + len(s.draft) - start, chunk)))
                # Never lowered: a replay from 0 on a kept cache keeps its memory (a new plan's
                # fresh caches hold less, which counts a little more than they hold at worst).
                s.kv_peak = max(s.kv_peak, start + work[-1][2])
            try:
                if engine is None:
                    raise PeerLost("this peer holds no head under the plan now")
                work = await self._prefill_long(plan, work)
                picked = await self._run_waves(plan, work, engine, pick)
            except PeerLost as exc:
                log.warning("step_peer_lost", term=plan.term, sessions=len(sessions), reason=str(exc))
                attempts += 1
                if attempts > MAX_STEP_ATTEMPTS:
                    raise NoCapacity(f"a step failed {attempts} times; last: {exc}") from None
                current = self._plan.term if self._plan is not None else None
                if isinstance(exc, StageFailed) and current == plan.term and self.on_stage_failed is not None:
                    # The link is up, so no loss will be seen: ask for a new plan. (A lost
                    # link's loss asks for it; asked here too, before the read loop sees the
                    # loss, it made two re-plans of one loss. A step of an older term
                    # failing is explained by the newer plan.)
                    self.on_stage_failed(str(exc))
                failed_term, failed = plan.term, str(exc)
                for s in sessions:
                    s.term = None
                continue
            out: dict[str, int | list[int] | None] = {s.id: None for s, _, _ in work}
            for s, start, rows in work:
                # A checked draft: the caches hold the decode row and the drafts taken; the
                # rows past them are cut away by the next step's (a stage truncates to its start).
                got = picked.get(s.id)
                s.cached, s.term = start + (len(got) if isinstance(got, list) else rows), plan.term
            out.update(picked)
            return out

    async def prefill(self, session, times: StepTimes | None = None) -> None:
        """Bring the session's stage caches up to all of its tokens but the last (whose
        logits a step computes), as a wavefront through the active plan; a no-op where
        that is at most one chunk or the plan has one stage. PeerLost leaves the session
        for a step to replay."""
        if times is None:
            return await self._prefill(session)
        with self._timed(times):
            return await self._prefill(session)

    async def _prefill(self, session) -> None:
        plan = self._plan
        if plan is None:
            return
        start = session.cached if session.term == plan.term else 0
        work = await self._prefill_long(plan, [(session, start, len(session.tokens) - start)])
        _, start, _ = work[0]
        session.cached, session.term = start, plan.term

    async def _prefill_long(self, plan: ActivePlan, work: list) -> list:
        """The sessions of ``work`` with more than a chunk left, prefilled up to their
        last token as wavefronts side by side; ``work`` with what they have left."""
        if len(plan.assignments) < 2:
            return work
        long = [(s, start) for s, start, _ in work if len(s.tokens) - start > PREFILL_CHUNK]
        if not long:
            return work
        await _together(self._wavefront(plan, s, start, len(s.tokens) - 1) for s, start in long)
        done = {s.id for s, _ in long}
        return [(s, len(s.tokens) - 1, 1) if s.id in done else (s, start, rows) for s, start, rows in work]

    async def _wavefront(self, plan: ActivePlan, s, start: int, end: int) -> None:
        """Positions start..end-1 of one session through every stage, chunk k+1 at a
        stage as soon as chunk k has left it (a stage sees one session's chunks in order)."""
        engine = self._head_engine()
        if engine is None:
            raise PeerLost("this peer holds no head under the plan now")
        runners = []
        for a in plan.assignments:
            if (runner := plan.runners.get(a.node)) is None:
                raise PeerLost(f"no link to {a.node}")
            runners.append(runner)
        # Enough chunks that the wavefront's fill and drain (one chunk per extra stage) is
        # a small part of it, none so small that per-call costs dominate.
        size = max(MIN_WAVE_CHUNK, min(PREFILL_CHUNK, -(-(end - start) // (WAVE_CHUNKS_PER_STAGE * len(runners)))))
        chunks = [(a, min(a + size, end)) for a in range(start, end, size)]
        left = [[asyncio.Event() for _ in runners] for _ in chunks]  # chunk i has left stage j

        async def chunk(i: int, a: int, b: int) -> None:
            hidden = await self._embed(engine, s.tokens[a:b])
            for j, runner in enumerate(runners):
                if i:
                    await left[i - 1][j].wait()
                hidden = await runner.forward_batch(plan.term, [Segment(s.kv, a, b - a)], hidden)
                left[i][j].set()
            if (score := _score([(s, a, b - a)])) is not None:  # its prompt logprobs, asked for
                began = time.monotonic()
                await engine.head_then(hidden, [], lambda lg: None, score)
                self._sampled(began)

        await _together(chunk(i, a, b) for i, (a, b) in enumerate(chunks))
        log.info("prefill_pipelined", session=s.id, tokens=end - start, chunks=len(chunks),
                 stages=len(runners))

    async def _run_waves(self, plan: ActivePlan, work: list, engine: StageEngine,
                         pick: Pick) -> dict[str, int | list[int]]:
        """The step's rows through the plan, and the head's pick for each session whose last
        token they hold. Many rows over several stages (a burst of new sessions' prompts in
        the first-token lane) go as a wave of session groups, group k+1 at stage A while
        group k is at stage B (``_waves``); each stage's engine takes them in order.

        A wave's groups bring back their logits, and every pick is made once all of them are
        through: a pick moves its session's sampler (a grammar's matcher takes the token), so
        a group that finished before a sibling lost a peer must not have picked, or the step's
        replay would pick for it twice."""

        def finishing(group: list) -> list[tuple[Session, int]]:
            # The sessions whose last token (and draft) this group runs, and the rows of them.
            done, rows_at = [], 0
            for s, start, rows in group:
                rows_at += rows
                if start + rows == len(s.tokens) + len(s.draft):
                    done.append((s, rows_at - 1 - len(s.draft)))
            return done

        def head_rows(done: list) -> list[int]:
            return [row + i for s, row in done for i in range(1 + len(s.draft))]

        def picks(done: list, logits: torch.Tensor) -> list:
            out, at = [], 0
            for s, _ in done:
                out.append(_verify(pick, s, logits[at:at + 1 + len(s.draft)]))
                at += 1 + len(s.draft)
            return out

        groups = _waves(work, len(plan.assignments))
        if len(groups) == 1:
            done = finishing(work)
            picked = await self._run(plan, work, engine, head_rows(done), lambda logits: picks(done, logits),
                                     _score(work))
            return {s.id: token for (s, _), token in zip(done, picked)}
        dones = [finishing(group) for group in groups]
        logits = await _together(self._run(plan, group, engine, head_rows(done), lambda lg: lg, _score(group))
                                 for group, done in zip(groups, dones))
        finished = [(done, rows) for done, rows in zip(dones, logits) if done]
        began = time.monotonic()
        picked = await engine.run(lambda: [token for done, rows in finished for token in picks(done, rows)])
        self._sampled(began)
        return {s.id: token for (s, _), token in zip((d for done, _ in finished for d in done), picked)}

    async def _run(self, plan: ActivePlan, work: list, engine: StageEngine, rows: list[int],
                   pick_rows: Callable[[torch.Tensor], _R], score: Score | None = None) -> _R | list[Any]:
        """The rows of ``work`` embedded and through every span in order, then the head on
        ``rows`` of the last span's output and ``pick_rows`` of their logits (none where
        ``rows`` is empty), and on ``score``'s rows (prompt logprobs) before them; ``[]`` where
        there are neither. Where the first or last span is the supernode's own, the embed
        or the head goes in the same engine call as that span (``LocalRunner.step``)."""
        tokens = [t for s, start, n in work for t in _rows_of(s, start, n)]
        segments = [Segment(s.kv, start, n) for s, start, n in work]
        runners = []
        for a in plan.assignments:
            if (runner := plan.runners.get(a.node)) is None:
                raise PeerLost(f"no link to {a.node}")
            runners.append(runner)
        # A look-ahead of this step's sessions ran first (its calls are before this step's on
        # the engine); a lone session's may be this very step's first span, already run.
        ready = None
        for s, _, _ in work:
            if (ahead := self._aheads.pop(s.id, None)) is not None:
                ran = await _outcome(ahead.done)
                if (len(work) == 1 and ran is not None and ahead.term == plan.term and ahead.start == work[0][1]
                        and tokens == ahead.tokens[:len(tokens)]):
                    ready = ran[:len(tokens)]
        hidden: torch.Tensor | None = None  # set at i == 0: embedded, or by the local step
        for i, runner in enumerate(runners):
            local = runner if isinstance(runner, LocalRunner) and runner.chains(engine) else None
            embeds = local is not None and i == 0
            heads = local is not None and i == len(runners) - 1 and bool(rows or score)
            if i == 0 and ready is not None and not heads:
                hidden = ready  # this span's rows, run ahead while the later spans ran the last step
                self.ahead_used += 1
                self._look_ahead(plan, engine, runner, work)
                continue
            if i == 0 and not embeds:
                hidden = await self._embed(engine, tokens)
            if local is not None and (embeds or heads):
                out = await local.step(plan.term, segments, tokens if embeds else None, None if embeds else hidden,
                                       rows if heads else None, pick_rows if heads else None,
                                       score if heads else None)
                if heads:
                    return out  # the head ran in that same call: a later change of plan cannot undo it
                hidden = out
            else:
                hidden = await runner.forward_batch(plan.term, segments, cast(torch.Tensor, hidden))
            if i == 0:
                self._look_ahead(plan, engine, runner, work)
        if self._head_engine() is not engine:
            raise PeerLost("the head changed during the step (the plan moved)")
        if not rows and score is None:
            return []
        began = time.monotonic()
        out = await engine.head_then(cast(torch.Tensor, hidden), rows, pick_rows, score)
        self._sampled(began)
        return out

    def _look_ahead(self, plan: ActivePlan, engine: StageEngine, first: StageRunner, work: list) -> None:
        """A lone session's decode step has left the first span, this peer's own (``first``):
        run that span now on the rows its next step will have if this one takes the whole
        draft and the model's own token after it is the one prompt lookup expects
        (``next_rows``), while the later spans run this step. One stream's step otherwise
        keeps one stage busy at a time. The next step uses the output where its rows are
        those (or the first of them), else it runs the span again: the rows past this step's
        are cut away as a draft's are, and a row's output does not depend on the rows run
        with it, so the tokens are the same either way."""
        if (self.next_rows is None or len(work) != 1 or len(plan.assignments) < 2
                or not isinstance(first, LocalRunner)):
            return
        s, start, n = work[0]
        if start + n != len(s.tokens) + len(s.draft) or not (rows := self.next_rows(s)):
            return  # not a decode row (and its draft): a prompt's chunk, a replay's
        at = start + n
        s.kv_peak = max(s.kv_peak, at + len(rows))  # its caches hold them until cut back
        done = asyncio.ensure_future(_ahead_step(engine, first, plan.term, Segment(s.kv, at, len(rows)), rows))
        done.add_done_callback(_retrieve)
        self._aheads[s.id] = _Ahead(plan.term, at, rows, done)
        self.ahead_started += 1

    async def _embed(self, engine: StageEngine, tokens: list[int]) -> torch.Tensor:
        began = time.monotonic()
        hidden = await engine.embed(tokens)
        self._sampled(began)
        return hidden

    def _sampled(self, began: float) -> None:
        """The supernode's own head work (embedding, head, picks) since ``began``, in the step's times."""
        if (times := STEP_TIMES.get()) is not None:
            times.add(SAMPLE, self.node, time.monotonic() - began)

    async def release(self, session) -> None:
        """Free the session's KV caches on every stage of the plan it ran under (after its
        look-ahead, whose engine call writes them)."""
        if (ahead := self._aheads.pop(session.id, None)) is not None:
            await _outcome(ahead.done)
        await self.drop([session.kv])

    async def drop(self, keys: list[str]) -> None:
        """Free these stage cache keys on every stage of the active plan."""
        plan = self._plan
        if plan is None or not keys:
            return
        for runner in plan.runners.values():
            for key in keys:
                try:
                    await runner.drop(plan.term, key)
                except PeerLost:
                    break  # its caches went with it


async def _ahead_step(engine: StageEngine, first: LocalRunner, term: int, segment: Segment,
                      tokens: list[int]) -> torch.Tensor:
    """``tokens`` embedded and through the first span, as ``Pipeline._run`` runs a step's."""
    STEP_TIMES.set(None)  # (this task's own context) not a part of the step that started it
    if first.chains(engine):
        return await first.step(term, [segment], tokens)
    return await first.forward_batch(term, [segment], await engine.embed(tokens))


async def _outcome(done: asyncio.Future) -> torch.Tensor | None:
    """A look-ahead's output once it has run; None where it failed (a plan that moved on)."""
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        raise
    except Exception:
        return None


def _retrieve(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()  # retrieved: a look-ahead that failed is only not used


def _rows_of(s, start: int, n: int) -> list[int]:
    """The tokens of a session's ``n`` rows from ``start``: its own, then its draft's."""
    return (s.tokens[start:start + n] + s.draft)[:n]


def _verify(pick: Callable, s, logits: torch.Tensor) -> int | list[int]:
    """A session's pick from its rows' logits [1 + len(draft), V] (on the engine's thread).
    Without a draft: its token. With one: row i's pick is made as one row at a time would
    make it (``pick(s, logits, after)``, ``after`` the drafts taken before it), and taken
    while it equals the drafted token; the list of picks ends with the first that does not
    (the model's own token there), or with the row after the last draft. A pick depends
    only on the logits, the tokens before it and the draw's (seed, position): so greedy and
    seeded requests give the same tokens with or without a draft, and sampled ones are
    distributed as without it (a drafted token is kept with its probability under the
    sampler: the rejection rule for a draft that is one token for sure)."""
    if not s.draft:
        return pick(s, logits[0])
    out: list[int] = []
    for i in range(len(s.draft) + 1):
        token = pick(s, logits[i], out)
        out.append(token)
        if i == len(s.draft) or token != s.draft[i]:
            break
    return out


def _score(work: list) -> Score | None:
    """The head's work for the prompt logprobs of the sessions of ``work`` (session, start,
    rows) that ask for them: each of their prompt rows not scored yet (a replay skips what
    an earlier pass scored) gives the log-probability of the prompt token after it."""
    items, at = [], 0  # (session, row in the step, position of the token it scores)
    for s, start, rows in work:
        scores = getattr(s, "prompt_scores", None)
        if scores is not None:
            items += [(s, at + p - start, p + 1) for p in range(start, min(start + rows, s.prompt_len - 1))
                      if p + 1 not in scores]
        at += rows
    if not items:
        return None

    def fn(i: int, logits: torch.Tensor) -> None:  # on the engine's thread
        part = items[i:i + logits.shape[0]]
        found = prompt_scores(logits, [s.tokens[pos] for s, _, pos in part],
                              [s.params.prompt_logprobs or 0 for s, _, _ in part])
        for (s, _, pos), entry in zip(part, found):
            s.prompt_scores[pos] = entry

    return Score([row for _, row, _ in items], fn)


def _waves(work: list, stages: int) -> list[list]:
    """``work`` (session, start, rows) cut into groups of whole sessions, in order, of about
    equal rows, for a wave through ``stages`` stages: at most WAVE_CHUNKS_PER_STAGE groups a
    stage, none under MIN_WAVE_CHUNK rows (a short last group joins the one before); one
    group where that leaves fewer than two."""
    total = sum(rows for _, _, rows in work)
    count = min(len(work), total // MIN_WAVE_CHUNK, WAVE_CHUNKS_PER_STAGE * stages) if stages > 1 else 1
    if count < 2:
        return [work]
    target = total / count  # at least MIN_WAVE_CHUNK: count <= total // MIN_WAVE_CHUNK
    groups: list[list] = [[]]
    rows_in = 0
    for item in work:
        if rows_in >= target:
            groups.append([])
            rows_in = 0
        groups[-1].append(item)
        rows_in += item[2]
    if len(groups) > 1 and rows_in < MIN_WAVE_CHUNK:
        last = groups.pop()
        groups[-1] += last
    return groups


async def _together(coros) -> list:
    """``coros`` run as sibling tasks, their results in order; where any fails, the others
    are cancelled and the error is the one a plain step would have raised (``_one``)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(coro) for coro in coros]
    except* Exception as group:
        raise _one(group) from None
    return [task.result() for task in tasks]


def _one(group: BaseExceptionGroup) -> BaseException:
    """The error a plain step would have raised: a peer loss if there was one (the retry
    loop replays on it), else the first."""
    lost = group.subgroup(PeerLost)
    error: BaseException = lost if lost is not None else group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
