"""The batch store and the input checks, without a daemon: what a restart finds, results
written at most once, malformed lines kept with their custom_id, the size bound."""

from __future__ import annotations

import io
import json

import pytest

from meshd.errors import StorageFull
from meshd.serving.batchinput import check_line, split_lines, validate_input
from meshd.serving.batchstore import DB_NAME, BatchStore, Line, Status

EP = "/v1/completions"


def line(cid: str, prompt: str = "hi", **over) -> bytes:
    item = {"custom_id": cid, "method": "POST", "url": EP, "body": {"prompt": prompt, "max_tokens": 4}} | over
    return json.dumps(item).encode()


@pytest.fixture
def store(tmp_path):
    s = BatchStore(tmp_path / DB_NAME, 64 << 20)
    s.open()
    yield s
    s.close()


def upload(store: BatchStore, data: bytes, file_id: str = "file-1") -> str:
    store.add_file(file_id, "in.jsonl", "batch", io.BytesIO(data), len(data))
    return file_id


def test_lines_split_across_chunks_with_numbers_and_blank_lines_skipped():
    data = b"a\n\nbb\r\n  \nccc"
    chunks = {0: data[:3], 3: data[3:7], 7: data[7:]}
    assert list(split_lines(lambda off: chunks.get(off, b""))) == [(1, b"a"), (3, b"bb\r"), (5, b"ccc")]


