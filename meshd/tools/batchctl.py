"""``meshctl batch``: submit, watch, cancel and fetch batch jobs (OpenAI's Batch API) on a peer.

    meshctl batch submit FILE.jsonl [--wait] [--out RESULTS.jsonl] [--errors ERRORS.jsonl]
    meshctl batch list | status ID [--wait] | cancel ID | results ID [--out FILE] [--errors]

A batch lives on the peer it was submitted to: give that peer's ``--url`` for the rest.
Exit codes as for every meshctl command: 0 done (``submit --wait`` and ``status``: the
batch completed, or runs, with no failed line), 1 the peer answered no (a batch failed,
was cancelled or expired, or has failed lines: see its error file), 2 no answer, 64 usage.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from meshd.tools.client import Unreachable, auth_headers, base_url, render_table

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 64
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
FINISHED = ("completed", "failed", "expired", "cancelled")
CHUNK = 1 << 16
BAR = 28


class Refused(Exception):
    """The peer answered with an error: (status, message)."""


def _request(args: argparse.Namespace, method: str, path: str, body=None, headers: dict | None = None,
             length: int | None = None, timeout: float = 60.0):
    """The open HTTP response (the caller reads and closes it); Refused on an HTTP error."""
    base = base_url(args)
    hdrs = {"Accept": "application/json"} | auth_headers(args.api_key) | (headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        hdrs["Content-Type"] = "application/json"
    if length is not None:
        hdrs["Content-Length"] = str(length)
    req = urllib.request.Request(base + path, body, hdrs, method=method)
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:300] or exc.reason
        raise Refused(f"HTTP {exc.code}: {message}") from None
    except OSError as exc:
        raise Unreachable(f"no answer from {base}: {exc}") from None


def _json(args, method: str, path: str, body=None) -> dict:
    with _request(args, method, path, body) as resp:
        return json.loads(resp.read())


def _multipart(path: Path, boundary: str) -> tuple[Iterator[bytes], int]:
    """A multipart/form-data body (purpose=batch, file) streamed from disk, and its length."""
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path.name}\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def chunks() -> Iterator[bytes]:
        yield head
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk
        yield tail

    return chunks(), len(head) + path.stat().st_size + len(tail)


def _endpoint_of(path: Path) -> str:
    """The url of the file's first request line (every line of a batch has the same)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if url in ENDPOINTS:
                    return url
                break
    raise ValueError(f"cannot tell the endpoint from the first line of {path}: give --endpoint")


# -- progress -------------------------------------------------------------------------------


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Watch:
    """done/total, tok/s and ETA of a batch from successive polls (the peer's own rates
    when it gives them: ``meshd_progress``)."""

    def __init__(self):
        self.samples: list[tuple[float, int, int]] = []

    def line(self, b: dict) -> str:
        counts = b.get("request_counts") or {}
        total, done = counts.get("total") or 0, (counts.get("completed") or 0) + (counts.get("failed") or 0)
        tokens = (b.get("usage") or {}).get("output_tokens") or 0
        now = time.monotonic()
        self.samples = [s for s in self.samples if s[0] > now - 30] + [(now, done, tokens)]
        t0, d0, k0 = self.samples[0]
        span = now - t0
        progress = b.get("meshd_progress") or {}
        tok_s = progress.get("tokens_per_s", (tokens - k0) / span if span > 0 else 0.0)
        lines_s = progress.get("lines_per_s", (done - d0) / span if span > 0 else 0.0)
        eta = (total - done) / lines_s if lines_s and total else None
        filled = int(BAR * done / total) if total else 0
        failed = f"  {counts.get('failed')} failed" if counts.get("failed") else ""
        return (f"[{'#' * filled}{'.' * (BAR - filled)}] {done}/{total} {100 * done / total if total else 0:3.0f}%"
                f"  {tok_s:.1f} tok/s  ETA {_duration(eta) if b.get('status') not in FINISHED else '-'}"
                f"  {b.get('status')}{failed}")


def wait(args, batch_id: str, poll: float) -> dict:
    """Poll until the batch is finished, drawing the progress line on stderr."""
    tty = sys.stderr.isatty()
    watch = Watch()
    last_print = 0.0
    while True:
        b = _json(args, "GET", f"/v1/batches/{batch_id}")
        text = watch.line(b)
        finished = b.get("status") in FINISHED
        if tty:
            print("\r\033[K" + text, end="\n" if finished else "", file=sys.stderr, flush=True)
        elif finished or time.monotonic() - last_print >= 10:
            print(text, file=sys.stderr, flush=True)
            last_print = time.monotonic()
        if finished:
            return b
        time.sleep(poll)


def _outcome(b: dict) -> int:
    counts = b.get("request_counts") or {}
    if b.get("status") in ("failed", "expired", "cancelled") or counts.get("failed"):
        return EXIT_REFUSED
    return EXIT_OK


def _describe(b: dict) -> str:
    counts = b.get("request_counts") or {}
    errors = (b.get("errors") or {}).get("data") or []
    out = [f"batch {b['id']} {b['status']}: {counts.get('completed', 0)} completed, {counts.get('failed', 0)} failed "
           f"of {counts.get('total', 0)}"]
    out += [f"  error: {e.get('message')}" for e in errors]
    if b.get("output_file_id"):
        out.append(f"  output file {b['output_file_id']}")
    if b.get("error_file_id"):
        out.append(f"  error file {b['error_file_id']} (meshctl batch results {b['id']} --errors)")
    return "\n".join(out)


