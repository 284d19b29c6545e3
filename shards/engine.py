"""StageEngine: a loaded Stage, its per-session KV caches, and the one thread that touches them.

Every torch call runs on the engine's single worker thread under ``torch.inference_mode``;
the async methods hand work to it, so the event loop never blocks on a forward.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import structlog
import torch
from torch import Tensor

from shards import rowops
from shards.errors import CacheMissing, KVFull, ModelError
from shards.config import ModelConfig
from shards.manifest import Manifest
from shards.layers import Block, Caches, KVCache, rope_tables
from shards.model import Stage, load_stage
from shards.span import Span

log = structlog.get_logger()
R = TypeVar("R")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str = "auto") -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # CPUs here have no bf16 hardware and fp32 prefills fastest; GPUs want half width.
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


# Set (in a task) for engine calls that should not queue behind others': the step that
# gives a new session its first token. Calls run one at a time; an urgent one queued while
# another runs goes in between that one's layers (``_Worker.run_urgent``).
# Rows the head scores at once (prompt logprobs): the logits of a step's prompt rows are
# never all in memory together, HEAD_ROWS x vocab floats at most (12.6 MB for a 49k vocab).
HEAD_ROWS = 64


@dataclass(frozen=True, slots=True)
class Score:
    """Rows of a step whose logits are wanted whole, not just picked from (a prompt's rows
    for its logprobs): ``fn(i, logits)`` gets ``rows[i:i + n]``'s logits [n, V], n <= HEAD_ROWS,
    on the engine's thread."""

    rows: list[int]
    fn: Callable[[int, Tensor], None]


URGENT: contextvars.ContextVar[bool] = contextvars.ContextVar("meshd_engine_urgent", default=False)


class _Busy(Exception):
    """An urgent call reached sessions that the call it was run inside is forwarding: it
    goes back on the queue, to run whole after that one."""


