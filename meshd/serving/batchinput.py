"""A batch's input file: each JSONL line checked into a runnable request or an error
record that names its custom_id, so one malformed line never stops the rest; and the
records of the output and error files, in OpenAI's shape."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator

from meshd.errors import BadRequest
from meshd.serving.batchstore import BatchStore, Line, Status
from meshd.serving.guards import parse_json
from meshd.serving.openai import find_surrogate

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
MAX_CUSTOM_ID = 512
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.){1,512})"')


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def result_record(custom_id: str | None, *, response: dict | None = None, error: dict | None = None) -> str:
    """One line of an output or error file, in OpenAI's shape."""
    return json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error},
                      separators=(",", ":"))


def check_line(raw: bytes, number: int, endpoint: str, seen: dict[str, int]) -> Line | tuple[str | None, str]:
    """A runnable line, or (custom_id as far as it can be read, why not)."""
    guess = _CUSTOM_ID.search(raw)
    custom_id = guess.group(1).decode("utf-8", "replace") if guess else None
    try:  # as a request body is read: a line nested too deep or a number too long is refused
        item = parse_json(raw)
    except BadRequest as exc:
        return custom_id, f"line {number} is not valid JSON: {exc}"
    if not isinstance(item, dict):
        return custom_id, f"line {number} must be a JSON object {{custom_id, method, url, body}}"
    bad = find_surrogate(item)
    if bad is not None:  # no tokenizer takes it, and the store cannot keep it as text
        return custom_id, f"line {number}: {bad} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape), not text"
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return custom_id, f"line {number}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters"
    if cid in seen:
        return cid, f"line {number}: custom_id {cid!r} is already used on line {seen[cid]}"
    seen[cid] = number
    unknown = sorted(set(item) - LINE_FIELDS)
    if unknown:
        return cid, f"line {number}: unknown field {unknown[0]!r} (a line has custom_id, method, url, body)"
    if item.get("method") != "POST":
        return cid, f"line {number}: method must be \"POST\""
    if item.get("url") != endpoint:
        return cid, f"line {number}: url {item.get('url')!r} is not this batch's endpoint {endpoint!r}"
    body = item.get("body")
    if not isinstance(body, dict):
        return cid, f"line {number}: body must be a JSON object (the request to {endpoint})"
    if body.get("stream"):
        return cid, f"line {number}: stream is not supported in a batch"
    return Line(number, cid, body)


def split_lines(read) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a file read in chunks by ``read(offset) -> bytes``; blank lines skipped."""
    offset, number, rest = 0, 0, b""
    while chunk := read(offset):
        offset += len(chunk)
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        for part in parts:
            number += 1
            if part.strip():
                yield number, part
    if rest.strip():
        yield number + 1, rest


def validate_input(store: BatchStore, batch_id: str, file_id: str, endpoint: str) -> dict:
    """Parse a batch's input file into its lines (on the store's thread); malformed lines
    get their error record now and the rest of the job goes on."""
    if store.get_file(file_id) is None:
        return store.finish(batch_id, Status.FAILED, [{"code": "file_not_found", "line": None, "param": "input_file_id",
                                                      "message": f"the input file {file_id} is gone"}])
    lines: list[Line] = []
    malformed: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    for number, raw in split_lines(lambda off: store.read_input(file_id, off)):
        checked = check_line(raw, number, endpoint, seen)
        if isinstance(checked, Line):
            lines.append(checked)
        else:
            cid, why = checked
            malformed.append((number, result_record(cid, error={"code": "invalid_request", "message": why})))
    if not lines and not malformed:
        return store.finish(batch_id, Status.FAILED, [{"code": "empty_file", "line": None, "param": "input_file_id",
                                                      "message": f"the input file {file_id} holds no request"}])
    return store.start_lines(batch_id, lines, malformed)
