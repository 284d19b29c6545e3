"""The Batch API's endpoints on every peer: /v1/files and /v1/batches, in OpenAI's shapes.

A batch lives on the peer it was submitted to: ask that peer for it. Uploads stream to
a spool file in the state directory and then into the store, never whole in memory.

Every file and batch has an owner (``guards.owner_of``: the API key's hash, or the
client's address on a peer without keys). Another owner gets a 404 for it, as if it
did not exist, on get, content, delete, cancel and as an input file, and never sees it
listed, as OpenAI's API behaves across projects.
"""

from __future__ import annotations

import errno
import json
import re
import tempfile

from aiohttp import BodyPartReader, web

from meshd.errors import BadRequest, NoCapacity, StorageFull
from meshd.serving.api import read_json
from meshd.serving.batch import BatchRunner
from meshd.serving.daemon import NODE
from meshd.serving.batchinput import ENDPOINTS, new_id
from meshd.serving.batchstore import TERMINAL, Owner, Status
from meshd.serving.guards import bearer_key, local_caller, owner_of
from meshd.serving.openai import find_surrogate

MAX_FILE_BYTES = 200 << 20  # OpenAI's limit for a batch input file
SPOOL_IN_MEMORY = 1 << 20
UPLOAD_CHUNK = 1 << 16
FIELD_LIMIT = 1024  # bytes of a form field other than the file
MAX_FILENAME = 255
WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")
MAX_WINDOW_H = 24 * 30  # meshd accepts any whole number of hours up to 30 days; OpenAI only "24h"
CREATE_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})
RESULTS_PAGE = 1000


def _runner(request: web.Request) -> BatchRunner:
    runner = request.app[NODE].batches
    if runner.unavailable:
        raise NoCapacity(f"batch jobs are not available on this peer now: {runner.unavailable}")
    return runner


def _owner(request: web.Request) -> Owner:
    return Owner(owner_of(request, bool(request.app[NODE].api_keys), bearer_key(request)), local_caller(request))


# -- shapes --------------------------------------------------------------------------------


