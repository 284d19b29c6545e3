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

Replicated: while a job runs, this peer keeps a copy of it (its lines, then each result
as it is written) on the peer that would lead were this one gone (``MeshView.successor``:
the supernode, or the next one when this peer is the supernode). A peer holding a replica
whose home has been gone for ``batch_takeover_s`` makes it its own batch and runs the
lines that have no result: the job finishes, and its owner reads it from that peer. A home
that comes back finds its batch taken (``batch_moved``) and runs no more of it.

Lines go to the scheduler as the ``batch`` class (``meshd_priority``), at most
``batch_concurrency`` at a time per peer: enough to keep a step's batch full, while the
scheduler keeps interactive requests ahead of them (see ``scheduler.pick_step``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import sqlite3
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshd.config import Config
from meshd.control import tunnel
from meshd.control.mesh import MeshView
from meshd.control.uplink import Uplink
from meshd.errors import BadRequest, MeshError, StorageFull
from meshd.serving.batchinput import ENDPOINTS, MAX_CUSTOM_ID, new_id, result_record, validate_input
from meshd.serving.guards import MAX_JSON_DEPTH, parse_json
from meshd.serving.openai import find_surrogate
from meshd.serving.batchstore import DB_NAME, LEGACY_OWNER, TERMINAL, BatchStore, Line, Status
from protocol.messages import NodeId

log = structlog.get_logger()

PAGE = 256  # pending lines read from the store at a time
MAX_ATTEMPTS = 4  # 5xx answers (other than 503) a line takes before it goes to the error file
BUSY_RETRY_S = (0.25, 5.0)  # backoff on a 503 (busy, or no plan): never counted, the job's expiry bounds it
ERROR_RETRY_S = (1.0, 30.0)
PROGRESS_WINDOW_S = 30.0
# Replication: how often a job's new results go to its replica's holder, how often a job
# with none says it is still there, how long a replica its home has stopped syncing (while
# that home is still in the mesh: it syncs to another holder now) is kept, and the most
# bytes of lines or results one sync call carries.
SYNC_S = 1.0
KEEPALIVE_S = 5.0
STALE_S = 30.0
SYNC_BYTES = 4 << 20
REPLICA_TIMEOUT_S = 30.0
_BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
MAX_RECORD = 64 << 20


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
    # Replication: the peer holding this job's whole replica (None: none yet), the results
    # written since its last sync (line, ok, record, input and output tokens), and when it
    # last heard from this peer (monotonic).
    replica: str | None = None
    unsent: list[tuple[int, bool, str, int, int]] = field(default_factory=list)
    synced: float = 0.0

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


class BatchHost(Protocol):
    """What the batch runner reads of the peer it runs on: its settings and state dir, the
    mesh (who would lead without it: its replicas go there), whether a line can be served
    or the peer stops, and its own API (lines go there as any client's requests)."""

    config: Config
    view: MeshView
    uplink: Uplink
    stopping: bool

    def own_url(self) -> str: ...

    def local_auth(self) -> dict[str, str]: ...


class BatchRunner:
    """Runs this peer's batch jobs; one task per job, owned by this runner's group,
    which the node's group owns."""

    def __init__(self, node: BatchHost):
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
                tg.create_task(self._replicate())
                await self._watch_replicas()  # until the node's group is cancelled at shutdown
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
            await self._release_replica(job)
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
        if code != "batch_moved":
            await self._release_replica(job)

    # -- replication: this peer's jobs, copied to the peer that would lead without it ----

    async def _replicate(self) -> None:
        """Keep each running job's replica on this peer's successor up to date: a whole copy
        when the successor changes, then the new results every ``SYNC_S``."""
        while True:
            await asyncio.sleep(SYNC_S)
            holder = self.node.view.successor()
            for job in list(self.jobs.values()):
                if job.status is not Status.IN_PROGRESS or self._stopped(job):
                    continue
                try:
                    await self._sync(job, holder)
                except (sqlite3.Error, OSError) as exc:
                    log.warning("batch_replica_unsent", batch=job.id, error=str(exc))

    async def _sync(self, job: Job, holder: str | None) -> None:
        if holder != job.replica and job.replica is not None:
            old, job.replica = job.replica, None
            await self._send(old, {"op": "drop", "id": job.id}, job)  # best effort: it also goes stale
        if holder is None:
            return
        if job.replica is None:
            answer = await self._snapshot(job, holder)
            if answer == "ok":
                job.replica, job.synced = holder, time.monotonic()
                log.info("batch_replicated", batch=job.id, holder=holder, done=job.completed + job.failed)
        elif job.unsent or time.monotonic() - job.synced >= KEEPALIVE_S:
            sent, job.unsent = job.unsent, []
            answer = await self._send(holder, {"op": "sync", "batch": _replica_head(job, None), "results": sent},
                                      job)
            if answer == "ok":
                job.synced = time.monotonic()
            else:
                job.unsent[:0] = sent  # sent again, with the next ones (written once there whatever)
                if answer == "need":  # the holder lost it (a fresh state dir): a whole copy again
                    job.replica = None
        else:
            return
        if answer == "taken":
            await self._moved(job, holder)

    async def _snapshot(self, job: Job, holder: str) -> str | None:
        """Send a whole copy of ``job``: its batch, counts and results first, then its lines,
        in parts of at most ``SYNC_BYTES``; the answer of the last part (or the first that
        is not "ok")."""
        job.unsent.clear()  # the snapshot holds every result written before it is read
        batch, results = await self.store.do(self.store.snapshot, job.id)
        head = _replica_head(job, batch)
        counts = {k: batch[k] for k in ("completed", "failed", "input_tokens", "output_tokens")}
        first = True
        parts = _parts([[i, ok, record, 0, 0] for i, ok, record in results])
        for part in parts or [[]]:
            answer = await self._send(holder, {"op": "sync", "batch": head, "counts": counts if first else None,
                                               "counted": True, "results": part}, job)
            if answer != "ok":
                return answer
            first = False
        after = 0
        while page := await self.store.do(self.store.lines_page, job.id, after, PAGE):
            after = page[-1].idx
            for part in _parts([[ln.idx, ln.custom_id, ln.body] for ln in page]):
                answer = await self._send(holder, {"op": "sync", "batch": head, "lines": part}, job)
                if answer != "ok":
                    return answer
        return "ok"

    async def _send(self, holder: str, payload: dict, job: Job) -> str | None:
        """One call to the holder's replica endpoint over the sealed link: its answer, or
        None when it could not be asked (the next round tries again)."""
        link = self.node.view.live_links().get(NodeId(holder))
        if link is None:
            return None
        try:
            async with tunnel.call(link, "POST", tunnel.REPLICA, json.dumps(payload, separators=(",", ":")).encode(),
                                   sock_read=REPLICA_TIMEOUT_S) as resp:
                status, raw = resp.status, await resp.read()
            answer = json.loads(raw).get("answer") if status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError, RecursionError) as exc:
            log.info("batch_replica_unsent", batch=job.id, holder=holder, error=str(exc) or type(exc).__name__)
            return None
        if answer is None:
            log.warning("batch_replica_refused", batch=job.id, holder=holder, status=status,
                        error=raw[:200].decode("utf-8", "replace"))
        return answer

    async def _release_replica(self, job: Job) -> None:
        """The job ended here: its replica goes (best effort; unheard, it goes stale)."""
        if job.replica is not None:
            holder, job.replica = job.replica, None
            await self._send(holder, {"op": "drop", "id": job.id}, job)

    async def _moved(self, job: Job, holder: str) -> None:
        """Another peer took this job over while this one was gone: it runs no more of it here."""
        log.warning("batch_moved", batch=job.id, holder=holder, done=job.completed + job.failed, total=job.total)
        await self._fail(job, "batch_moved", f"peer {holder} took this batch over while this peer was gone and "
                                             f"finishes it: read it there (GET /v1/batches/{job.id} on that peer)")

    async def on_replica(self, peer: str, raw: bytes) -> tuple[int, bytes]:
        """A peer's call over its sealed link: keep, update or drop a replica of one of its
        own batches. Every value is checked; a bad one is a 400 and changes nothing."""
        if self.unavailable:
            return 503, _answer_error(f"batch jobs are not available on this peer now: {self.unavailable}")
        try:
            # Read as a client's body is (a line's body or a batch's metadata, depth-checked
            # when it came in, sits four levels down here); no string the store cannot keep.
            payload = parse_json(raw, MAX_JSON_DEPTH + 4)
            if (bad := find_surrogate(payload)) is not None:
                raise ValueError(f"{bad} holds a lone UTF-16 surrogate")
            op = payload["op"] if isinstance(payload, dict) else None
            if op == "drop":
                batch_id = _checked(payload.get("id"), _BATCH_ID, "id")
                dropped = await self.store.do(self.store.drop_replica, peer, batch_id)
                if dropped:
                    log.info("batch_replica_dropped", batch=batch_id, home=peer)
                return 200, json.dumps({"answer": "ok"}).encode()
            if op != "sync":
                raise ValueError("op must be sync or drop")
            batch = _checked_head(payload.get("batch"))
            counts = payload.get("counts")
            if counts is not None:
                counts = {k: _count(counts.get(k) if isinstance(counts, dict) else None, k)
                          for k in ("completed", "failed", "input_tokens", "output_tokens")}
                if "endpoint" not in batch:
                    raise ValueError("a snapshot's first part (with counts) carries the whole batch")
            lines = [_checked_line(x) for x in _list(payload.get("lines", []), "lines")]
            results = [_checked_result(x) for x in _list(payload.get("results", []), "results")]
            counted = payload.get("counted", False) is True
        except (BadRequest, ValueError, KeyError, TypeError) as exc:
            log.warning("batch_replica_malformed", peer=peer, error=str(exc))
            return 400, _answer_error(f"malformed replica call: {exc}")
        try:
            answer = await self.store.do(self.store.hold_replica, peer, batch, lines, results, counts, counted)
        except StorageFull as exc:
            return 507, _answer_error(str(exc))
        except (sqlite3.Error, OSError) as exc:
            return 500, _answer_error(f"the batch store failed: {exc}")
        if answer == "conflict":
            log.warning("batch_replica_conflict", batch=batch["id"], peer=peer)
        return 200, json.dumps({"answer": answer}).encode()

    async def _watch_replicas(self) -> None:
        """Take over the replicas whose home has been gone ``batch_takeover_s``; drop those
        its home (still here) no longer syncs (it syncs to another peer now)."""
        gone_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(SYNC_S)
            if self.stopping:
                continue
            try:
                held = await self.store.do(self.store.replicas)
            except (sqlite3.Error, OSError) as exc:
                log.warning("batch_replicas_unread", error=str(exc))
                continue
            now, live = time.time(), self.node.view.live_links()
            for home in list(gone_since):
                if home in live:
                    del gone_since[home]
            for row in held:
                try:
                    await self._watch(row, gone_since, now, live)
                except (MeshError, sqlite3.Error, OSError) as exc:
                    log.warning("batch_replica_not_taken", batch=row["id"], error=str(exc))

    async def _watch(self, row: dict, gone_since: dict[str, float], now: float, live: dict) -> None:
        home, heard = row["home"], row["heard_at"] or 0.0
        if home in live:
            if now - heard > STALE_S:
                await self.store.do(self.store.drop_replica, home, row["id"])
                log.info("batch_replica_stale", batch=row["id"], home=home, unheard_s=round(now - heard, 1))
            return
        since = gone_since.setdefault(home, now)
        if now - since < self.node.config.batch_takeover_s or heard < since - STALE_S:
            return  # not gone long enough; or this copy was stale already when it went
        taken = await self.store.do(self.store.take_over, row["id"])
        if taken is None:
            log.warning("batch_replica_incomplete", batch=row["id"], home=home)
            return
        log.warning("batch_taken_over", batch=row["id"], home=home, gone_s=round(now - since, 1),
                    done=taken["completed"] + taken["failed"], total=taken["total"])
        self._start(taken)

    def _stopped(self, job: Job) -> bool:
        return self.stopping or job.cancelled or job.expired or job.status is Status.FAILED

    async def _feed(self, job: Job) -> None:
        """Start a task per pending line, at most ``batch_concurrency`` in flight on this peer."""
        assert self._slots is not None
        slots = self._slots  # (a local stays narrowed in the callback below)

        def line_done(task: asyncio.Task) -> None:
            # A callback, not a finally: a task cancelled before it ran never runs one.
            job.tasks.discard(task)
            slots.release()

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
                    task.add_done_callback(line_done)
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
            job.unsent.append((line.idx, ok, record, tokens_in, tokens_out))

    async def _until_serving(self, job: Job) -> bool:
        """Wait while this peer cannot serve (no plan yet, a failover); False once the job stopped."""
        while not self.node.uplink.serves() or self.node.stopping:
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