class _Worker:
    """The engine's one thread: calls run one at a time, urgent ones first, each kind in the
    order it came. torch's thread count is per OS thread (OpenMP): it takes ``threads``.

    A decode step hands work to this thread and back several times, on the same core as
    the event loop, so a hand-off is kept short: a heap under a lock plus a C
    ``SimpleQueue`` that only counts calls (not ``queue.PriorityQueue``'s Python
    condition), and an asyncio caller's future settled by one ``call_soon_threadsafe``
    (not a concurrent Future chained through ``asyncio.wrap_future``)."""

    def __init__(self, threads: int):
        self._heap: list[tuple[int, int, Callable[[], object], Callable[[bool, object], None], Callable[[], bool]]] = []
        self._lock = threading.Lock()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # one item per call in the heap
        self._seq = itertools.count()
        self._running_urgent = False  # (this thread's) the call running is urgent, or runs inside one
        self._held_back = False  # (this thread's) an urgent call met the running call's sessions
        self.urgent_seconds = 0.0  # (this thread's) time spent in urgent calls run inside others
        self._thread = threading.Thread(target=self._loop, args=(threads,), name="meshd-engine", daemon=True)
        self._thread.start()

    def _put(self, urgent: bool, fn: Callable[[], object], settle: Callable[[bool, object], None],
             cancelled: Callable[[], bool], last: bool = False) -> None:
        with self._lock:
            heapq.heappush(self._heap, (2 if last else 0 if urgent else 1, next(self._seq), fn, settle, cancelled))
        self._ready.put(None)

    def submit(self, fn: Callable[[], R], urgent: bool = False) -> Future:
        future: Future = Future()

        def settle(ok: bool, value: object) -> None:
            future.set_result(value) if ok else future.set_exception(value)  # type: ignore[arg-type]

        self._put(urgent, fn, settle, lambda: not future.set_running_or_notify_cancel())
        return future

    def call(self, fn: Callable[[], R], urgent: bool = False) -> asyncio.Future:
        """``fn()`` on this thread, as an asyncio future of the calling loop; a call whose
        caller was cancelled before it started does not run."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(ok: bool, value: object) -> None:  # on the loop
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)  # type: ignore[arg-type]

        def wake(ok: bool, value: object) -> None:  # on this thread
            try:
                loop.call_soon_threadsafe(done, ok, value)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass

        self._put(urgent, fn, wake, future.cancelled)
        return future

    def shutdown(self) -> None:
        """After every call already queued (as ``ThreadPoolExecutor.shutdown(wait=True)``)."""
        self._put(False, lambda: None, lambda ok, value: None, lambda: False, last=True)
        self._thread.join()

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while True:
            self._ready.get()
            with self._lock:
                item = heapq.heappop(self._heap)
            if item[0] == 2:
                return
            self._running_urgent, self._held_back = item[0] == 0, False
            try:
                self._execute(item)
            finally:
                self._running_urgent = False

    def _execute(self, item: tuple) -> bool:
        """Run one popped call and settle its caller; False where it met a busy session
        (``_Busy``) and went back on the queue instead."""
        _, _, fn, settle, cancelled = item
        if cancelled():
            return True  # its caller was cancelled while it waited
        try:
            value = fn()
        except _Busy:
            with self._lock:
                heapq.heappush(self._heap, item)  # its own place: first of the urgent ones again
            self._ready.put(None)
            return False
        except BaseException as exc:  # handed to the caller, as an executor would
            settle(False, exc)
        else:
            settle(True, value)
        return True

    def run_urgent(self) -> None:
        """On this thread, between two layers of a call that is not urgent: run the urgent
        calls queued now, there and then. A new session's first-token step so waits for one
        layer of a running batch step, not for the whole step (with 16 streams on one CPU
        peer that step is ~0.1 s, and time to first token under load was about twice idle).
        Their sessions are not the running call's (it is a decode lane's; they are the
        first-token lane's), which ``_Busy`` checks; what they compute is what they would
        compute after it, the bits included."""
        if self._running_urgent or self._held_back:
            return
        began = time.perf_counter()
        self._running_urgent = True
        try:
            while True:
                with self._lock:
                    if not self._heap or self._heap[0][0] != 0:
                        break
                    item = heapq.heappop(self._heap)
                self._ready.get()  # its count (put just after the push)
                if not self._execute(item):
                    self._held_back = True  # not again inside this call
                    break
        finally:
            self._running_urgent = False
            self.urgent_seconds += time.perf_counter() - began


def default_threads() -> int:
    """An engine's torch threads where its creator names none: what torch reports on the
    calling thread (all cores unless something set a count). A daemon names its own
    (``Node.threads``, from ``Config.threads``).

    Only engine workers and short-lived threads (``apart``) should run torch's parallel
    regions in a daemon: libgomp keeps a pool of threads for every thread that has run a
    parallel region, for as long as that thread lives; once its pools hold more threads than
    there are cores it stops spinning between regions and wakes its workers by futex each
    time, hundreds of times a decode step. Measured (SmolLM2 Q4_1, 2 threads on 2 cores):
    67-72 tok/s while one thread ran torch, 27-35 once a second thread had too, and the
    first did not recover. So the daemon's own thread keeps one (``cmd_run``)."""
    return torch.get_num_threads()


def apart(fn: Callable[[], R], threads: int) -> R:
    """``fn()`` on a worker of its own with ``threads`` (the engines' count), waited for: torch
    work off the engines (start-up probes) whose OpenMP pool ends with that worker's thread."""
    worker = _Worker(threads)
    try:
        return worker.submit(fn).result()
    finally:
        worker.shutdown()