@pytest.mark.parametrize("raw, cid, why", [
    (b'{"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"', "c1", "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (line("c2", method="GET"), "c2", "method"),
    (line("c3", url="/v1/embeddings"), "c3", "endpoint"),
    (line("c4", body="text"), "c4", "body must be"),
    (line("c5", extra=1), "c5", "unknown field 'extra'"),
    (line("c6", body={"prompt": "x", "stream": True}), "c6", "stream"),
    (json.dumps({"custom_id": 7, "method": "POST", "url": EP, "body": {}}).encode(), None, "custom_id"),
])
def test_a_malformed_line_is_named_with_its_custom_id(raw, cid, why):
    got = check_line(raw, 3, EP, {})
    assert not isinstance(got, Line)
    assert got[0] == cid and why in got[1] and "line 3" in got[1]


def test_a_repeated_custom_id_is_malformed():
    seen: dict[str, int] = {}
    assert isinstance(check_line(line("same"), 1, EP, seen), Line)
    got = check_line(line("same"), 2, EP, seen)
    assert got == ("same", "line 2: custom_id 'same' is already used on line 1")


def test_validation_keeps_good_lines_and_records_bad_ones(store):
    data = b"\n".join([line("a"), b"{not json, \"custom_id\": \"b\"", line("c"), line("a")]) + b"\n"
    upload(store, data)
    store.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
    row = validate_input(store, "batch_1", "file-1", EP)
    assert row["status"] == Status.IN_PROGRESS and row["total"] == 4 and row["failed"] == 2
    assert [ln.custom_id for ln in store.pending_lines("batch_1", 0, 10)] == ["a", "c"]
    errors = [json.loads(r) for _, r in store.results_page("batch_1", False, 0, 10)]
    assert [e["custom_id"] for e in errors] == ["b", "a"]
    assert all(e["response"] is None and e["error"]["message"] for e in errors)


def test_an_empty_file_fails_the_batch(store):
    upload(store, b"\n  \n")
    store.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
    row = validate_input(store, "batch_1", "file-1", EP)
    assert row["status"] == Status.FAILED and json.loads(row["errors"])[0]["code"] == "empty_file"


def test_a_result_is_written_once_and_counted_once(store):
    upload(store, line("a") + b"\n" + line("b"))
    store.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
    validate_input(store, "batch_1", "file-1", EP)
    assert store.put_result("batch_1", 1, True, '{"first": 1}', 3, 5)
    assert not store.put_result("batch_1", 1, True, '{"second": 1}', 3, 5)
    row = store.get_batch("batch_1")
    assert (row["completed"], row["failed"], row["output_tokens"]) == (1, 0, 5)
    assert store.results_page("batch_1", True, 0, 10) == [(1, '{"first": 1}')]
    assert [ln.idx for ln in store.pending_lines("batch_1", 0, 10)] == [2]


def test_a_reopened_store_resumes_where_it_stopped(tmp_path):
    s = BatchStore(tmp_path / DB_NAME, 64 << 20)
    s.open()
    upload(s, b"\n".join(line(f"c{i}") for i in range(5)))
    s.create_batch("batch_1", "file-1", EP, "24h", 2**31, {"k": "v"})
    validate_input(s, "batch_1", "file-1", EP)
    s.put_result("batch_1", 2, True, "{}", 1, 1)
    s.close()
    again = BatchStore(tmp_path / DB_NAME, 64 << 20)
    again.open()
    try:
        assert [r["id"] for r in again.unfinished()] == ["batch_1"]
        assert [ln.idx for ln in again.pending_lines("batch_1", 0, 10)] == [1, 3, 4, 5]
        assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        again.close()


def test_finish_makes_output_and_error_files_of_the_results(store):
    upload(store, line("a") + b"\n" + line("b") + b"\n" + b"junk")
    store.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
    validate_input(store, "batch_1", "file-1", EP)
    store.put_result("batch_1", 1, True, '{"r": "é"}', 1, 2)
    store.put_result("batch_1", 2, False, '{"e": 1}', 0, 0)
    row = store.finish("batch_1", Status.COMPLETED)
    assert row["status"] == Status.COMPLETED and row["completed_at"]
    out, err = store.get_file(row["output_file_id"]), store.get_file(row["error_file_id"])
    assert out["bytes"] == len('{"r": "é"}\n'.encode()) and out["purpose"] == "batch_output"
    errors = store.results_page("batch_1", False, 0, 9)
    assert [idx for idx, _ in errors] == [2, 3] and errors[0][1] == '{"e": 1}'
    assert err["bytes"] == sum(len(r.encode()) + 1 for _, r in errors)
    assert store.pending_lines("batch_1", 0, 10) == []
    # Deleting the output file deletes the results it shows; the input needs its batch to be over.
    assert store.delete_file(row["output_file_id"])
    assert store.results_page("batch_1", True, 0, 10) == []
    assert store.delete_file("file-1")


def test_an_input_file_of_a_running_batch_cannot_be_deleted(store):
    upload(store, line("a"))
    store.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
    with pytest.raises(ValueError, match="batch_1"):
        store.delete_file("file-1")


def test_the_size_bound_refuses_uploads_and_writes_with_a_clear_error(tmp_path):
    s = BatchStore(tmp_path / DB_NAME, 1 << 20)
    s.open()
    try:
        with pytest.raises(StorageFull, match="batch_max_bytes"):
            s.check_room(600 << 10)
        upload(s, b"x" * (300 << 10))
        s.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
        with pytest.raises(StorageFull, match="batch storage is full"):
            for i in range(10_000):
                s.put_result("batch_1", i, True, "y" * 1000, 0, 0)
        # Nothing half-written: every result that went in was counted.
        row = s.get_batch("batch_1")
        assert row["completed"] == len(s.results_page("batch_1", True, -1, 100_000)) > 0
        # and the store still works (reads, and a finish that frees the parsed lines).
        assert s.finish("batch_1", Status.FAILED, [{"code": "storage_full"}])["status"] == Status.FAILED
    finally:
        s.close()



def test_owners_see_their_own_and_only_the_operator_sees_records_from_before_owners(tmp_path):
    """Schema 1 had no owners: reopened, its records are ``legacy``, which callers on the
    peer's own box see and a remote client does not; new records are their owner's."""
    import sqlite3

    from meshd.serving.batchstore import LEGACY_OWNER, Owner

    path = tmp_path / DB_NAME
    old = sqlite3.connect(path)
    old.executescript("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                      "CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, "
                      "bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, kind TEXT NOT NULL, batch_id TEXT, "
                      "data BLOB); INSERT INTO meta VALUES ('schema', '1');"
                      "INSERT INTO files VALUES ('file-old', 'batch', 'old.jsonl', 0, 1, 'input', NULL, x'');")
    old.commit()
    old.close()
    s = BatchStore(path, 64 << 20)
    s.open()
    try:
        assert s.get_file("file-old")["owner"] == LEGACY_OWNER
        data = line("x") + b"\n"
        s.add_file("file-new", "new.jsonl", "batch", io.BytesIO(data), len(data), "addr:10.0.0.9")
        s.create_batch("batch_new", "file-new", EP, "24h", 2**31, None, "addr:10.0.0.9")
        s.finish("batch_new", Status.COMPLETED)
        remote, other, operator = Owner("addr:10.0.0.9"), Owner("addr:10.0.0.10"), Owner("addr:127.0.0.1", local=True)
        ids = lambda o: {f["id"] for f in s.list_files(None, 100, None, True, o)}  # noqa: E731
        assert ids(remote) == {"file-new"} and ids(other) == set() and ids(operator) == {"file-old"}
        assert [b["id"] for b in s.list_batches(10, None, remote)] == ["batch_new"]
        assert s.list_batches(10, None, other) == []
        assert operator.sees(s.get_file("file-old")) and not remote.sees(s.get_file("file-old"))
        assert s.db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0] == "3"
    finally:
        s.close()