def _replica_head(job: Job, batch: dict | None) -> dict:
    """What a replica call says of the batch: all of it in a snapshot, its status otherwise."""
    head: dict[str, Any] = {"id": job.id, "status": str(job.status)}
    if batch is not None:
        head |= {k: batch[k] for k in ("input_file_id", "endpoint", "completion_window", "created_at", "expires_at",
                                       "in_progress_at", "owner", "runnable", "total")}
        head["metadata"] = json.loads(batch["metadata"]) if batch["metadata"] else None
    return head


def _parts(items: list) -> list[list]:
    """``items`` cut into lists of at most about ``SYNC_BYTES`` of JSON each."""
    parts: list[list] = []
    part: list = []
    size = 0
    for item in items:
        n = len(json.dumps(item, separators=(",", ":")))
        if part and size + n > SYNC_BYTES:
            parts.append(part)
            part, size = [], 0
        part.append(item)
        size += n
    if part:
        parts.append(part)
    return parts


def _answer_error(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


def _checked(value: object, pattern: re.Pattern, what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{what} is not a well-formed id")
    return value


def _count(value: object, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value < 2**62:
        raise ValueError(f"{what} must be an integer from {low}")
    return value


def _list(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list")
    return value


def _checked_head(head: object) -> dict:
    if not isinstance(head, dict):
        raise ValueError("batch must be an object")
    out: dict[str, Any] = {"id": _checked(head.get("id"), _BATCH_ID, "batch id")}
    if head.get("status") not in (Status.IN_PROGRESS, Status.CANCELLING, Status.FINALIZING):
        raise ValueError("status must be in_progress, cancelling or finalizing")
    out["status"] = Status(head["status"])
    if "endpoint" not in head:
        return out  # a sync of results: the replica has the rest
    if head.get("endpoint") not in ENDPOINTS:
        raise ValueError("endpoint is not a batch endpoint")
    window, owner, metadata = head.get("completion_window"), head.get("owner"), head.get("metadata")
    if not isinstance(window, str) or not re.fullmatch(r"[1-9][0-9]{0,3}h", window):
        raise ValueError("completion_window must be like 24h")
    if not isinstance(owner, str) or not 0 < len(owner) <= 128:
        raise ValueError("owner must be a string of at most 128 characters")
    if metadata is not None and (not isinstance(metadata, dict) or len(json.dumps(metadata)) > 16384):
        raise ValueError("metadata must be an object of at most 16 KiB")
    out |= {"input_file_id": _checked(head.get("input_file_id"), _FILE_ID, "input_file_id"),
            "endpoint": head["endpoint"], "completion_window": window, "owner": owner, "metadata": metadata,
            "created_at": _count(head.get("created_at"), "created_at"),
            "expires_at": _count(head.get("expires_at"), "expires_at"),
            "in_progress_at": _count(head.get("in_progress_at"), "in_progress_at"),
            "runnable": _count(head.get("runnable"), "runnable"), "total": _count(head.get("total"), "total")}
    return out


def _checked_line(item: object) -> Line:
    if not isinstance(item, list) or len(item) != 3:
        raise ValueError("a line is [line, custom_id, body]")
    idx, custom_id, body = item
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise ValueError(f"custom_id must be a string of at most {MAX_CUSTOM_ID} characters")
    if not isinstance(body, dict) or body.get("stream"):
        raise ValueError("a line's body must be an object, not a stream")
    return Line(_count(idx, "line", 1), custom_id, body)


def _checked_result(item: object) -> tuple[int, bool, str, int, int]:
    if not isinstance(item, list) or len(item) != 5:
        raise ValueError("a result is [line, ok, record, input_tokens, output_tokens]")
    idx, ok, record, tokens_in, tokens_out = item
    if not isinstance(ok, bool):
        raise ValueError("ok must be true or false")
    if not isinstance(record, str) or len(record) > MAX_RECORD:
        raise ValueError("a result's record must be a string")
    try:
        if not isinstance(json.loads(record), dict):
            raise ValueError("a result's record must be a JSON object")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"a result's record is not JSON: {exc}") from None
    return _count(idx, "line", 1), ok, record, _count(tokens_in, "input_tokens"), _count(tokens_out, "output_tokens")


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
