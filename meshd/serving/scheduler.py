"""The supernode's scheduler: continuous batching through the pipeline.

Running sessions are spread over *lanes*. Each lane loops: one batched step
through the plan for all its sessions (a decode row each, or a prefill chunk
for a new one), sample, repeat; sessions join and leave at every step. With one
lane per stage, while stage B works on lane 1's batch stage A works on lane 2's
(micro-batches in flight), so no stage idles.

A session's token history (prompt + generated so far) lives here, not on the
stages, so after a peer is lost the pipeline replays it through the new owners
and decoding goes on with the same tokens (see ``Pipeline.step``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from enum import IntEnum
from typing import cast

import structlog
import torch

from meshd.control.timing import StepTimes, ms
from meshd.errors import KNOWN_ERRORS, NoCapacity, PeerLost, StageFailed
from meshd.serving.drafter import DraftModel
from meshd.serving.kvbudget import KVBudget, charge
from meshd.serving.lookup import MAX_DRAFT, MatchRates, PromptLookup, StepCost
from meshd.serving.output import Chunk, ChoiceOutput
from meshd.serving.pipeline import PREFILL_CHUNK, SHARED_CHUNK, Pipeline
from meshd.serving.prefix import PrefixCache
from meshd.serving.traces import Chain, Trace
from shards.engine import URGENT
from shards.errors import InvalidParams
from shards.grammar import Constraint
from shards.sampling import Sampler, SamplingParams, TokenLogprobs
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()

MAX_LANES = 4
MAX_BATCH = 64  # sessions per lane step

# Interactive requests keep priority over batch-job lines (meshd/serving/batch.py), which
# fill the room they leave:
# - while any interactive session runs, a lane step carries all its interactive sessions
#   but at most BATCH_BESIDE_INTERACTIVE batch ones (taken in turn, see ``pick_step``), so
#   an interactive stream's steps stay nearly as short as when it runs alone;
# - batch sessions reserve at most kvbudget.BATCH_KV_SHARE of the KV budget (beyond it they get a
#   503 and the batch runner retries), so room for interactive requests stays free.
# With no interactive session running, batch sessions fill whole steps (MAX_BATCH).
BATCH_BESIDE_INTERACTIVE = 4
# Speculation pays while a step's rows are few: beside a bigger batch the drafted rows cost
# what the running streams' own rows would (their tokens come one per step anyway).
SPECULATE_UP_TO = 4  # sessions in a step
DRAFT_MODEL_TOKENS = 4  # a draft model's guess per step at most (each costs it a forward)


class SessionState(IntEnum):
    """Where a session is in its life, in this order (a session may finish before anyone
    streams it: ADMITTED -> FINISHED).

    ADMITTED: its KV positions reserved, in a lane (or prefilling beside them).
    STREAMING: a consumer reads its chunks (``Scheduler.stream``).
    FINISHED: out of every lane; its queue has its end (or error). A step that holds it
      (``in_step``) still runs to its end.
    RELEASED: its stage caches given back (dropped, or kept as a cached prefix)."""

    ADMITTED = 0
    STREAMING = 1
    FINISHED = 2
    RELEASED = 3


class Priority(IntEnum):
    """A session's class; interactive (any client request) unless a batch job sent it."""

    INTERACTIVE = 0
    BATCH = 1


def new_session_id() -> str:
    return secrets.token_hex(8)


