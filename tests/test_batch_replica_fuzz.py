"""A peer's replica calls are input like any other: whatever a member sends to
``/mesh/batch-replica`` (random JSON, a valid call with one field replaced, bytes that
are not JSON, nesting deep enough to break a recursive parser, strings SQLite cannot
store) is answered 200 or 400, never raises out of the handler (which would leave the
caller waiting and the tunnel task dead), and a 400 changes nothing in the store. A
peer can write only its own batches: another peer's id is a conflict."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.serving.batch import BatchRunner
from meshd.serving.batchstore import DB_NAME
from tests.mutate import at, paths, replaced

BATCH = "batch_" + "a" * 24
HEAD = {"id": BATCH, "status": "in_progress", "input_file_id": "file-" + "b" * 24, "endpoint": "/v1/completions",
        "completion_window": "24h", "created_at": 1, "expires_at": 2**40, "in_progress_at": 2, "owner": "key-hash",
        "runnable": 1, "total": 2, "metadata": {"k": "v"}}
COUNTS = {"completed": 1, "failed": 0, "input_tokens": 3, "output_tokens": 4}
SYNC = {"op": "sync", "batch": HEAD, "counts": COUNTS, "counted": True,
        "lines": [[1, "a", {"prompt": "hi", "max_tokens": 4}], [2, "b", {"prompt": "yo", "max_tokens": 4}]],
        "results": [[1, True, '{"id": "x"}', 3, 4]]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)


PATHS = [p for p in paths(SYNC) if p]


@st.composite
def calls(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "replaced", "dropped", "bytes"]))
    if kind == "random":
        return json.dumps(draw(json_values)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    path = draw(st.sampled_from(PATHS))
    *parent, key = path
    target = at(SYNC, parent)
    if kind == "dropped" and isinstance(target, dict):
        return json.dumps(replaced(SYNC, tuple(parent), {k: v for k, v in target.items() if k != key})).encode()
    return json.dumps(replaced(SYNC, path, draw(json_values))).encode()


HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,  # deeper than any recursive parser goes
    json.dumps({"op": "sync", "batch": HEAD, "counts": COUNTS,
                "lines": [[1, "a", {"p": json.loads("[" * 900 + "]" * 900)}]]}).encode(),
    json.dumps(replaced(SYNC, ("lines", 0, 1), "\ud800")).encode(),  # a lone surrogate: SQLite cannot store it
    json.dumps(replaced(SYNC, ("batch", "owner"), "\udfff")).encode(),
    json.dumps(replaced(SYNC, ("batch", "metadata"), {"\ud800": 1})).encode(),
    json.dumps(replaced(SYNC, ("lines", 0, 0), 2**63)).encode(),
    json.dumps({"op": "drop", "id": BATCH + "\x00"}).encode(),
]


@pytest.fixture
def runner(tmp_path):
    node = SimpleNamespace(config=SimpleNamespace(state_dir=tmp_path, batch_max_bytes=64 << 20))
    r = BatchRunner(node)
    r.store.open()
    r.unavailable = None
    yield r
    r.store.close()


def _dump(runner: BatchRunner) -> list:
    db = sqlite3.connect(runner.store.path)
    try:
        return [db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in ("batches", "lines", "results")]
    finally:
        db.close()


def _call(runner: BatchRunner, peer: str, raw: bytes) -> tuple[int, dict]:
    status, body = asyncio.run(runner.on_replica(peer, raw))
    return status, json.loads(body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=calls())
def test_any_replica_call_is_answered_and_a_refused_one_changes_nothing(runner, raw):
    before = _dump(runner)
    status, body = _call(runner, "peer-1", raw)
    assert status in (200, 400), (status, body)
    if status == 400:
        assert "malformed replica call" in body["error"]["message"]
        assert _dump(runner) == before


@pytest.mark.parametrize("raw", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_replica_calls_are_refused_and_change_nothing(runner, raw):
    status, body = _call(runner, "peer-1", raw)
    assert status == 400, body
    assert _dump(runner) == [[], [], []]
    assert _call(runner, "peer-1", json.dumps(SYNC).encode()) == (200, {"answer": "ok"})  # still serving


def test_a_peer_cannot_write_or_drop_another_peers_replica(runner):
    assert _call(runner, "peer-1", json.dumps(SYNC).encode()) == (200, {"answer": "ok"})
    held = _dump(runner)
    assert _call(runner, "peer-2", json.dumps(SYNC).encode()) == (200, {"answer": "conflict"})
    result = {"op": "sync", "batch": {"id": BATCH, "status": "in_progress"}, "results": [[2, True, '{"id": "y"}', 1, 1]]}
    assert _call(runner, "peer-2", json.dumps(result).encode()) == (200, {"answer": "conflict"})
    assert _call(runner, "peer-2", json.dumps({"op": "drop", "id": BATCH}).encode()) == (200, {"answer": "ok"})
    assert _dump(runner) == held