def _download(args, file_id: str, out: Path | None) -> None:
    with _request(args, "GET", f"/v1/files/{file_id}/content", timeout=300) as resp:
        if out is None:
            while chunk := resp.read(CHUNK):
                sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            return
        tmp = out.with_name(out.name + ".part")
        with open(tmp, "wb") as f:
            while chunk := resp.read(CHUNK):
                f.write(chunk)
        tmp.replace(out)


# -- commands ------------------------------------------------------------------------------


def cmd_submit(args) -> int:
    path = Path(args.file)
    bad = [kv for kv in args.metadata or () if "=" not in kv]
    if bad:
        print(f"meshctl: --metadata takes KEY=VALUE, not {bad[0]!r}", file=sys.stderr)
        return EXIT_USAGE
    try:
        endpoint = args.endpoint or _endpoint_of(path)
    except (OSError, ValueError) as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    boundary = "meshctl" + secrets.token_hex(12)
    body, length = _multipart(path, boundary)
    with _request(args, "POST", "/v1/files", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"},
                  length=length, timeout=600) as resp:
        uploaded = json.loads(resp.read())
    request: dict = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": args.window}
    if args.metadata:
        request["metadata"] = dict(kv.split("=", 1) for kv in args.metadata)
    b = _json(args, "POST", "/v1/batches", request)
    print(b["id"], flush=True)
    if not args.wait:
        return EXIT_OK
    b = wait(args, b["id"], args.poll)
    print(_describe(b), file=sys.stderr)
    if args.out and b.get("output_file_id"):
        _download(args, b["output_file_id"], Path(args.out))
    if args.errors and b.get("error_file_id"):
        _download(args, b["error_file_id"], Path(args.errors))
    return _outcome(b)


def cmd_list(args) -> int:
    page = _json(args, "GET", f"/v1/batches?limit={args.limit}")
    if args.json:
        print(json.dumps(page["data"], indent=2))
        return EXIT_OK
    rows = [["BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED"]]
    for b in page["data"]:
        c = b["request_counts"]
        rows.append([b["id"], b["status"], b["endpoint"], f"{c['completed'] + c['failed']}/{c['total']}",
                     str(c["failed"]), time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"]))])
    print(render_table(rows) if len(rows) > 1 else "no batches on this peer")
    return EXIT_OK


def cmd_status(args) -> int:
    b = wait(args, args.id, args.poll) if args.wait else _json(args, "GET", f"/v1/batches/{args.id}")
    if args.json:
        print(json.dumps(b, indent=2))
    else:
        if not args.wait:
            print(Watch().line(b))
        print(_describe(b))
    return _outcome(b)


def cmd_cancel(args) -> int:
    b = _json(args, "POST", f"/v1/batches/{args.id}/cancel")
    if args.wait:
        b = wait(args, args.id, args.poll)
    print(_describe(b))
    return EXIT_OK


def cmd_results(args) -> int:
    b = _json(args, "GET", f"/v1/batches/{args.id}")
    file_id = b.get("error_file_id" if args.errors else "output_file_id")
    if not file_id:
        what = "error" if args.errors else "output"
        why = "it is not finished" if b["status"] not in FINISHED else f"no line went to the {what} file"
        print(f"meshctl: batch {args.id} ({b['status']}) has no {what} file: {why}", file=sys.stderr)
        return EXIT_REFUSED
    _download(args, file_id, Path(args.out) if args.out else None)
    return EXIT_OK


def add_parser(sub, parser_class) -> None:
    """``meshctl batch ...`` under meshctl's subcommands."""
    batch = sub.add_parser("batch", help="batch jobs (OpenAI's Batch API): submit, list, status, cancel, results")
    bsub = batch.add_subparsers(dest="batch_command", required=True, parser_class=parser_class)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = bsub.add_parser(name, help=help)
        p.add_argument("--url", default=argparse.SUPPRESS, help="the peer the batch lives on")
        return p

    submit = command("submit", "upload a JSONL file of requests and start a batch on it (prints its id)")
    submit.add_argument("file", help="JSONL: one {custom_id, method, url, body} request a line")
    submit.add_argument("--endpoint", choices=ENDPOINTS, help="default: the url of the file's first line")
    submit.add_argument("--window", default="24h", help="completion window (default 24h)")
    submit.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="repeatable")
    submit.add_argument("--wait", action="store_true", help="show progress until it finishes")
    submit.add_argument("--out", help="with --wait: write the results (output file) here")
    submit.add_argument("--errors", help="with --wait: write the error file here")
    submit.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    lst = command("list", "batches on this peer, newest first")
    lst.add_argument("--limit", type=int, default=20)
    lst.add_argument("--json", action="store_true")
    status = command("status", "one batch: progress, counts and files")
    status.add_argument("id")
    status.add_argument("--wait", action="store_true", help="show progress until it finishes")
    status.add_argument("--json", action="store_true")
    status.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    cancel = command("cancel", "stop a batch; the lines done so far stay in its output file")
    cancel.add_argument("id")
    cancel.add_argument("--wait", action="store_true", help="until it is cancelled")
    cancel.add_argument("--poll", type=float, default=0.5, help=argparse.SUPPRESS)
    results = command("results", "a finished batch's output file (or error file) as JSONL")
    results.add_argument("id")
    results.add_argument("--errors", action="store_true", help="the error file instead")
    results.add_argument("--out", help="write to this file instead of stdout")


def run(args) -> int:
    commands = {"submit": cmd_submit, "list": cmd_list, "status": cmd_status, "cancel": cmd_cancel,
                "results": cmd_results}
    try:
        return commands[args.batch_command](args)
    except Refused as exc:
        print(f"meshctl: batch {args.batch_command} refused ({exc})", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("\nmeshctl: stopped waiting; the batch goes on (meshctl batch status ID)", file=sys.stderr)
        return EXIT_REFUSED