@dataclass(eq=False)
class Session:
    """One generation's state on the supernode."""

    id: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    # How many leading tokens of ``tokens`` the stages hold in their KV caches,
    # and under which plan term (another term means the caches may be gone).
    cached: int = 0
    term: int | None = None
    reserved: int = 0  # KV positions admitted for it (whole cache chunks: kvbudget.charge)
    kv_peak: int = 0  # the most positions its stage caches reached (they keep that memory when cut back)
    client: str | None = None  # who asked (an API key's hash, an address), for KV fairness
    request: object = None  # the request it is a choice of (a request's choices count as one)
    sampler: Sampler | None = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None (or an exception)
    state: SessionState = SessionState.ADMITTED
    # In a step now (in any state before RELEASED): its caches are freed only after the
    # step, or a Drop could reach a stage before that step's rows do.
    in_step: bool = False
    priority: Priority = Priority.INTERACTIVE
    # The key of its caches on the stages: its own id, or that of the finished
    # session whose cached prefix it took over.
    kv: str = ""
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # by position in ``generated``
    # The prompt's own logprobs, by position in ``tokens`` (1 .. prompt_len - 1), filled by
    # the pipeline's head as the prompt's rows pass; None where not asked for.
    prompt_scores: dict[int, TokenLogprobs] | None = None
    trace: Trace | None = None  # its request's timeline (serving/traces.py), on a request's first choice
    # Speculative decoding: where its drafts come from (None: it does not speculate), and
    # the tokens drafted for the next step, checked in it beside its decode row.
    lookup: PromptLookup | None = None
    draft: list[int] = field(default_factory=list)
    draft_by_model: bool = False  # the draft is the draft model's (not prompt lookup's)

    def __post_init__(self) -> None:
        self.kv = self.kv or self.id

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.state >= SessionState.FINISHED


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


def pick_step(sessions: list[Session], interactive_running: bool, max_batch: int = MAX_BATCH) -> list[Session]:
    """The sessions one lane step carries: interactive ones first, then batch ones up to
    ``max_batch`` in all, or only BATCH_BESIDE_INTERACTIVE of them while an interactive
    session runs anywhere (steps of other lanes share the stages' time)."""
    first = [s for s in sessions if s.priority is Priority.INTERACTIVE][:max_batch]
    room = max_batch - len(first)
    if interactive_running:
        room = min(room, BATCH_BESIDE_INTERACTIVE)
    return first + [s for s in sessions if s.priority is Priority.BATCH][:room]


def rotate_batch(sessions: list[Session], stepped: list[Session]) -> list[Session]:
    """The lane's sessions with the batch ones that just had a step moved to the back,
    so that when a step can carry only some batch sessions, each gets its turn."""
    moved = {id(s) for s in stepped if s.priority is Priority.BATCH}
    if not moved:
        return sessions
    return [s for s in sessions if id(s) not in moved] + [s for s in sessions if id(s) in moved]


class Lane:
    def __init__(self, index: int, first_tokens: bool = False, node: str = ""):
        self.index = index
        # The lane that gives new sessions their first token, in steps of their own, before
        # they join a decode lane (see Scheduler._enqueue).
        self.first_tokens = first_tokens
        self.sessions: list[Session] = []
        self.wake = asyncio.Event()
        self.steps = 0
        self.chain = Chain(node)  # its steps' running sums, for its sessions' timelines


