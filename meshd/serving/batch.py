"""Batch jobs: OpenAI's Batch API, run through this peer's own request path.

A job lives on the peer it was submitted to, in that peer's SQLite store
(``batchstore``). Each line is POSTed to this peer's own API, the same code an HTTP
client's request takes: the scheduler serves it when this peer is the supernode, the
proxy forwards it (and resubmits it when the supernode is lost) when it is not. So a
stage loss or a supernode failover mid-job is handled by the machinery that handles it
for every request, and a greedy or seeded line answers what it answers alone.

Exactly once: a line's result is written with its batch's counts in one transaction,
keyed by (batch, line); a restart runs the lines that have none, and a line that ran
twice (cut off before its result was written) still has one result.

Lines go to the scheduler as the ``batch`` class (``meshd_priority``), at most
``batch_concurrency`` at a time per peer: enough to keep a step's batch full, while the
scheduler keeps interactive requests ahead of them (see ``scheduler.pick_step``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sqlite3
import ssl
import time
from dataclasses import dataclass, field

import aiohttp
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshd.errors import MeshError, StorageFull
from meshd.serving.batchinput import new_id, result_record, validate_input
from meshd.serving.batchstore import DB_NAME, LEGACY_OWNER, TERMINAL, BatchStore, Line, Status

log = structlog.get_logger()

PAGE = 256  # pending lines read from the store at a time
MAX_ATTEMPTS = 4  # 5xx answers (other than 503) a line takes before it goes to the error file
BUSY_RETRY_S = (0.25, 5.0)  # backoff on a 503 (busy, or no plan): never counted, the job's expiry bounds it
ERROR_RETRY_S = (1.0, 30.0)
PROGRESS_WINDOW_S = 30.0


class Progress:
    """Lines and tokens per second over the last ``window`` seconds (or since the start)."""

    def __init__(self, window: float = PROGRESS_WINDOW_S):
        self.window = window
        self.started = time.monotonic()
        self._events: collections.deque[tuple[float, int, int]] = collections.deque()

    def add(self, lines: int, tokens: int) -> None:
        now = time.monotonic()
        self._events.append((now, lines, tokens))
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()

    def rates(self) -> tuple[float, float]:
        now = time.monotonic()
        span = max(1e-3, min(self.window, now - self.started))
        recent = [(n, t) for at, n, t in self._events if at >= now - self.window]
        return sum(n for n, _ in recent) / span, sum(t for _, t in recent) / span


@dataclass(eq=False)
class Job:
    id: str
    endpoint: str
    status: Status
    input_file_id: str
    expires_at: int
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0
    cancelled: bool = False
    progress: Progress = field(default_factory=Progress)
    tasks: set[asyncio.Task] = field(default_factory=set)

    @classmethod
    def from_row(cls, row: dict) -> Job:
        return cls(row["id"], row["endpoint"], Status(row["status"]), row["input_file_id"], row["expires_at"],
                   row["total"], row["completed"], row["failed"], row["output_tokens"])

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and time.time() > self.expires_at

    def view(self) -> dict:
        """For /status, /metrics and the dashboard."""
        lines_s, tokens_s = self.progress.rates()
        left = self.total - self.completed - self.failed
        return {"id": self.id, "status": str(self.status), "endpoint": self.endpoint, "total": self.total,
                "completed": self.completed, "failed": self.failed, "output_tokens": self.output_tokens,
                "tokens_per_s": round(tokens_s, 2), "lines_per_s": round(lines_s, 3),
                "eta_s": round(left / lines_s, 1) if lines_s > 0 and self.total else None}


class BatchRunner:
    """Runs this peer's batch jobs; one task per job, owned by this runner's group,
    which the node's group owns."""

    def __init__(self, node):
        self.node = node
        self.store = BatchStore(node.config.state_dir / DB_NAME, node.config.batch_max_bytes)
        self.jobs: dict[str, Job] = {}
        self.unavailable: str | None = "starting"
        self.stopping = False
        self._tg: asyncio.TaskGroup | None = None
        self._slots: asyncio.Semaphore | None = None
        self._http: aiohttp.ClientSession | None = None

    async def run(self, client_ssl: ssl.SSLContext | bool = True) -> None:
        """Resume unfinished jobs and run new ones until stopped; ``client_ssl`` is what the
        lines' requests to this peer's own API verify its TLS with (the node's client side)."""
        try:
            await self.store.do(self.store.open)
        except (sqlite3.Error, OSError) as exc:
            self.unavailable = f"the batch store {self.store.path} cannot be opened: {exc}"
            log.error("batch_store_unavailable", path=str(self.store.path), error=str(exc))
            return
        self._slots = asyncio.Semaphore(self.node.config.batch_concurrency)
        # A session of its own: a line that the local proxy forwards holds two connections,
        # and must never wait for one that a line holds.
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=5),
            connector=aiohttp.TCPConnector(limit=0, ssl=client_ssl))
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self.unavailable = None
                for row in await self.store.do(self.store.unfinished):
                    log.info("batch_resumed", batch=row["id"], status=row["status"], total=row["total"],
                             done=row["completed"] + row["failed"])
                    self._start(row)
                await asyncio.Event().wait()  # until the node's group is cancelled at shutdown
        finally:
            self.unavailable = "this peer is shutting down"
            await self._http.close()
            self.store.close()

    def status(self) -> list[dict]:
        """The jobs running on this peer, oldest first (for /status and the dashboard)."""
        return [job.view() for job in self.jobs.values()]

    def stop(self) -> None:
        """At shutdown: lines in flight are cut off (they run again after a restart), so
        the drain does not wait on batch work."""
        self.stopping = True
        for job in self.jobs.values():
            for task in list(job.tasks):
                task.cancel()

    def _start(self, row: dict) -> None:
        assert self._tg is not None
        job = Job.from_row(row)
        self.jobs[job.id] = job
        self._tg.create_task(self._run_job(job))

    async def submit(self, input_file_id: str, endpoint: str, window: str, window_s: int,
                     metadata: dict | None, owner: str = LEGACY_OWNER) -> dict:
        row = await self.store.do(self.store.create_batch, new_id("batch_"), input_file_id, endpoint, window,
                                  int(time.time()) + window_s, metadata, owner)
        log.info("batch_submitted", batch=row["id"], endpoint=endpoint, file=input_file_id)
        self._start(row)
        return row

    async def cancel(self, batch_id: str) -> dict | None:
        row = await self.store.do(self.store.get_batch, batch_id)
        if row is None or Status(row["status"]) in TERMINAL or row["status"] == Status.CANCELLING:
            return row
        row = await self.store.do(self.store.set_status, batch_id, Status.CANCELLING)
        job = self.jobs.get(batch_id)
        if job is not None:
            job.cancelled, job.status = True, Status.CANCELLING
            for task in list(job.tasks):
                task.cancel()
        log.info("batch_cancelling", batch=batch_id)
        return row

    # -- one job ---------------------------------------------------------------------------

    async def _run_job(self, job: Job) -> None:
        store = self.store
        try:
            if job.status is Status.VALIDATING:
                row = await store.do(validate_input, store, job.id, job.input_file_id, job.endpoint)
                job.status, job.total, job.failed = Status(row["status"]), row["total"], row["failed"]
                log.info("batch_validated", batch=job.id, lines=job.total, malformed=job.failed, status=row["status"])
            if job.status is Status.IN_PROGRESS:
                await self._feed(job)
            if self.stopping:
                return  # the job stays in progress in the store; a restart resumes it
            if job.status in TERMINAL:
                return
            if job.cancelled or job.status is Status.CANCELLING:
                final = Status.CANCELLED
            elif job.expired:
                final = Status.EXPIRED
            else:
                await store.do(store.set_status, job.id, Status.FINALIZING)
                final = Status.COMPLETED
            row = await store.do(store.finish, job.id, final)
            job.status = final
            log.info("batch_finished", batch=job.id, status=str(final), completed=row["completed"],
                     failed=row["failed"], output_tokens=row["output_tokens"])
        except* StorageFull as group:
            await self._fail(job, "storage_full", str(group.exceptions[0]))
        except* (sqlite3.Error, OSError) as group:
            await self._fail(job, "storage_error", f"the batch store failed: {group.exceptions[0]}")
        finally:
            self.jobs.pop(job.id, None)

    async def _fail(self, job: Job, code: str, message: str) -> None:
        """End a job on a storage failure; the results written so far stay readable."""
        log.error("batch_failed", batch=job.id, code=code, error=message)
        job.status = Status.FAILED
        for task in list(job.tasks):
            task.cancel()
        try:
            await self.store.do(self.store.finish, job.id, Status.FAILED,
                                [{"code": code, "message": message, "line": None, "param": None}])
        except (MeshError, sqlite3.Error, OSError) as exc:
            log.error("batch_fail_not_recorded", batch=job.id, error=str(exc))

    def _stopped(self, job: Job) -> bool:
        return self.stopping or job.cancelled or job.expired or job.status is Status.FAILED

    async def _feed(self, job: Job) -> None:
        """Start a task per pending line, at most ``batch_concurrency`` in flight on this peer."""
        assert self._slots is not None
        after = 0
        async with asyncio.TaskGroup() as tg:
            while not self._stopped(job):
                page = await self.store.do(self.store.pending_lines, job.id, after, PAGE)
                if not page:
                    break
                for line in page:
                    await self._slots.acquire()
                    if self._stopped(job):
                        self._slots.release()
                        break
                    after = line.idx
                    task = tg.create_task(self._line(job, line))
                    job.tasks.add(task)
                    # A callback, not a finally: a task cancelled before it ran never runs one.
                    task.add_done_callback(lambda t: (job.tasks.discard(t), self._slots.release()))
        if job.expired and not (job.cancelled or self.stopping):
            log.warning("batch_expired", batch=job.id, done=job.completed + job.failed, total=job.total)

    async def _line(self, job: Job, line: Line) -> None:
        answer = await self._execute(job, line)
        if answer is None:
            return  # the job stopped first: the line stays pending
        ok, record, usage = answer
        tokens_in, tokens_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        if await self.store.do(self.store.put_result, job.id, line.idx, ok, record, tokens_in, tokens_out):
            job.completed += ok
            job.failed += not ok
            job.output_tokens += tokens_out
            job.progress.add(1, tokens_out)

    async def _until_serving(self, job: Job) -> bool:
        """Wait while this peer cannot serve (no plan yet, a failover); False once the job stopped."""
        while not self.node.serves() or self.node.stopping:
            if self._stopped(job):
                return False
            await asyncio.sleep(0.25)
        return not self._stopped(job)

    async def _execute(self, job: Job, line: Line) -> tuple[bool, str, dict] | None:
        """POST the line to this peer's own API until it has an answer to keep:
        (ok, its output or error record, its usage); None when the job stopped first."""
        assert self._http is not None
        node, path = self.node, job.endpoint
        body = dict(line.body, meshd_priority="batch")
        failures, busy = 0, 0
        while True:
            if not await self._until_serving(job):
                return None
            status, data = None, None
            try:
                async with self._http.post(node.own_url() + path, json=body, headers=node.local_auth()) as resp:
                    status, raw = resp.status, await resp.read()
                data = json.loads(raw)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                data = {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}}
            except ValueError:
                data = {"error": {"message": f"HTTP {status} without a JSON body", "type": "server_error"}}
            if status == 200 and isinstance(data, dict):
                response = {"status_code": 200, "request_id": data.get("id"), "body": data}
                return True, result_record(line.custom_id, response=response), data.get("usage") or {}
            if status is not None and 400 <= status < 500 and status not in (408, 429):
                # The request itself is refused (bad field, too long): that is its answer.
                return False, result_record(line.custom_id, response={"status_code": status, "request_id": None,
                                                                      "body": data}), {}
            if status in (503, 429):
                # Busy, or no plan now (a failover under way): wait for room; the job's
                # expiry bounds this, never a count (a long failover must not fail lines).
                busy += 1
                await _backoff(BUSY_RETRY_S, busy)
                continue
            failures += 1
            message = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
            log.warning("batch_line_retry", batch=job.id, line=line.idx, status=status, error=message,
                        attempt=failures)
            if failures >= MAX_ATTEMPTS:
                error = {"code": "server_error", "message": f"gave up after {failures} attempts: {message}"}
                return False, result_record(line.custom_id, error=error), {}
            await _backoff(ERROR_RETRY_S, failures)


async def _backoff(bounds: tuple[float, float], attempt: int) -> None:
    low, high = bounds
    await asyncio.sleep(min(high, low * 2 ** min(attempt - 1, 16)) * (0.5 + random.random() / 2))


def batch_families(views: list[dict]):
    """Prometheus families for /metrics from ``BatchRunner.status()``, read at scrape time."""
    running = GaugeMetricFamily("meshd_batch_jobs_running", "Batch jobs running on this peer")
    running.add_metric([], len(views))
    yield running
    lines = GaugeMetricFamily("meshd_batch_job_lines", "Lines of each running batch job, by state",
                              labels=["batch", "state"])
    tokens = CounterMetricFamily("meshd_batch_job_output_tokens", "Tokens generated for each running batch job",
                                 labels=["batch"])
    rate = GaugeMetricFamily("meshd_batch_job_tokens_per_second", "Recent tokens/s of each running batch job",
                             labels=["batch"])
    for v in views:
        for state in ("total", "completed", "failed"):
            lines.add_metric([v["id"], state], v[state])
        tokens.add_metric([v["id"]], v["output_tokens"])
        rate.add_metric([v["id"]], v["tokens_per_s"])
    yield lines
    yield tokens
    yield rate
