"""The Batch API keeps an owner on every file and batch (issue #32, item 4), on real
``meshd run`` daemons (tiny model).

``keyed``: a daemon with two API keys. The owner of the first key uploads a file and
runs a batch; an attacker with the second key, a separate process, tries every route
on them, over and over: each is a 404 (or, as a batch's input, a 400 that says no such
file), and its lists never show them, while the first key's client is served and its
files stay whole. ``keyless``: a daemon without keys whose state dir holds a batch
store from before owners (schema 1): it loads, its records are the operator's (callers
on the box see them), and two client addresses (127.0.0.1, 127.0.0.2) keep their own
files and batches apart.
"""

from __future__ import annotations

import http.client
import json
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

from meshd.serving.batchstore import DB_NAME
from tests.fixtures.daemon import running_daemon
from tests.honest import Honest

pytestmark = pytest.mark.timeout(300)

KEY_A, KEY_B = "sk-owner-a-" + uuid.uuid4().hex, "sk-owner-b-" + uuid.uuid4().hex
ROUNDS = 10
EP = "/v1/completions"


def call(url: str, method: str, path: str, body=None, key: str | None = None, source: str | None = None,
         multipart: tuple[str, bytes] | None = None) -> tuple[int, object]:
    """One request (from ``source``, an address of this box, when given); (status, JSON or bytes)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0) if source else None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if multipart is not None:
        boundary = uuid.uuid4().hex
        name, content = multipart
        data = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
        headers["Content-Type"] = f"multipart/form-data; boundary={boundary}"
    elif body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        c.request(method, path, data, headers)
        r = c.getresponse()
        raw = r.read()
        if (r.getheader("Content-Type") or "").startswith("application/json"):
            return r.status, json.loads(raw)
        return r.status, raw  # a file's content
    finally:
        c.close()


def batch_input(n: int, tag: str) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{tag}{i}", "method": "POST", "url": EP,
                                "body": {"prompt": f"{tag} {i}", "max_tokens": 3}}).encode() + b"\n"
                    for i in range(n))


def run_batch(url: str, key: str | None = None, source: str | None = None, tag: str = "a") -> tuple[dict, dict]:
    """Upload a file and run a batch on it to the end: (file, batch)."""
    status, f = call(url, "POST", "/v1/files", key=key, source=source, multipart=(f"{tag}.jsonl", batch_input(3, tag)))
    assert status == 200, f
    status, b = call(url, "POST", "/v1/batches", {"input_file_id": f["id"], "endpoint": EP,
                                                  "completion_window": "24h"}, key=key, source=source)
    assert status == 200, b
    deadline = time.monotonic() + 60
    while b["status"] not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < deadline:
        time.sleep(0.1)
        b = call(url, "GET", f"/v1/batches/{b['id']}", key=key, source=source)[1]
    assert b["status"] == "completed", b
    return f, b


# The attacker: a separate process with the second key, trying every route on the first
# key's file, output file and batch; prints (what, status, body) as JSON lines.
ATTACKER = r"""
import http.client, json, sys, uuid
url, key, rounds, fid, oid, bid = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
host, port = url.removeprefix("http://").rsplit(":", 1)
def go(method, path, body=None):
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    c.request(method, path, None if body is None else json.dumps(body), h)
    r = c.getresponse(); raw = r.read(); c.close()
    try: return r.status, json.loads(raw)
    except ValueError: return r.status, raw.decode(errors="replace")
for _ in range(rounds):
    for what, method, path, body in (
            ("get_file", "GET", f"/v1/files/{fid}", None), ("get_output", "GET", f"/v1/files/{oid}", None),
            ("content", "GET", f"/v1/files/{fid}/content", None), ("output", "GET", f"/v1/files/{oid}/content", None),
            ("get_batch", "GET", f"/v1/batches/{bid}", None), ("cancel", "POST", f"/v1/batches/{bid}/cancel", {}),
            ("reuse", "POST", "/v1/batches", {"input_file_id": fid, "endpoint": "/v1/completions",
                                              "completion_window": "24h"}),
            ("list_files", "GET", "/v1/files", None), ("list_batches", "GET", "/v1/batches", None),
            ("delete_output", "DELETE", f"/v1/files/{oid}", None), ("delete", "DELETE", f"/v1/files/{fid}", None)):
        status, data = go(method, path, body)
        print(json.dumps({"what": what, "status": status, "body": data}), flush=True)
"""


def honest_client(url: str, key: str | None) -> Honest:
    """The first key's client: /healthz and a short completion, over and over."""
    return Honest(lambda path, body: call(url, "GET" if body is None else "POST", path, body, key=key),
                  (("/healthz", None), (EP, {"prompt": "Hi", "max_tokens": 2})))


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("batch-owners")
    keys = base / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    keys.chmod(0o600)
    with running_daemon(tiny_model_dir, base / "state", base / "meshd.log", "--threads", "1",
                        "--api-key-file", str(keys)) as served:
        yield served