class Scheduler:
    def __init__(self, pipeline: Pipeline, tokenizer: MeshTokenizer | None, kv_budget_tokens: int | None = None,
                 on_finished: Callable[[], None] | None = None, prefix_entries: int = 32, speculate: str = "auto"):
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.kv = KVBudget(kv_budget_tokens)  # running sessions' reservations, in the stages' chunks
        self.on_finished = on_finished  # after each generation ends (a drain waits for none to be left)
        self.active: dict[str, Session] = {}
        # The decode lanes, then the first-token lane (last: ``_enqueue`` slices the decode ones).
        self.lanes = ([Lane(i, node=pipeline.node) for i in range(MAX_LANES)]
                      + [Lane(MAX_LANES, first_tokens=True, node=pipeline.node)])
        self.interactive = 0  # interactive sessions admitted and not yet finished
        self.tokens_generated = 0
        self.shared_steps = 0  # steps that carried more than one session
        self.max_batch = 0
        self.prefix = PrefixCache(prefix_entries)  # finished sessions' caches, inside the KV budget
        self.speculate = speculate != "off"  # prompt lookup drafts for decoding sessions
        self.draft_always = speculate == "always"  # every match in full, whatever it costs
        self.step_cost = StepCost()  # what a step's decode row and its drafted rows cost here
        self.match_rates = MatchRates()  # how often lookup drafts are taken, by the suffix length they matched
        self.drafted = 0  # tokens drafted, taken, and the steps that checked a draft
        self.accepted = 0
        self.draft_steps = 0
        self.drafter: DraftModel | None = None  # --draft-model, once loaded on the supernode
        self.model_drafted = 0  # of ``drafted`` and ``accepted``, the draft model's
        self.model_accepted = 0
        self._background: set[asyncio.Task] = set()
        pipeline.plan_listeners.append(self._plan_changed)
        if self.speculate:
            pipeline.next_rows = self._next_rows

    @property
    def kv_budget_tokens(self) -> int | None:
        """The KV budget in positions (None: none)."""
        return self.kv.total

    @kv_budget_tokens.setter
    def kv_budget_tokens(self, total: int | None) -> None:
        self.kv.total = total

    @property
    def reserved_tokens(self) -> int:
        """KV positions running sessions hold (each whole cache chunks: ``kvbudget.charge``)."""
        return self.kv.reserved

    @property
    def reserved_by(self) -> dict[object, int]:
        return self.kv.by

    # -- the loops (owned by the node's TaskGroup) ------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for lane in self.lanes:
                tg.create_task(self._lane_loop(lane))

    async def _lane_loop(self, lane: Lane) -> None:
        while True:
            if not lane.sessions:
                lane.wake.clear()
                await lane.wake.wait()
                continue
            batch = pick_step(lane.sessions, self.interactive > 0)
            if len(batch) < len(lane.sessions):
                lane.sessions = rotate_batch(lane.sessions, batch)
            for s in batch:
                s.in_step = True
            timed = self._draft(batch)  # a lone decode row: its time teaches what a step costs
            if self.drafter is not None and not lane.first_tokens:  # (a first token waits for no draft)
                await self._draft_by_model(batch)
            times = StepTimes()  # where the step's time goes: its sessions' timelines, the live figures
            chunk = self._first_token_step(batch) if lane.first_tokens else PREFILL_CHUNK
            try:
                results = await self.pipeline.step(batch, _pick, times, chunk)
                if timed:
                    self.step_cost.ran(times.ended - times.began, len(batch[0].draft))
            except KNOWN_ERRORS as exc:  # NoCapacity: no plan came back in time
                results = {}
                for s in batch:
                    s.term = None  # what its stages hold is unknown now: not for the prefix cache
                    self._finish(s, exc)
            except Exception as exc:  # e.g. a stage's hidden state torch cannot use: these requests fail, the lane goes on
                log.exception("step_failed", sessions=len(batch))
                results = {}
                for s in batch:
                    self._finish(s, StageFailed(f"the step failed: {exc!r}"))
            finally:
                for s in batch:
                    s.in_step = False
                for s in batch:
                    if s.finished:
                        await self._release(s)
            lane.steps += 1
            lane.chain.link(times)
            if len(batch) > 1:
                self.shared_steps += 1
            self.max_batch = max(self.max_batch, len(batch))
            for s in batch:
                got = results.get(s.id)
                if s.trace is not None:
                    s.trace.stepped(times, got is not None)
                drafted, by_model, s.draft, s.draft_by_model = s.draft, s.draft_by_model, [], False
                guess = None
                if s.lookup is not None:
                    guess, s.lookup.guess = s.lookup.guess, None
                if got is None or s.finished:
                    continue
                if s.params.max_tokens == 0:  # only the prompt's logprobs were asked for: they are in
                    self._finish(s, None)
                    continue
                tokens = got if isinstance(got, list) else [got]
                if drafted and isinstance(got, list):
                    self._taken(s, len(drafted), len(got) - 1, by_model)
                elif guess is not None and s.lookup is not None:  # (a guess is its lookup's)
                    self.match_rates.held_back(s.lookup.sent, guess, tokens[0])
                for token in tokens:  # one, or a checked draft's: each as a step of its own would give it
                    if token in s.eos and not s.params.ignore_eos:
                        self._finish(s, None)
                        break
                    s.tokens.append(token)
                    self.tokens_generated += 1
                    s.out.put_nowait(token)
                    if len(s.generated) >= s.params.max_tokens:
                        self._finish(s, None)
                        break
                if not s.finished and lane.first_tokens:  # it has its first token: on to a decode lane
                    lane.sessions.remove(s)
                    self._enqueue_decode(s)

    def _first_token_step(self, batch: list[Session]) -> int:
        """How many prompt rows a session takes in this step of the first-token lane, and
        (this task's ``URGENT``) whether its engine calls go before the decode lanes' queued
        ones: they do where a session gets its first token from the step. While streams
        decode on a plan of one stage, a longer prompt goes SHARED_CHUNK rows a step, its
        steps before the last queued behind theirs, so that they go on between its chunks.
        (Over several stages a prompt past a chunk is prefilled beside the lanes, as a
        wavefront: a shorter one's step stays whole, one trip through the stages.)"""
        plan = self.pipeline.plan
        one_stage = plan is None or len(plan.assignments) == 1
        decoding = one_stage and any(lane.sessions for lane in self.lanes if not lane.first_tokens)
        chunk = SHARED_CHUNK if decoding else PREFILL_CHUNK
        left = [len(s.tokens) - (s.cached if plan is not None and s.term == plan.term else 0) for s in batch]
        URGENT.set(not decoding or any(n <= chunk for n in left))
        return chunk

    def _draft(self, batch: list[Session]) -> bool:
        """Prompt lookup drafts for the step's sessions that decode (one row to go), in a
        step small enough for them, each as long as pays best on this peer's measured step
        costs and the rate at which drafts matching as long a suffix were taken (none where
        that is too low: the first guessed token is still checked against what the step
        gives). True where the step is one session's decode row, whose time is then a step
        cost to learn from."""
        if not self.speculate or len(batch) > SPECULATE_UP_TO:
            return False
        decoding = self._decoding(batch)
        for s in decoding:
            if (look := s.lookup) is None:
                continue
            # Room: the draft's rows and the token after them within max_tokens (its KV share).
            room = min(MAX_DRAFT, s.params.max_tokens - len(s.generated) - 1)
            guess = _grammar_cut(s, look.draft(s.tokens, room))
            if not guess:
                continue
            rate = self.match_rates.rate(look.matched)
            k = len(guess) if self.draft_always else self.step_cost.best_draft(rate, len(guess))
            look.sent = look.matched
            if k:
                s.draft = guess[:k]
            else:
                look.guess = guess[0]
        return len(batch) == 1 and len(decoding) == 1

    def _next_rows(self, s: Session) -> list[int]:
        """The rows of the session's next step if this one takes its whole draft and the
        model's own token after it is the one prompt lookup expects: that token, then the
        draft ``_draft`` would take from lookup then, at most (it may take fewer: the first
        rows of these). [] where there is nothing to guess: no lookup, a grammar (its cut
        depends on the tokens taken), no match, or the answer ends at that token. Read by
        the pipeline to run its first span a step ahead (``Pipeline._look_ahead``)."""
        look = s.lookup
        if look is None or s.finished or (s.sampler is not None and s.sampler.mask is not None):
            return []
        generated = len(s.generated) + len(s.draft) + 1  # after this step, in the case guessed
        if generated >= s.params.max_tokens:
            return []
        tokens = s.tokens + s.draft
        first = look.peek(tokens, 1)
        if not first:
            return []
        then = look.peek(tokens + first, min(MAX_DRAFT, s.params.max_tokens - generated - 1))
        # As long as ``_draft`` will take, on the rate as it stands (one more: this step's
        # outcome moves it): rows past that are the first span's time, which the head of this
        # step waits behind (free text drafted 8 guessed rows to use none, 0.89x 2 peers' speed).
        rate = self.match_rates.rate(look.matched)  # (the match ``peek`` found for ``then``)
        k = len(then) if self.draft_always else self.step_cost.best_draft(rate, len(then))
        return first + then[:k + 1]

    async def _draft_by_model(self, batch: list[Session]) -> None:
        """Drafts of the draft model for the step's decoding sessions that prompt lookup left
        without one (in a step small enough for drafts), as long as pays (or in full with
        ``always``), cut to what a grammar allows. A draft model that fails is put aside:
        the step runs without its drafts, and later ones with lookup's alone."""
        drafter = self.drafter
        if drafter is None or len(batch) > SPECULATE_UP_TO:
            return
        for s in self._decoding(batch):
            if s.lookup is None or s.draft or drafter.warming(s.id):  # (its prompt still feeding: no wait)
                continue
            room = min(DRAFT_MODEL_TOKENS, s.params.max_tokens - len(s.generated) - 1)
            rate = drafter.acceptance.rate
            k = room if self.draft_always else self.step_cost.best_draft(rate, room, drafter.token_s)
            if k <= 0:
                continue
            if not drafter.ready(s.id):  # its first draft would pay: its tokens go in beside the lanes first
                self._spawn(self._warm_drafter(drafter, drafter.warm(s.id, s.tokens)))
                continue
            try:
                guess = await drafter.draft(s.id, s.tokens, k)
            except Exception as exc:  # its engine closed, or what no check foresaw: lookup goes on alone
                log.warning("draft_model_failed", model=drafter.name, error=str(exc))
                self.drop_drafter()
                return
            if guess := _grammar_cut(s, guess):
                s.draft, s.draft_by_model = guess, True

    def _decoding(self, batch: list[Session]) -> list[Session]:
        """The step's sessions with one row to go under the active plan: those a draft may ride beside."""
        plan = self.pipeline.plan
        return [s for s in batch if plan is not None and s.term == plan.term
                and s.cached == len(s.tokens) - 1 and not s.finished]

    def drop_drafter(self) -> None:
        """Put the draft model aside; its worker ends off the loop (it may be mid-draft)."""
        drafter, self.drafter = self.drafter, None
        if drafter is not None:
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(drafter.close))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _taken(self, s: Session, drafted: int, accepted: int, by_model: bool) -> None:
        if not by_model:  # prompt lookup's draft: the session has its lookup
            self.match_rates.taken(cast(PromptLookup, s.lookup).sent, drafted, accepted)
        elif self.drafter is not None:
            self.drafter.acceptance.taken(drafted, accepted)
        self.drafted += drafted
        self.accepted += accepted
        self.draft_steps += 1
        if by_model:
            self.model_drafted += drafted
            self.model_accepted += accepted

    def speculation(self) -> dict:
        """Drafted and taken tokens, and tokens per step that checked a draft (for /status and /metrics)."""
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.draft_steps,
                "draft_model": self.drafter.name if self.drafter is not None else None,
                "model_drafted": self.model_drafted, "model_accepted": self.model_accepted,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "tokens_per_step": round((self.accepted + self.draft_steps) / self.draft_steps, 3)
                if self.draft_steps else None,
                # What auto weighs a draft by, as learned here: a one-session step, and each drafted row more.
                "step_ms": ms(self.step_cost.plain), "draft_row_ms": ms(self.step_cost.row),
                # Next steps' first spans run ahead (a plan of several stages), and those used.
                "ahead": self.pipeline.ahead_started, "ahead_used": self.pipeline.ahead_used}

    def _lanes_in_use(self) -> int:
        """One lane per stage keeps every stage busy; one is enough for one stage."""
        plan = self.pipeline.plan
        stages = len(plan.assignments) if plan is not None else 1
        return max(1, min(MAX_LANES, stages))

    def _admit(self, session: Session) -> None:
        """Reserve the session's KV memory (prompt + max_tokens positions, in the whole
        cache chunks the stages allocate), taking over a cached prefix of its tokens if
        there is one, evicting cached prefixes the request needs room for; NoCapacity when
        running sessions alone leave too little."""
        need = charge(session.prompt_len + session.params.max_tokens)
        batch = session.priority is Priority.BATCH
        hit = None
        plan = self.pipeline.plan
        if plan is not None and self.prefix.enabled:
            self._drop_later(self.prefix.stale(plan.term))
            if session.prompt_scores is None:  # a cached prefix's rows would go unscored
                hit = self.prefix.find(session.tokens, plan.term)
        if hit is not None and self._refusal(session, max(need, hit.held)):
            hit = None  # its caches hold more than there is room for: the prefix is computed again instead
        if hit is not None:
            need = max(need, hit.held)  # its caches keep the entry's memory, used or not
        if (refused := self._refusal(session, need)) is not None:
            raise NoCapacity(refused)
        taken = hit.held if hit is not None else 0  # becomes the session's, inside ``need``
        evicted: list[str] = []
        while self.kv.over(need, self.prefix.held - taken):
            # Always a key: with every entry but ``hit`` gone the checks above leave room.
            if (gone := self.prefix.evict_one(keep=hit.key if hit is not None else None)) is None:
                break
            evicted.append(gone)
        self._drop_later(evicted)
        if hit is not None:
            assert plan is not None  # a hit is found only under a plan
            self.prefix.take(hit)
            session.kv, session.cached, session.term, session.kv_peak = hit.key, hit.reuse, plan.term, hit.held
            log.info("prefix_cache_hit", reused=hit.reuse, tokens=len(session.tokens))
        elif self.prefix.enabled:
            self.prefix.miss()
        session.reserved = need
        self.kv.reserve(need, session.client, session.request, batch)
        if not batch:
            self.interactive += 1
        self.active[session.id] = session
        if plan is not None and len(plan.assignments) > 1 and len(session.tokens) - session.cached > PREFILL_CHUNK:
            self._spawn(self._prefill_then_enqueue(session))
        else:
            self._enqueue(session)

    def _refusal(self, session: Session, need: int) -> str | None:
        """Why ``need`` more KV positions cannot be admitted for ``session`` (None: they can),
        with the prefix cache emptied if need be."""
        return self.kv.refusal(need, session.client, session.request, session.priority is Priority.BATCH)

    def _enqueue(self, session: Session) -> None:
        """A new session (or one whose long prompt was prefilled beside the lanes) gets its
        first token in the first-token lane, in a step without the running streams' decode
        rows: its step runs beside theirs (each stage interleaves the two), so the time to a
        first token under load is one short step behind the stage's current call, not a
        full decode step of every stream behind the current one (measured on one core, 16
        streams: 412 ms against 84 ms idle before). Alone, or a batch job's line (it has no
        one waiting on its first token), it joins a decode lane at once."""
        if (session.priority is Priority.INTERACTIVE and self.active.keys() - {session.id}
                and session.cached < len(session.tokens)):
            lane = self.lanes[-1]
            lane.sessions.append(session)
            lane.wake.set()
        else:
            self._enqueue_decode(session)

    def _enqueue_decode(self, session: Session) -> None:
        lane = min(self.lanes[: self._lanes_in_use()], key=lambda ln: len(ln.sessions))
        lane.sessions.append(session)
        lane.wake.set()

    async def _prefill_then_enqueue(self, session: Session) -> None:
        """A long prompt over several stages: its chunks in flight at every stage at once
        (``Pipeline.prefill``), beside the lanes' steps rather than in one (which would hold
        that lane's running streams for the whole prompt); then into a lane for its last
        token and the decode."""
        session.in_step = True
        times = StepTimes()
        try:
            await self.pipeline.prefill(session, times)
        except PeerLost:
            session.term = None  # a lane's step replays it under the next plan
        except KNOWN_ERRORS as exc:
            session.term = None
            self._finish(session, exc)
        finally:
            session.in_step = False
            if session.trace is not None:
                session.trace.stepped(times, False)
        if session.finished:
            await self._release(session)
        else:
            self._enqueue(session)

    async def _release(self, session: Session) -> None:
        """Free the session's stage caches once no step holds it: keep them as a cached
        prefix when they are whole under the active plan, else drop them."""
        if session.state is SessionState.RELEASED or session.in_step:
            return
        session.state = SessionState.RELEASED
        if self.drafter is not None:
            self.drafter.forget(session.id)
        plan = self.pipeline.plan
        if plan is not None and session.term == plan.term and session.cached > 0 and self.prefix.enabled:
            drop = self.prefix.stale(plan.term)
            drop += self.prefix.put(session.kv, session.tokens[:session.cached], plan.term, session.kv_peak)
        else:
            drop = [session.kv]
        await self.pipeline.drop(drop)

    def _plan_changed(self, plan) -> None:
        """A new term invalidates the cached prefixes (a kept engine forgets them itself too)."""
        self._drop_later(self.prefix.stale(plan.term if plan is not None else None))

    def _drop_later(self, keys: list[str]) -> None:
        """Drop stage caches from a synchronous path (admission) without waiting for it."""
        if keys:
            self._spawn(self.pipeline.drop(keys))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finish(self, session: Session, error: BaseException | None) -> None:
        """Take the session out of its lane; its generator sees the end (or the error)."""
        if session.finished:
            return
        session.state = SessionState.FINISHED
        for lane in self.lanes:
            if session in lane.sessions:
                lane.sessions.remove(session)
        session.out.put_nowait(error)

    # -- one client's generation --------------------------------------------------------

    def open(self, prompt_ids: list[int], params: SamplingParams, history: list[int] | None = None,
             priority: Priority = Priority.INTERACTIVE, client: str | None = None, request: object = None,
             trace: Trace | None = None) -> Session:
        """Admit one generation (NoCapacity when the KV budget is full, before any answer
        went out); ``history`` resumes one whose first tokens were already produced (a
        resubmission after a supernode loss). Stream it with ``stream``, or ``close`` it.
        ``trace`` (a ``traces.Trace``) gets the steps that carry it."""
        assert self.tokenizer is not None, "the scheduler serves only once a model is loaded"
        mask = None
        if params.grammar is not None:
            mask = Constraint(self.tokenizer, params.grammar)
            mask.replay(history or ())
        session = Session(new_session_id(), list(prompt_ids) + list(history or ()), len(prompt_ids), params,
                          self.tokenizer.eos_ids, sampler=Sampler(params, mask, self.tokenizer.eos_ids),
                          priority=priority,
                          # batch lines have a share of their own (kvbudget.BATCH_KV_SHARE), not a client's
                          client=client if priority is Priority.INTERACTIVE else None,
                          request=request if request is not None else object(), trace=trace,
                          prompt_scores={} if params.prompt_logprobs is not None else None,
                          # A grammar's matcher takes each pick in turn: the picks of a checked draft
                          # are the tokens kept, so it never needs to take one back.
                          lookup=PromptLookup() if self.speculate else None)
        self._admit(session)
        return session

    async def _warm_drafter(self, drafter: DraftModel, warming: Coroutine[None, None, None]) -> None:
        """The draft model takes a session's tokens beside the lanes (``DraftModel.warm``);
        one that fails is put aside, as a failed draft's is."""
        try:
            await warming
        except Exception as exc:  # its engine closed, or what no check foresaw: lookup goes on alone
            log.warning("draft_model_failed", model=drafter.name, error=str(exc))
            if self.drafter is drafter:
                self.drop_drafter()

    async def close(self, session: Session) -> None:
        """Give back a session that was opened but never streamed (one that streams ends
        itself: ``stream`` gives it back however it ends)."""
        if session.state is not SessionState.STREAMING:
            self._finish(session, None)
            self._forget(session)
            await self._release(session)

    def _forget(self, session: Session) -> None:
        """Give its KV reservation back (once)."""
        if self.active.pop(session.id, None) is None:
            return
        batch = session.priority is Priority.BATCH
        if not batch:
            self.interactive -= 1
        self.kv.release(session.reserved, session.client, session.request, batch)
        if self.on_finished is not None:
            self.on_finished()

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        usage: Usage | None = None,
        history: list[int] | None = None,
        priority: Priority = Priority.INTERACTIVE,
        client: str | None = None,
        request: object = None,
    ) -> AsyncIterator[Chunk]:
        """Stream chunks for one choice (``open`` then ``stream``)."""
        session = self.open(prompt_ids, params, history, priority, client, request)
        async for chunk in self.stream(session, usage):
            yield chunk

    async def stream(self, session: Session, usage: Usage | None = None) -> AsyncGenerator[Chunk, None]:
        """The chunks of an opened session (``output.ChoiceOutput`` makes them of its tokens);
        it is given back when this ends, however it ends."""
        assert self.tokenizer is not None
        if session.state is SessionState.ADMITTED:
            session.state = SessionState.STREAMING
        params = session.params
        output = ChoiceOutput(self.tokenizer, params, session.generated)
        structlog.contextvars.bind_contextvars(session=session.id)
        log.info("session_started", prompt_tokens=session.prompt_len, max_tokens=params.max_tokens,
                 resumed=len(session.generated), priority=session.priority.name.lower())
        t0 = time.monotonic()
        finish = None  # stays None to the end when the answer is cut (an error, a shutdown, a client gone)
        try:
            if len(session.generated) >= params.max_tokens and session.prompt_scores is None:
                self._finish(session, None)
            while output.finish is None:
                item = await session.out.get()
                if session.prompt_scores:
                    output.prompt_logprobs = _prompt_scores(session)
                if item is None:
                    # The lane ended it: EOS, or max_tokens reached (or its grammar hit a limit).
                    sampler = cast(Sampler, session.sampler)  # ``open`` gives every session one
                    if (why := getattr(sampler.mask, "error", None)) is not None:
                        raise InvalidParams(f"response_format: the grammar hit a limit mid-answer: {why}",
                                            param="response_format")
                    break
                if isinstance(item, BaseException):
                    raise item
                if (chunk := output.push(item, session.logprobs.pop(output.delivered, None))) is not None:
                    yield chunk
            finish = output.finish or ("stop" if output.delivered < params.max_tokens else "length")
            yield output.end(finish)
        finally:
            self._finish(session, None)
            self._forget(session)
            if usage is not None:
                usage.prompt_tokens += session.prompt_len
                usage.completion_tokens += output.delivered
            await self._release(session)
            log.info("session_finished", tokens=output.delivered, finish=finish or "cut",
                     seconds=round(time.monotonic() - t0, 3))
            structlog.contextvars.unbind_contextvars("session")


