"""Batch jobs on disk: one SQLite database in the state directory (stdlib sqlite3, WAL).

What lives here: uploaded files (their bytes as a blob), batches (status, timestamps,
counts), a batch's parsed lines while it runs, and one result row per line. A result
is keyed by (batch, line) and written in the same transaction as the batch's counts,
with INSERT OR IGNORE: a line's result is written at most once, whatever runs twice.
Output and error files are views of the results table (no second copy).

Every file and batch keeps an owner (``Owner``: the API key's hash, or the client's
address on a peer without keys); output and error files take their batch's. Records
from before owners were kept (schema 1) get the owner ``legacy``: callers on the
peer's own box (the operator) see them, nobody else does.

One connection, used only on one worker thread (``BatchStore.do`` runs a method
there), so the event loop never waits on the disk. ``synchronous=NORMAL`` in WAL mode:
a committed transaction survives a crash of the process (SIGKILL); a power cut may
lose the last ones, and their lines simply run again.

Disk use is bounded: ``max_page_count`` caps the database at ``max_bytes`` (SQLite
answers "database or disk is full" beyond it, as it does when the disk itself is full),
and ``auto_vacuum=INCREMENTAL`` gives deleted files' pages back to the file system.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, cast

from meshd.errors import StorageFull

DB_NAME = "batch.sqlite3"
SCHEMA_VERSION = 3  # 2: files and batches keep an owner; 3: batches replicated from other peers
LEGACY_OWNER = "legacy"  # records written before owners were kept
BLOB_CHUNK = 1 << 20
# The disk keeps at least this much free beyond what an upload needs: SQLite's WAL
# and the results of running jobs need room too.
DISK_RESERVE_BYTES = 64 << 20
SQLITE_FULL = 13

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,              -- batch | batch_output
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    kind TEXT NOT NULL,                 -- input | output | error
    batch_id TEXT,                      -- output and error files: whose results they are
    data BLOB,                          -- input files only
    owner TEXT NOT NULL DEFAULT 'legacy'
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    status TEXT NOT NULL,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    owner TEXT NOT NULL DEFAULT 'legacy'
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
"""