def test_a_second_key_cannot_see_read_delete_or_cancel_the_first_keys_batch(keyed):
    f, b = run_batch(keyed.url, KEY_A)
    oid = b["output_file_id"]
    want_content = call(keyed.url, "GET", f"/v1/files/{oid}/content", key=KEY_A)[1]
    with honest_client(keyed.url, KEY_A) as honest:
        out = subprocess.run([sys.executable, "-c", ATTACKER, keyed.url, KEY_B, str(ROUNDS), f["id"], oid, b["id"]],
                             capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == 11 * ROUNDS
    for a in answers:
        if a["what"] == "reuse":  # as OpenAI answers a file id it does not know
            assert a["status"] == 400 and a["body"]["error"]["param"] == "input_file_id", a
        elif a["what"].startswith("list_"):
            assert a["status"] == 200 and a["body"]["data"] == [], a
        else:
            assert a["status"] == 404, a
            err = a["body"]["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "not_found" and err["message"], a
    honest.assert_live()
    # The first key still has everything, whole.
    assert call(keyed.url, "GET", f"/v1/files/{f['id']}/content", key=KEY_A)[1] == batch_input(3, "a")
    assert call(keyed.url, "GET", f"/v1/files/{oid}/content", key=KEY_A)[1] == want_content
    assert call(keyed.url, "GET", f"/v1/batches/{b['id']}", key=KEY_A)[1]["status"] == "completed"
    listed = call(keyed.url, "GET", "/v1/files", key=KEY_A)[1]["data"]
    assert {f["id"], oid} <= {x["id"] for x in listed}
    assert [x["id"] for x in call(keyed.url, "GET", "/v1/batches", key=KEY_A)[1]["data"]] == [b["id"]]
    # The second key's own batch runs, and is the only one it lists.
    _, b2 = run_batch(keyed.url, KEY_B, tag="b")
    assert [x["id"] for x in call(keyed.url, "GET", "/v1/batches", key=KEY_B)[1]["data"]] == [b2["id"]]
    assert call(keyed.url, "GET", f"/v1/batches/{b2['id']}", key=KEY_A)[0] == 404


# -- a store from before owners, and owners by address --------------------------------------

V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, kind TEXT NOT NULL, batch_id TEXT, data BLOB);
CREATE TABLE batches (id TEXT PRIMARY KEY, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0, output_file_id TEXT,
    error_file_id TEXT, created_at INTEGER NOT NULL, expires_at INTEGER, in_progress_at INTEGER,
    finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER,
    cancelled_at INTEGER);
CREATE TABLE lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
CREATE TABLE results (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)) WITHOUT ROWID;
INSERT INTO meta VALUES ('schema', '1');
"""


def write_v1_store(state_dir) -> None:
    """A batch store as meshd wrote it before owners: one input file, one completed batch
    with its output file and one result."""
    state_dir.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(state_dir / DB_NAME)
    db.executescript(V1_SCHEMA)
    data = batch_input(1, "old")
    db.execute("INSERT INTO files VALUES ('file-old', 'batch', 'old.jsonl', ?, 1, 'input', NULL, ?)", (len(data), data))
    record = json.dumps({"id": "batch_req_old", "custom_id": "old0", "response": {"status_code": 200}})
    db.execute("INSERT INTO results VALUES ('batch_old', 1, 1, ?)", (record,))
    db.execute("INSERT INTO files VALUES ('file-oldo', 'batch_output', 'batch_old_output.jsonl', ?, 2, 'output', "
               "'batch_old', NULL)", (len(record) + 1,))
    db.execute("INSERT INTO batches (id, input_file_id, endpoint, completion_window, status, total, completed, "
               "output_file_id, created_at, completed_at) VALUES ('batch_old', 'file-old', ?, '24h', 'completed', "
               "1, 1, 'file-oldo', 1, 2)", (EP,))
    db.commit()
    db.close()


def test_a_store_from_before_owners_loads_and_addresses_keep_their_batches_apart(tiny_model_dir, tmp_path):
    write_v1_store(tmp_path / "state")
    with running_daemon(tiny_model_dir, tmp_path / "state", tmp_path / "meshd.log", "--threads", "1") as served:
        # The old records are the operator's: any caller on the box (here, all of them).
        for source in ("127.0.0.1", "127.0.0.2"):
            status, b = call(served.url, "GET", "/v1/batches/batch_old", source=source)
            assert status == 200 and b["status"] == "completed" and b["output_file_id"] == "file-oldo", b
            assert call(served.url, "GET", "/v1/files/file-old/content", source=source)[1] == batch_input(1, "old")
        # New ones belong to the address that made them.
        f1, b1 = run_batch(served.url, source="127.0.0.1", tag="one")
        with honest_client(served.url, None) as honest:
            for _ in range(ROUNDS):
                for method, path in (("GET", f"/v1/batches/{b1['id']}"), ("GET", f"/v1/files/{f1['id']}/content"),
                                     ("GET", f"/v1/files/{b1['output_file_id']}/content"),
                                     ("POST", f"/v1/batches/{b1['id']}/cancel"), ("DELETE", f"/v1/files/{f1['id']}")):
                    status, data = call(served.url, method, path, {} if method == "POST" else None,
                                        source="127.0.0.2")
                    assert status == 404 and data["error"]["code"] == "not_found", (path, status, data)
                listed = call(served.url, "GET", "/v1/batches", source="127.0.0.2")[1]["data"]
                assert [x["id"] for x in listed] == ["batch_old"], listed
        honest.assert_live()
        listed = call(served.url, "GET", "/v1/batches", source="127.0.0.1")[1]["data"]
        assert [x["id"] for x in listed] == [b1["id"], "batch_old"], listed
        assert call(served.url, "GET", f"/v1/files/{f1['id']}/content", source="127.0.0.1")[1] == batch_input(3, "one")