def _prompt_scores(session: Session) -> tuple[TokenLogprobs, ...]:
    """The prompt's logprobs, once (they go with the first chunk): the pipeline scored every
    prompt row before the step that gave the first token (or, for max_tokens 0, ended it)."""
    scores, session.prompt_scores = session.prompt_scores, None
    if not scores:
        return ()
    return tuple(scores[p] for p in range(1, session.prompt_len))


def _grammar_cut(session: Session, guess: list[int]) -> list[int]:
    """A draft cut before the first token the session's grammar would refuse (none: whole)."""
    mask = session.sampler.mask if session.sampler is not None else None
    return guess[:mask.allows(guess)] if guess and mask is not None else guess


def _pick(session: Session, logits: torch.Tensor, after: list[int] | None = None) -> int:
    """The session's next token from its logits (on the engine's thread): bias, penalties
    and grammar mask applied, its log-probabilities kept where asked for. ``after``: the
    drafted tokens taken before this row in the same step (as if they were generated)."""
    # ``open`` gives every session a sampler (the hot path: a cast, not a check)
    sampler, at = cast(Sampler, session.sampler), len(session.generated) + len(after or ())
    history = session.tokens + after if after else session.tokens
    token = sampler.next(logits, at, history, session.prompt_len)
    if sampler.last is not None:
        session.logprobs[at] = sampler.last
    return token


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV cache bytes one position costs across every layer of the model."""
    return config.n_layers * 2 * config.n_kv_heads * config.head_dim * torch.empty(0, dtype=dtype).element_size()