class StageEngine:
    def __init__(self, stage: Stage, manifest: Manifest, worker: _Worker | None = None):
        self.stage = stage
        self.manifest = manifest
        self.config: ModelConfig = manifest.config
        self.span = stage.span
        self.device = stage.device
        self.dtype = stage.dtype
        self._caches: dict[str, Caches] = {}
        # torch's thread count is per OS thread (OpenMP): see default_threads.
        self._pool = worker or _Worker(default_threads())
        self._closed = False
        self._forwarding: frozenset[str] = frozenset()  # (worker's) sessions of the forward running
        self.epoch = 0  # drop_all calls so far
        # The most positions this stage's caches may hold (whole chunks, every session's,
        # cached prefixes too): a step that would grow them past it is refused (KVFull)
        # before any cache changes. None: no limit (set by whoever knows the peer's memory).
        self.kv_limit: int | None = None

    @classmethod
    def load(cls, model_dir: Path, span: Span | None, embed: bool, head: bool,
             device: str = "auto", dtype: str | torch.dtype = "auto", verify: bool = True,
             threads: int | None = None, kernels: rowops.Kernels = rowops.Kernels.WHOLE_BLOCK) -> StageEngine:
        """``threads``: its worker's torch threads (default: ``default_threads()``);
        ``kernels``: which code runs its blocks on the CPU (``load_stage``)."""
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        t0 = time.perf_counter()
        # Loaded (packed, probed) on the engine's own worker, the one thread that runs it after.
        worker = _Worker(threads or default_threads())
        try:
            stage, manifest = worker.submit(lambda: load_stage(model_dir, span, embed, head, dev, dt,
                                                               verify=verify, kernels=kernels)).result()
        except BaseException:
            worker.shutdown()
            raise
        log.info("stage_loaded", model=manifest.name, span=str(span) if span else None, embed=embed,
                 head=head, device=str(dev), dtype=str(dt).removeprefix("torch."),
                 seconds=round(time.perf_counter() - t0, 2))
        return cls(stage, manifest, worker)

    # -- the worker thread ----------------------------------------------------------

    def _call(self, fn: Callable[[], R]) -> R:
        with torch.inference_mode():
            return fn()

    async def _run(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` on the worker thread. Every torch op of a daemon belongs there:
        ops on the event loop's thread start a second OpenMP team that spins against
        the worker's and (measured, 2 cores) makes each batched step 2-3x slower."""
        if self.closed:  # a newer plan replaced this engine while a call was on its way here
            raise ModelError("this stage's engine was closed: its plan was replaced")
        return await self._pool.call(lambda: self._call(fn), URGENT.get())

    async def run(self, fn: Callable[[], R]) -> R:
        """``fn()`` on the worker thread, beside this engine's torch work (the pipeline's
        picks of a wave's sessions: sampling is torch work too)."""
        return await self._run(fn)

    def run_sync(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` on the worker thread and wait (for tests, bench and start-up)."""
        return self._pool.submit(lambda: self._call(fn)).result()

    # -- what runs there -------------------------------------------------------------

    def _embed(self, tokens: Sequence[int]) -> Tensor:
        tokens = list(tokens)
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad or not tokens:
            raise ModelError(f"token ids {bad[:5] or tokens} outside the vocabulary of {self.config.vocab_size}")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.stage.embed(ids)

    def _forward(self, session: str, start: int, hidden: Tensor) -> Tensor:
        return self._forward_batch([(session, start, hidden.shape[0] if hidden.dim() == 2 else 0)], hidden)

    def _forward_batch(self, segments: Sequence[tuple[str, int, int]], hidden: Tensor) -> Tensor:
        """Every session's rows in one forward: ``segments`` are (session, start, rows)
        in the row order of ``hidden`` [N, H]."""
        sessions = {session for session, _, _ in segments}
        if self._forwarding & sessions:
            raise _Busy  # (an urgent call run between the layers of a forward of its sessions)
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ModelError(f"hidden has shape {tuple(hidden.shape)}, want [T, {self.config.hidden_size}]")
        if not hidden.is_floating_point():
            raise ModelError(f"hidden has dtype {hidden.dtype}, want a floating-point one")
        if sum(rows for _, _, rows in segments) != hidden.shape[0]:
            raise ModelError(f"segments name {sum(r for _, _, r in segments)} rows, hidden has {hidden.shape[0]}")
        if len(sessions) != len(segments):
            raise ModelError("a session appears twice in one batch")
        if self.span is None:
            return hidden
        batch = []
        for session, start, rows in segments:
            caches = self._caches.get(session)
            if caches is None:
                if start != 0:
                    raise CacheMissing(f"session {session} has no cache here; replay from 0, not {start}")
                caches = self.stage.new_caches()
            cached = next(iter(caches.values())).length
            if start > cached:
                raise ModelError(f"session {session} has {cached} cached positions, cannot start at {start}")
            if start + rows > self.config.max_position:
                raise ModelError(f"positions up to {start + rows} exceed max {self.config.max_position}")
            batch.append((session, start, rows, caches))
        if self.kv_limit is not None:
            self._check_room(batch)
        # Checked every segment before touching any cache: a bad batch changes nothing.
        for session, start, _, caches in batch:
            self._caches[session] = caches
            for cache in caches.values():  # a replay or rewind: cut back, then append
                cache.truncate(start)
        work = [(start, rows, caches) for _, start, rows, caches in batch]
        if self._forwarding:  # run between the layers of another forward: not again inside this one
            return self.stage.forward_batch(hidden, work)
        self._forwarding = frozenset(sessions)
        try:
            return self.stage.forward_batch(hidden, work, between=self._pool.run_urgent)
        finally:
            self._forwarding = frozenset()

    def _head(self, hidden: Tensor) -> Tensor:
        return self.stage.head(hidden)

    def _heads(self, x: Tensor, rows: list[int], fn: Callable[[Tensor], R], score: Score | None) -> R:
        """``score``'s rows through the head a slice at a time, then ``fn`` of ``rows``' logits."""
        if score is not None:
            for i in range(0, len(score.rows), HEAD_ROWS):
                score.fn(i, self._head(x[score.rows[i:i + HEAD_ROWS]]))
        if not rows:
            return fn(torch.empty(0, self.config.vocab_size))
        return fn(self._head(x[rows]))

    # -- the async interface --------------------------------------------------------
    # Results come back on the CPU, ready to pack into a frame or sample from; inputs may
    # live anywhere and are moved to the engine's device.

    async def embed(self, tokens: Sequence[int]) -> Tensor:  # -> [T, H]
        return await self._run(lambda: self._embed(tokens).cpu())

    async def forward(self, session: str, start: int, hidden: Tensor) -> Tensor:  # [T, H] -> [T, H]
        return await self._run(lambda: self._forward(session, start, hidden).cpu())

    async def forward_batch(self, segments: Sequence[tuple[str, int, int]], hidden: Tensor) -> Tensor:
        # [N, H] -> [N, H]; moved to the engine's device and dtype there, not on the event loop
        return (await self.forward_timed(segments, hidden))[0]

    async def forward_timed(self, segments: Sequence[tuple[str, int, int]], hidden: Tensor) -> tuple[Tensor, float]:
        """``forward_batch``, and the seconds of its own forward: not the wait in the queue,
        nor urgent calls run between its layers (as ``step`` counts them)."""
        def timed() -> tuple[Tensor, float]:
            x, seconds = self._timed(segments, hidden.to(self.device, self.dtype))
            return x.cpu(), seconds

        return await self._run(timed)

    def _timed(self, segments: Sequence[tuple[str, int, int]], x: Tensor) -> tuple[Tensor, float]:
        began, others = time.monotonic(), self._pool.urgent_seconds
        x = self._forward_batch(segments, x)
        _sync(self.device)  # a GPU's kernels run after their launch: the time is theirs, not the launch's
        return x, time.monotonic() - began - (self._pool.urgent_seconds - others)

    async def head(self, hidden: Tensor) -> Tensor:  # [T, H] -> [T, V] float32
        return await self._run(lambda: self._head(hidden).cpu())

    async def head_then(self, hidden: Tensor, rows: list[int], fn: Callable[[Tensor], R],
                        score: Score | None = None) -> R:
        """The head on ``hidden[rows]``, and ``fn`` of those logits [len(rows), V],
        both on the worker thread (sampling is torch work too); ``score``'s rows first."""
        return await self._run(lambda: self._heads(hidden, rows, fn, score))

    async def step(self, segments: Sequence[tuple[str, int, int]], tokens: Sequence[int] | None = None,
                   hidden: Tensor | None = None, rows: list[int] | None = None,
                   fn: Callable[[Tensor], R] | None = None, score: Score | None = None
                   ) -> tuple[Tensor | R, float]:
        """The supernode's own span in one call on the worker thread: ``tokens`` embedded
        (else ``hidden`` as it came), through the span, then, where ``rows`` are given, the
        head on those rows and ``fn`` of their logits (as ``head_then``). Returns that, or
        the span's output, and the seconds of the span's forward. One hand-off instead of
        up to three (embed, span, head): each costs the event loop and this thread a wake-up
        on the same core."""
        if tokens is None and hidden is None:
            raise ModelError("a step needs tokens to embed or a hidden state")

        def chain() -> tuple[Tensor | R, float]:
            # (hidden is there where tokens are not: checked above)
            x = self._embed(tokens) if tokens is not None else cast(Tensor, hidden).to(self.device, self.dtype)
            x, seconds = self._timed(segments, x)
            if rows is None or fn is None:
                return x.cpu(), seconds
            return self._heads(x, rows, fn, score), seconds

        return await self._run(chain)

    def cached_length(self, session: str) -> int:
        caches = self._caches.get(session)
        return next(iter(caches.values())).length if caches else 0

    def kv_bytes_per_position(self) -> int:
        """What one position of one session costs in this stage's caches (its span's layers)."""
        layers = len(self.span) if self.span is not None else 0
        element = torch.empty(0, dtype=self.dtype).element_size()
        return layers * 2 * self.config.n_kv_heads * self.config.head_dim * element

    def _check_room(self, batch: list) -> None:
        """KVFull when the step's caches would grow past ``kv_limit`` (a cache grows a chunk
        at a time and keeps its chunks when cut back)."""
        assert self.kv_limit is not None
        grow = 0
        for session, start, rows, caches in batch:
            held = next(iter(caches.values())).capacity if caches else 0
            grow += max(0, KVCache.room_for(start + rows) - held)
        if grow and (total := self.held_positions() + grow) > self.kv_limit:
            raise KVFull(f"this stage's KV caches would hold {total} positions, past its limit of {self.kv_limit} "
                         f"({len(self._caches)} sessions' caches here already)")

    def held_positions(self) -> int:
        """Positions of memory every session's caches hold (a cache grows in chunks and
        keeps them when cut back): what the supernode's KV budget counts."""
        return sum(next(iter(c.values())).capacity for c in list(self._caches.values()) if c)

    def drop(self, session: str) -> None:
        # Dict pop is atomic; the worker only reads the entry inside a call it already holds.
        self._caches.pop(session, None)

    def drop_all(self) -> None:
        """Forget every session's caches (atomic, as ``drop``): an engine kept for a new
        plan. ``epoch`` counts these, so that a call queued before one can tell."""
        self.epoch += 1
        self._caches.clear()

    @property
    def sessions(self) -> int:
        return len(self._caches)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown()
        self._caches.clear()


def generate_greedy(parts: StageEngine | Stage | Sequence[StageEngine | Stage],
                    token_ids: Sequence[int], n: int) -> list[int]:
    """Greedy-decode ``n`` tokens through stages in order (first embeds, last has the head)."""
    chain = [parts] if isinstance(parts, (StageEngine, Stage)) else list(parts)
    stages = [p.stage if isinstance(p, StageEngine) else p for p in chain]
    caches = [s.new_caches() for s in stages]

    def step(tokens: list[int], start: int) -> int:
        x = stages[0].embed(torch.tensor(tokens, dtype=torch.long, device=stages[0].device))
        for s, c in zip(stages, caches):
            x = s(x, start, c)
        return int(stages[-1].head(x[-1:])[0].argmax())

    out: list[int] = []
    with torch.inference_mode():
        pos, feed = 0, list(token_ids)
        for _ in range(n):
            nxt = step(feed, pos)
            out.append(nxt)
            pos += len(feed)
            feed = [nxt]
    return out


def measure_layer_ms(target: StageEngine | ModelConfig, device: str = "auto", dtype: str | torch.dtype = "auto",
                     budget_s: float = 0.4, context: int = 64, batch: int = 1) -> float:
    """Milliseconds for one decode step (of ``batch`` sessions) through one layer, measured
    within ``budget_s``.

    With an engine that holds layers, its own first layer is timed on its worker thread;
    with a bare config (a peer joining before any weights are loaded), a random layer.
    """
    if isinstance(target, StageEngine) and target.span is not None:
        block = target.stage.layer(target.span.start)
        cfg, dev, dt = target.config, target.device, target.dtype
        lib = target.stage.rowops
        return target.run_sync(lambda: _time_block(block, cfg, dev, dt, budget_s, context, batch, lib))
    cfg = target.config if isinstance(target, StageEngine) else target
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    with torch.device(dev):
        block = Block(cfg).to(dt)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    with torch.inference_mode():
        return _time_block(block, cfg, dev, dt, budget_s, context, batch, rowops.library_for(dev, dt))


def _time_block(block: Block, cfg: ModelConfig, dev: torch.device, dt: torch.dtype,
                budget_s: float, context: int, batch: int = 1, lib=None) -> float:
    """ms of one decode step of ``batch`` sessions (``context`` cached positions each)
    through ``block`` (see ``_low_ms``), as the stage runs it (``lib``: shards/rowops.py)."""
    forward = block if lib is None else functools.partial(_rowops_block, lib, block)
    caches = [KVCache(cfg.n_kv_heads, cfg.head_dim, dt, dev) for _ in range(batch)]
    x = torch.randn(context * batch, cfg.hidden_size, device=dev, dtype=dt)
    cos, sin = rope_tables(cfg, block.sliding, [(0, context)] * batch, dev, dt)
    forward(x, cos, sin, [(0, context, cache) for cache in caches])  # prefill the contexts, also the warm-up
    rows = x[:batch]
    c, s = rope_tables(cfg, block.sliding, [(context, 1)] * batch, dev, dt)
    segments = [(context, 1, cache) for cache in caches]

    def step() -> None:
        for cache in caches:
            cache.truncate(context)
        forward(rows, c, s, segments)

    for _ in range(3):  # the first calls of a fresh process pay for allocations and lazy set-up
        step()
    return _low_ms(step, dev, budget_s)


def _rowops_block(lib, block: Block, x: Tensor, *rest) -> Tensor:
    return rowops.block(lib, block, x.clone(), *rest)  # (it updates x in place)


def _low_ms(fn: Callable[[], object], dev: torch.device, budget_s: float, most: int = 200) -> float:
    """ms of ``fn``, the 10th percentile of as many calls as fit ``budget_s`` (at least 3).

    Another process on the same core only ever slows calls down, and placement must not
    read a neighbour's burst as a slow box. So: on a CPU running torch on one thread (the
    calling one), the thread's own CPU time, which a neighbour does not inflate; and a low
    percentile, not the median. Measured on this shared box (load 5 on 2 cores), one layer
    at batch 8 read 6-10 ms by median wall time and 1.9-2.3 ms by the 10th percentile (1.6-1.9
    quiet); the head (15 ms, longer than a time slice) read 26-35 ms even so: hence CPU time."""
    clock = time.thread_time if dev.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(times) < 3:
        _sync(dev)
        t0 = clock()
        fn()
        _sync(dev)
        times.append(clock() - t0)
        if len(times) >= most:
            break
    times.sort()
    return 1000.0 * times[len(times) // 10]


# The decode batch placement weighs a step at: what 16 streams over a 2-stage plan
# (two lanes of 8) up to one lane of 16 give each stage per step.
DECODE_BATCH = 8


@dataclass(frozen=True, slots=True)
class PartTimes:
    """What the real parts of a model cost on this box, ms per decode step: one layer,
    and the head (final norm, lm_head and picking a token from the logits), at batch 1
    and at ``batch`` rows."""

    layer_ms: float
    layer_ms_batch: float
    head_ms: float
    head_ms_batch: float
    batch: int


def measure_parts(model_dir: Path, device: str = "auto", dtype: str | torch.dtype = "auto",
                  batch: int = DECODE_BATCH, budget_s: float = 0.12, context: int = 64) -> PartTimes:
    """Time this model's first layer and its head as this box runs them (its quantized
    kernels, its dtype, its threads), from the shard files alone: a layer and the head
    are loaded (unverified: nothing computed here is ever served) and dropped again."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    stage, manifest = load_stage(model_dir, Span(0, 1), embed=True, head=True, device=dev, dtype=dt, verify=False)
    cfg = manifest.config
    block = stage.layer(0)
    with torch.inference_mode():
        # through the forward the stage serves with (shards/rowops.py where it runs): the
        # torch forward read a SmolLM2 layer 1.3-1.6x slower, which gave a supernode that
        # also runs the head too many layers
        layer = [_time_block(block, cfg, dev, dt, budget_s, context, b, stage.rowops) for b in (1, batch)]
        x = torch.randn(batch, cfg.hidden_size, device=dev, dtype=dt)
        head = []
        for n in (1, batch):
            def pick(n: int = n) -> None:
                stage.head(x[:n]).argmax(-1).cpu()
            for _ in range(2):
                pick()
            head.append(_low_ms(pick, dev, budget_s))
    return PartTimes(layer[0], layer[1], head[0], head[1], batch)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