def _replicate(home: BatchStore, holder: BatchStore, batch_id: str) -> str:
    """What a home's snapshot carries to its holder, through the two stores' own methods."""
    batch, results = home.snapshot(batch_id)
    head = {k: batch[k] for k in ("id", "status", "input_file_id", "endpoint", "completion_window", "created_at",
                                  "expires_at", "in_progress_at", "owner", "runnable", "total")}
    head["metadata"] = json.loads(batch["metadata"]) if batch["metadata"] else None
    counts = {k: batch[k] for k in ("completed", "failed", "input_tokens", "output_tokens")}
    assert holder.hold_replica("home-1", head, [], [(i, ok, r, 0, 0) for i, ok, r in results], counts, True) == "ok"
    return holder.hold_replica("home-1", head, home.lines_page(batch_id, 0, 100), [])


def test_a_replica_holds_a_peers_batch_apart_until_taken_over_and_then_runs_what_is_left(tmp_path):
    home, holder = (BatchStore(tmp_path / name / DB_NAME, 64 << 20) for name in ("home", "holder"))
    home.open()
    holder.open()
    try:
        upload(home, b"\n".join([line("a"), line("b"), b"junk", line("d")]))
        home.create_batch("batch_1", "file-1", EP, "24h", 2**31, {"k": "v"}, owner="key-hash")
        validate_input(home, "batch_1", "file-1", EP)
        home.put_result("batch_1", 1, True, '{"a": 1}', 2, 5)
        assert _replicate(home, holder, "batch_1") == "ok"
        # Apart: the holder's own listings, restarts and API never see another peer's batch.
        assert holder.list_batches(10, None) == [] and holder.unfinished() == []
        assert [(r["id"], r["home"]) for r in holder.replicas()] == [("batch_1", "home-1")]
        # Later results: each counted once, however often it comes; the batch's status follows.
        result = (2, True, '{"b": 1}', 3, 7)
        head = {"id": "batch_1", "status": Status.IN_PROGRESS}
        assert holder.hold_replica("home-1", head, [], [result]) == "ok"
        assert holder.hold_replica("home-1", head, [], [result]) == "ok"
        row = holder.get_batch("batch_1")
        assert (row["completed"], row["failed"], row["output_tokens"], row["owner"]) == (1 + 1, 1, 5 + 7, "key-hash")
        # Another peer cannot write to it; a sync for a batch the holder lost asks for a copy.
        assert holder.hold_replica("home-2", head, [], [result]) == "conflict"
        assert holder.hold_replica("home-1", head | {"id": "batch_2"}, [], []) == "need"
        taken = holder.take_over("batch_1")
        assert taken["home"] is None and (taken["completed"], taken["failed"]) == (2, 1)
        assert [ln.custom_id for ln in holder.pending_lines("batch_1", 0, 10)] == ["d"]
        assert [r["id"] for r in holder.unfinished()] == ["batch_1"] and holder.replicas() == []
        # The home, back, is told its batch runs elsewhere now.
        assert holder.hold_replica("home-1", head, [], []) == "taken"
    finally:
        home.close()
        holder.close()


def test_a_replica_missing_lines_is_not_taken_over_and_a_dropped_one_is_gone(tmp_path):
    home, holder = (BatchStore(tmp_path / name / DB_NAME, 64 << 20) for name in ("home", "holder"))
    home.open()
    holder.open()
    try:
        upload(home, b"\n".join(line(f"c{i}") for i in range(3)))
        home.create_batch("batch_1", "file-1", EP, "24h", 2**31, None)
        validate_input(home, "batch_1", "file-1", EP)
        batch, _ = home.snapshot("batch_1")
        head = {k: batch[k] for k in ("id", "status", "input_file_id", "endpoint", "completion_window", "created_at",
                                      "expires_at", "in_progress_at", "owner", "runnable", "total")} | {"metadata": None}
        zero = dict.fromkeys(("completed", "failed", "input_tokens", "output_tokens"), 0)
        holder.hold_replica("home-1", head, home.lines_page("batch_1", 0, 2), [], zero, True)  # cut short
        assert holder.take_over("batch_1") is None and holder.unfinished() == []
        assert not holder.drop_replica("home-2", "batch_1")  # only its home drops it
        assert holder.drop_replica("home-1", "batch_1") and holder.replicas() == []
        assert holder.pending_lines("batch_1", 0, 10) == []
    finally:
        home.close()
        holder.close()