class Status(StrEnum):
    """OpenAI's batch statuses."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset({Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED})
# The timestamp column each status sets when a batch enters it.
STAMP = {Status.IN_PROGRESS: "in_progress_at", Status.FINALIZING: "finalizing_at", Status.COMPLETED: "completed_at",
         Status.FAILED: "failed_at", Status.EXPIRED: "expired_at", Status.CANCELLING: "cancelling_at",
         Status.CANCELLED: "cancelled_at"}


@dataclass(frozen=True, slots=True)
class Owner:
    """Who asks: their owner string, and whether they call from the peer's own box (who
    may also see the ``legacy`` records of an older store)."""

    name: str
    local: bool = False

    def sees(self, row: dict) -> bool:
        return row["owner"] == self.name or (self.local and row["owner"] == LEGACY_OWNER)

    def where(self) -> tuple[str, tuple]:
        """The SQL condition (and its arguments) for rows this owner sees."""
        if self.local:
            return "owner IN (?, ?)", (self.name, LEGACY_OWNER)
        return "owner = ?", (self.name,)


@dataclass(frozen=True, slots=True)
class Line:
    """One runnable line of a batch: its request body is already checked for shape."""

    idx: int  # the line number in the input file (1-based)
    custom_id: str
    body: dict


def _full(exc: sqlite3.Error) -> bool:
    return getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "database or disk is full" in str(exc)


class BatchStore:
    def __init__(self, path: Path, max_bytes: int):
        self.path = path
        self.max_bytes = max_bytes
        self._db: sqlite3.Connection | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshd-batch-db")

    # -- the thread ------------------------------------------------------------------

    async def do(self, fn, *args):
        """Run ``fn(*args)`` (a method of this store) on the database's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._pool.submit(shut).result()
        self._pool.shutdown(wait=True)

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "BatchStore.open first"
        return self._db

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Transactions are explicit (_tx). Used by one thread at a time: the store's own
        # (tests call the methods directly, from theirs).
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect on a new database only
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA busy_timeout = 5000")
        db.execute("PRAGMA journal_size_limit = 16777216")  # the WAL shrinks back after checkpoints
        page = db.execute("PRAGMA page_size").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {max(16, self.max_bytes // page)}")
        db.executescript(SCHEMA)
        for table in ("files", "batches"):  # a store from before owners: its records become legacy
            if "owner" not in {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}:
                db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT '{LEGACY_OWNER}'")
        have = {r["name"] for r in db.execute("PRAGMA table_info(batches)")}
        for column, kind in (("home", "TEXT"), ("heard_at", "REAL"), ("runnable", "INTEGER")):
            if column not in have:  # a store from before replicas: every batch is this peer's own
                db.execute(f"ALTER TABLE batches ADD COLUMN {column} {kind}")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        self._db = db

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a full database or disk becomes StorageFull."""
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # SQLite may have rolled back itself (a full disk does)
                    db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            if _full(exc):
                raise StorageFull(self.full_message()) from None
            raise

    # -- room ----------------------------------------------------------------------------

    def used_bytes(self) -> int:
        pages, free, size = (self.db.execute(f"PRAGMA {p}").fetchone()[0]
                             for p in ("page_count", "freelist_count", "page_size"))
        return (pages - free) * size

    def full_message(self) -> str:
        disk = shutil.disk_usage(self.path.parent)
        return (f"batch storage is full: the store holds {self.used_bytes() >> 20} MiB of its "
                f"{self.max_bytes >> 20} MiB limit (batch_max_bytes) and the state disk has "
                f"{disk.free >> 20} MiB free; delete finished batches' files (DELETE /v1/files/ID) "
                f"or raise batch_max_bytes")

    def check_room(self, size: int) -> None:
        """Refuse an upload of ``size`` bytes that cannot fit (twice: the file and its parsed lines)."""
        disk = shutil.disk_usage(self.path.parent)
        if self.used_bytes() + 2 * size > self.max_bytes or disk.free < 2 * size + DISK_RESERVE_BYTES:
            raise StorageFull(f"no room for a {size >> 10} KiB file: " + self.full_message())

    # -- files ---------------------------------------------------------------------------

    def add_file(self, file_id: str, filename: str, purpose: str, src: IO[bytes], size: int,
                 owner: str = LEGACY_OWNER) -> dict:
        """Store an uploaded file, copied from ``src`` in chunks (never whole in memory)."""
        now = int(time.time())
        with self._tx() as db:
            cur = db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, kind, data, owner) "
                             "VALUES (?, ?, ?, ?, ?, 'input', zeroblob(?), ?)",
                             (file_id, purpose, filename, size, now, size, owner))
            if size:
                rowid = cast(int, cur.lastrowid)  # set: the INSERT just made the row
                with db.blobopen("files", "data", rowid) as blob:
                    while chunk := src.read(BLOB_CHUNK):
                        blob.write(chunk)
        return cast(dict, self.get_file(file_id))  # there: just written, on this thread

    def get_file(self, file_id: str) -> dict | None:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at, kind, batch_id, owner FROM files "
                              "WHERE id = ?", (file_id,)).fetchone()
        return dict(row) if row else None

    def list_files(self, purpose: str | None, limit: int, after: str | None, newest_first: bool,
                   owner: Owner | None = None) -> list[dict]:
        """A page of the files ``owner`` sees (None: all)."""
        order = "DESC" if newest_first else "ASC"
        where: list[str] = []
        args: list[object] = []
        if owner is not None:
            cond, values = owner.where()
            where.append(cond)
            args.extend(values)
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        if after:
            where.append(f"rowid {'<' if newest_first else '>'} (SELECT rowid FROM files WHERE id = ?)")
            args.append(after)
        sql = ("SELECT id, purpose, filename, bytes, created_at, kind, batch_id, owner FROM files"
               + (" WHERE " + " AND ".join(where) if where else "") + f" ORDER BY rowid {order} LIMIT ?")
        return [dict(r) for r in self.db.execute(sql, (*args, limit))]

    def read_input(self, file_id: str, offset: int, size: int = BLOB_CHUNK) -> bytes:
        """Up to ``size`` bytes of an uploaded file from ``offset`` (b"" at the end)."""
        row = self.db.execute("SELECT rowid, bytes FROM files WHERE id = ? AND kind = 'input'", (file_id,)).fetchone()
        if row is None or offset >= row["bytes"]:
            return b""
        with self.db.blobopen("files", "data", row["rowid"], readonly=True) as blob:
            blob.seek(offset)
            return blob.read(size)

    def results_page(self, batch_id: str, ok: bool, after_idx: int, limit: int) -> list[tuple[int, str]]:
        """(line, record) of a batch's results, in input order: an output or error file's content."""
        rows = self.db.execute("SELECT idx, record FROM results WHERE batch_id = ? AND ok = ? AND idx > ? "
                               "ORDER BY idx LIMIT ?", (batch_id, int(ok), after_idx, limit))
        return [(r["idx"], r["record"]) for r in rows]

    def delete_file(self, file_id: str) -> bool:
        """Delete a file: an input file's bytes, or the results an output/error file shows.
        Raises ValueError while a batch that is not finished reads it."""
        f = self.get_file(file_id)
        if f is None:
            return False
        with self._tx() as db:
            if f["kind"] == "input":
                busy = db.execute("SELECT id FROM batches WHERE input_file_id = ? AND status NOT IN "
                                  f"({','.join('?' * len(TERMINAL))})", (file_id, *TERMINAL)).fetchone()
                if busy:
                    raise ValueError(f"batch {busy['id']} is still running on this file; cancel it first")
            else:
                db.execute("DELETE FROM results WHERE batch_id = ? AND ok = ?",
                           (f["batch_id"], int(f["kind"] == "output")))
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.db.execute("PRAGMA incremental_vacuum")
        return True

    # -- batches -------------------------------------------------------------------------

    def create_batch(self, batch_id: str, input_file_id: str, endpoint: str, window: str, expires_at: int,
                     metadata: dict | None, owner: str = LEGACY_OWNER) -> dict:
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, metadata, status, "
                       "created_at, expires_at, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (batch_id, input_file_id, endpoint, window, json.dumps(metadata) if metadata else None,
                        Status.VALIDATING, int(time.time()), expires_at, owner))
        return self._own_batch(batch_id)

    def get_batch(self, batch_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return dict(row) if row else None

    def _own_batch(self, batch_id: str) -> dict:
        """A batch of this peer's own (home NULL) that it just wrote or runs: there, since only
        replicas are ever deleted."""
        return cast(dict, self.get_batch(batch_id))

    def list_batches(self, limit: int, after: str | None, owner: Owner | None = None) -> list[dict]:
        """A page of this peer's own batches that ``owner`` sees (None: all), newest first."""
        where: list[str] = ["home IS NULL"]
        args: list[object] = []
        if owner is not None:
            cond, values = owner.where()
            where.append(cond)
            args.extend(values)
        if after:
            where.append("rowid < (SELECT rowid FROM batches WHERE id = ?)")
            args.append(after)
        rows = self.db.execute("SELECT * FROM batches" + (" WHERE " + " AND ".join(where) if where else "")
                               + " ORDER BY rowid DESC LIMIT ?", (*args, limit))
        return [dict(r) for r in rows]

    def unfinished(self) -> list[dict]:
        """This peer's own batches that a restart must take up again, oldest first."""
        rows = self.db.execute(f"SELECT * FROM batches WHERE home IS NULL AND status NOT IN "
                               f"({','.join('?' * len(TERMINAL))}) ORDER BY rowid", tuple(TERMINAL))
        return [dict(r) for r in rows]

    def set_status(self, batch_id: str, status: Status, errors: list[dict] | None = None) -> dict | None:
        """The batch with its new status; None where it is not here (a cancel through the API
        may name a replica, which its home can release meanwhile)."""
        stamp = STAMP.get(status)
        with self._tx() as db:
            db.execute(f"UPDATE batches SET status = ?{f', {stamp} = ?' if stamp else ''}"
                       f"{', errors = ?' if errors is not None else ''} WHERE id = ?",
                       (status, *([int(time.time())] if stamp else []),
                        *([json.dumps(errors)] if errors is not None else []), batch_id))
        return self.get_batch(batch_id)

    def start_lines(self, batch_id: str, lines: list[Line], malformed: list[tuple[int, str]]) -> dict:
        """The validated input: runnable lines, and (line, error record) for the malformed ones,
        whose results are written now. One transaction, so a restart sees all or none."""
        with self._tx() as db:
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.executemany("INSERT INTO lines VALUES (?, ?, ?, ?)",
                           ((batch_id, ln.idx, ln.custom_id, json.dumps(ln.body, separators=(",", ":")))
                            for ln in lines))
            inserted = 0
            for idx, record in malformed:
                inserted += db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, 0, ?)",
                                       (batch_id, idx, record)).rowcount
            # A cancel that came while the file was parsed stands.
            db.execute("UPDATE batches SET total = ?, failed = failed + ?, in_progress_at = ?, "
                       "status = CASE status WHEN ? THEN status ELSE ? END WHERE id = ?",
                       (len(lines) + len(malformed), inserted, int(time.time()), Status.CANCELLING,
                        Status.IN_PROGRESS, batch_id))
        return self._own_batch(batch_id)

    def pending_lines(self, batch_id: str, after_idx: int, limit: int) -> list[Line]:
        """Lines with no result yet, in order, after ``after_idx``."""
        rows = self.db.execute(
            "SELECT l.idx, l.custom_id, l.body FROM lines l WHERE l.batch_id = ? AND l.idx > ? AND NOT EXISTS "
            "(SELECT 1 FROM results r WHERE r.batch_id = l.batch_id AND r.idx = l.idx) ORDER BY l.idx LIMIT ?",
            (batch_id, after_idx, limit))
        return [Line(r["idx"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def put_result(self, batch_id: str, idx: int, ok: bool, record: str, input_tokens: int,
                   output_tokens: int) -> bool:
        """Write a line's result and count it, in one transaction; False when the line
        already had one (nothing is written twice)."""
        with self._tx() as db:
            if db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                          (batch_id, idx, int(ok), record)).rowcount != 1:
                return False
            db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                       "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                       (int(ok), int(not ok), input_tokens, output_tokens, batch_id))
        return True

    def finish(self, batch_id: str, status: Status, errors: list[dict] | None = None) -> dict:
        """End a batch in ``status``: its parsed lines go, its output and error files
        (views of its results) appear, all in one transaction."""
        now = int(time.time())
        with self._tx() as db:
            sizes = {r["ok"]: (r["n"], r["size"]) for r in db.execute(
                "SELECT ok, COUNT(*) AS n, SUM(LENGTH(CAST(record AS BLOB)) + 1) AS size FROM results "
                "WHERE batch_id = ? GROUP BY ok", (batch_id,))}
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))  # first: frees room on a full store
            ids: dict[str, str | None] = {"output": None, "error": None}
            for kind, ok in (("output", 1), ("error", 0)):
                if sizes.get(ok, (0, 0))[0]:
                    ids[kind] = f"file-{batch_id.removeprefix('batch_')}{'o' if ok else 'e'}"
                    db.execute("INSERT OR REPLACE INTO files (id, purpose, filename, bytes, created_at, kind, "
                               "batch_id, owner) VALUES (?, 'batch_output', ?, ?, ?, ?, ?, "
                               "(SELECT owner FROM batches WHERE id = ?))",
                               (ids[kind], f"{batch_id}_{kind}.jsonl", sizes[ok][1], now, kind, batch_id,
                                batch_id))
            stamp = STAMP[status]
            db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?"
                       f"{', errors = ?' if errors is not None else ''} WHERE id = ?",
                       (status, now, ids["output"], ids["error"],
                        *([json.dumps(errors)] if errors is not None else []), batch_id))
        return self._own_batch(batch_id)

    # -- replicas: another peer's batches, kept here in case that peer is lost for good ----

    def snapshot(self, batch_id: str) -> tuple[dict, list[tuple[int, bool, str]]]:
        """A batch of this peer's and all its results, read together (one read on the
        store's thread, so the counts are those of exactly these results)."""
        rows = self.db.execute("SELECT idx, ok, record FROM results WHERE batch_id = ? ORDER BY idx", (batch_id,))
        results = [(r["idx"], bool(r["ok"]), r["record"]) for r in rows]
        batch = self._own_batch(batch_id)
        batch["runnable"] = self.db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ?", (batch_id,)).fetchone()[0]
        return batch, results

    def lines_page(self, batch_id: str, after_idx: int, limit: int) -> list[Line]:
        """A batch's runnable lines after ``after_idx``, whether they have a result or not."""
        rows = self.db.execute("SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND idx > ? "
                               "ORDER BY idx LIMIT ?", (batch_id, after_idx, limit))
        return [Line(r["idx"], r["custom_id"], json.loads(r["body"])) for r in rows]

    def hold_replica(self, home: str, batch: dict, lines: list[Line], results: list[tuple[int, bool, str, int, int]],
                     counts: dict | None = None, counted: bool = False) -> str:
        """Keep (or bring up to date) ``home``'s batch here. "taken" when this peer runs it
        now (it took it over), "conflict" when another peer's batch has its id, "need" when
        no replica of it is here and the call does not start one (``counts``: a snapshot's
        first part, whose counts are those of the snapshot's results), else "ok". Results
        ``counted`` (a snapshot's) are in the counts already; any other adds its own tokens,
        once, however often it comes."""
        with self._tx() as db:
            row = db.execute("SELECT home FROM batches WHERE id = ?", (batch["id"],)).fetchone()
            if row is not None and row["home"] is None:
                return "taken"
            if row is not None and row["home"] != home:
                return "conflict"
            if row is None and counts is None:
                return "need"
            if counts is not None:
                db.execute("DELETE FROM batches WHERE id = ?", (batch["id"],))
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch["id"],))
                db.execute("DELETE FROM results WHERE batch_id = ?", (batch["id"],))
                db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, metadata, status, "
                           "created_at, expires_at, in_progress_at, owner, home, runnable, total, completed, failed, "
                           "input_tokens, output_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           (batch["id"], batch["input_file_id"], batch["endpoint"], batch["completion_window"],
                            json.dumps(batch["metadata"]) if batch["metadata"] else None, batch["status"],
                            batch["created_at"], batch["expires_at"], batch["in_progress_at"], batch["owner"], home,
                            batch["runnable"], batch["total"], counts["completed"], counts["failed"],
                            counts["input_tokens"], counts["output_tokens"]))
            db.execute("UPDATE batches SET status = ?, heard_at = ? WHERE id = ?",
                       (batch["status"], time.time(), batch["id"]))
            db.executemany("INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?)",
                           ((batch["id"], ln.idx, ln.custom_id, json.dumps(ln.body, separators=(",", ":")))
                            for ln in lines))
            for idx, ok, record, tokens_in, tokens_out in results:
                if db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
                              (batch["id"], idx, int(ok), record)).rowcount == 1 and not counted:
                    db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                               "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                               (int(ok), int(not ok), tokens_in, tokens_out, batch["id"]))
        return "ok"

    def drop_replica(self, home: str, batch_id: str) -> bool:
        """Forget ``home``'s batch (it ended there, or another peer holds it now)."""
        with self._tx() as db:
            if db.execute("DELETE FROM batches WHERE id = ? AND home = ?", (batch_id, home)).rowcount != 1:
                return False
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
        self.db.execute("PRAGMA incremental_vacuum")
        return True

    def replicas(self) -> list[dict]:
        """The replicas held here: id, home, heard_at, status, total, completed, failed."""
        rows = self.db.execute("SELECT id, home, heard_at, status, total, completed, failed FROM batches "
                               "WHERE home IS NOT NULL ORDER BY rowid")
        return [dict(r) for r in rows]

    def take_over(self, batch_id: str) -> dict | None:
        """Make a replica this peer's own batch, to run its lines that have no result; None
        (nothing changes) when the replica is missing lines its home had."""
        with self._tx() as db:
            row = db.execute("SELECT runnable, (SELECT COUNT(*) FROM lines WHERE batch_id = ?) AS n FROM batches "
                             "WHERE id = ? AND home IS NOT NULL", (batch_id, batch_id)).fetchone()
            if row is None or row["n"] != row["runnable"]:
                return None
            # The lines counted are those with a result here (a snapshot cut short by its
            # home's loss may have counted more); the ones without run here.
            db.execute("UPDATE batches SET home = NULL, heard_at = NULL, runnable = NULL, "
                       "completed = (SELECT COUNT(*) FROM results WHERE batch_id = ?1 AND ok = 1), "
                       "failed = (SELECT COUNT(*) FROM results WHERE batch_id = ?1 AND ok = 0) WHERE id = ?1",
                       (batch_id,))
        return self.get_batch(batch_id)