def file_json(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def batch_json(row: dict, model: str, runner: BatchRunner | None = None) -> dict:
    tokens_in, tokens_out = row["input_tokens"], row["output_tokens"]
    out = {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": model,
        "errors": {"object": "list", "data": json.loads(row["errors"])} if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        **{k: row[k] for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                               "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "usage": {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": tokens_out, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": tokens_in + tokens_out},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }
    job = runner.jobs.get(row["id"]) if runner is not None else None
    if job is not None:  # meshd extension: the running job's recent rates
        view = job.view()
        out["meshd_progress"] = {k: view[k] for k in ("tokens_per_s", "lines_per_s", "eta_s")}
    return out


def _limit(request: web.Request, default: int = 20) -> int:
    raw = request.query.get("limit", str(default))
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 3 or not 1 <= int(raw) <= 100:
        raise BadRequest("limit must be an integer from 1 to 100", param="limit")
    return int(raw)


def _page(items: list[dict], limit: int) -> dict:
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


# -- files ---------------------------------------------------------------------------------


async def _small_field(part: BodyPartReader) -> str:
    data = b""
    while chunk := await part.read_chunk(FIELD_LIMIT):
        data += chunk
        if len(data) > FIELD_LIMIT:
            raise BadRequest(f"form field {part.name} is longer than {FIELD_LIMIT} bytes", param=part.name)
    return data.decode("utf-8", "replace").strip()


async def upload_file(request: web.Request) -> web.Response:
    """POST /v1/files: multipart ``purpose=batch`` and ``file`` (JSONL)."""
    runner = _runner(request)
    store = runner.store
    if not request.content_type.startswith("multipart/"):
        raise BadRequest("POST /v1/files takes multipart/form-data with the fields purpose and file", param="file")
    room = (store.max_bytes - await store.do(store.used_bytes)) // 2  # the file, and its parsed lines
    limit = min(MAX_FILE_BYTES, room)
    if request.content_length is not None and request.content_length > MAX_FILE_BYTES + FIELD_LIMIT * 4:
        raise BadRequest(f"a batch file is at most {MAX_FILE_BYTES >> 20} MiB", 413, param="file")
    purpose, filename, size = None, None, 0
    spool = tempfile.SpooledTemporaryFile(SPOOL_IN_MEMORY, dir=str(store.path.parent), prefix="upload-")
    try:
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader):
                raise BadRequest("nested multipart bodies are not supported", param="file")
            if part.name == "purpose":
                purpose = await _small_field(part)
            elif part.name == "file":
                # aiohttp keeps a name's bytes that are not UTF-8 as surrogates, which the store
                # cannot write as text: they become U+FFFD, as a browser shows them.
                filename = (part.filename or "upload.jsonl")[:MAX_FILENAME].encode(
                    "utf-8", "surrogatepass").decode("utf-8", "replace")
                while chunk := await part.read_chunk(UPLOAD_CHUNK):
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise BadRequest(f"a batch file is at most {MAX_FILE_BYTES >> 20} MiB", 413, param="file")
                    if size > limit:
                        raise StorageFull(f"no room for this file: {await store.do(store.full_message)}")
                    try:
                        spool.write(chunk)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        raise StorageFull(f"the state disk is full: {await store.do(store.full_message)}") from None
            else:
                raise BadRequest(f"form field {part.name!r} is not implemented here: POST /v1/files takes "
                                 "purpose and file", param=part.name)
        if purpose != "batch":
            raise BadRequest(f"purpose {purpose!r} is not supported here: files are for batch jobs "
                             "(purpose=batch)", param="purpose")
        if filename is None:
            raise BadRequest("file is required: the JSONL input of a batch", param="file")
        await store.do(store.check_room, size)
        spool.seek(0)
        row = await store.do(store.add_file, new_id("file-"), filename, purpose, spool, size, _owner(request).name)
    finally:
        spool.close()
    return web.json_response(file_json(row))


async def _file(request: web.Request) -> tuple[BatchRunner, dict]:
    runner = _runner(request)
    file_id = request.match_info["file_id"]
    row = await runner.store.do(runner.store.get_file, file_id)
    if row is None or not _owner(request).sees(row):  # another's: as if it were not there
        raise BadRequest(f"no file {file_id} on this peer", 404, param="file_id")
    return runner, row


async def get_file(request: web.Request) -> web.Response:
    return web.json_response(file_json((await _file(request))[1]))


async def list_files(request: web.Request) -> web.Response:
    runner = _runner(request)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest('order must be "asc" or "desc"', param="order")
    limit = _limit(request, 100)
    rows = await runner.store.do(runner.store.list_files, request.query.get("purpose"), limit + 1,
                                 request.query.get("after"), order == "desc", _owner(request))
    return web.json_response(_page([file_json(r) for r in rows], limit))


async def delete_file(request: web.Request) -> web.Response:
    runner, row = await _file(request)
    try:
        await runner.store.do(runner.store.delete_file, row["id"])
    except ValueError as exc:
        raise BadRequest(f"file {row['id']} cannot be deleted now: {exc}", 409, param="file_id") from None
    return web.json_response({"id": row["id"], "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.StreamResponse:
    """The file's bytes: an upload as it came, an output or error file as JSONL in input order."""
    runner, row = await _file(request)
    store = runner.store
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = row["bytes"]
    await resp.prepare(request)
    if row["kind"] == "input":
        offset = 0
        while chunk := await store.do(store.read_input, row["id"], offset):
            await resp.write(chunk)
            offset += len(chunk)
    else:
        after = 0
        while page := await store.do(store.results_page, row["batch_id"], row["kind"] == "output", after,
                                     RESULTS_PAGE):
            await resp.write("".join(record + "\n" for _, record in page).encode())
            after = page[-1][0]
    await resp.write_eof()
    return resp


# -- batches -------------------------------------------------------------------------------


def _metadata(value) -> dict | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise BadRequest("metadata must be at most 16 string pairs (keys up to 64 characters, values up to 512)",
                         param="metadata")
    return value


async def create_batch(request: web.Request) -> web.Response:
    runner = _runner(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if (bad := find_surrogate(body)) is not None:  # the store keeps text; this is not text
        raise BadRequest(f"{bad} holds a lone UTF-16 surrogate: not valid Unicode", param=bad.split(".")[0])
    for key in sorted(set(body) - CREATE_FIELDS):
        raise BadRequest(f"{key} is not implemented here", param=key)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint {endpoint!r} is not supported: one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str) or (hours := WINDOW.match(window)) is None or int(hours.group(1)) > MAX_WINDOW_H:
        raise BadRequest(f'completion_window must be "24h" (or any whole hours up to {MAX_WINDOW_H}h)',
                         param="completion_window")
    file_id = body.get("input_file_id")
    owner = _owner(request)
    if (not isinstance(file_id, str) or (row := await runner.store.do(runner.store.get_file, file_id)) is None
            or not owner.sees(row) or row["kind"] != "input" or row["purpose"] != "batch"):
        raise BadRequest(f"input_file_id {file_id!r} is not a file uploaded with purpose=batch on this peer",
                         param="input_file_id")
    batch = await runner.submit(file_id, endpoint, window, int(hours.group(1)) * 3600, _metadata(body.get("metadata")),
                                owner.name)
    return web.json_response(batch_json(batch, request.app[NODE].model_name, runner))


async def _batch(request: web.Request) -> tuple[BatchRunner, dict]:
    runner = _runner(request)
    batch_id = request.match_info["batch_id"]
    row = await runner.store.do(runner.store.get_batch, batch_id)
    if row is None or not _owner(request).sees(row):  # another's: as if it were not there
        raise BadRequest(f"no batch {batch_id} on this peer (a batch lives on the peer it was submitted to)", 404,
                         param="batch_id")
    return runner, row


async def get_batch(request: web.Request) -> web.Response:
    runner, row = await _batch(request)
    return web.json_response(batch_json(row, request.app[NODE].model_name, runner))


async def list_batches(request: web.Request) -> web.Response:
    runner = _runner(request)
    limit = _limit(request)
    rows = await runner.store.do(runner.store.list_batches, limit + 1, request.query.get("after"), _owner(request))
    model = request.app[NODE].model_name
    return web.json_response(_page([batch_json(r, model, runner) for r in rows], limit))


async def cancel_batch(request: web.Request) -> web.Response:
    runner, row = await _batch(request)
    if Status(row["status"]) in TERMINAL:
        raise BadRequest(f"batch {row['id']} is already {row['status']}", 409, param="batch_id")
    cancelled = await runner.cancel(row["id"])
    if cancelled is None:  # a replica, released by its home meanwhile: as if it were not there (as _batch)
        raise BadRequest(f"no batch {row['id']} on this peer (a batch lives on the peer it was submitted to)", 404,
                         param="batch_id")
    return web.json_response(batch_json(cancelled, request.app[NODE].model_name, runner))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
