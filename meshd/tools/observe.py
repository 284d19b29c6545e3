"""``meshctl trace`` and ``meshctl top``: a request's timeline across the peers, and the
live figures of the dashboard in a terminal, from any peer's /traces and /live.

``top`` redraws with plain ANSI (an alternate screen, the cursor hidden) and reads keys
in cbreak mode where it has a terminal; q or Ctrl-C ends it and puts the terminal back.
Without a terminal it prints a frame per interval, for ``--count`` frames.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import select
import shutil
import sys
import termios
import time
import tty
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from meshd.tools.client import Unreachable, base_url, render_table

EXIT_OK, EXIT_REFUSED = 0, 1
SPARK = "▁▂▃▄▅▆▇█"
KEEP = 900  # samples: the daemon's 15 minutes
PHASE_NAMES = {"admit": "admission", "queue": "queue", "wait": "engine queue", "stage": "stage forward",
               "hop": "hop", "sample": "embed, head, sampling", "scheduler": "scheduler",
               "stream": "answer's end", "proxy": "entry peer, tunnel"}


def _get(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError) as exc:
        raise Unreachable(f"no answer from {url}: {exc}") from None


def _names(base: str) -> dict[str, str]:
    """Peer names by id, from the peer's /status (ids alone where it does not say)."""
    try:
        _, status = _get(base + "/status", timeout=2.0)
    except Unreachable:
        return {}
    return {p["id"]: p.get("name") or p["id"] for p in status.get("peers", []) if isinstance(p, dict) and "id" in p}


def _ms(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# -- trace ------------------------------------------------------------------------------


def format_trace(t: dict, names: dict[str, str]) -> str:
    def name(node: str | None) -> str:
        return names.get(node, node) if node else "-"

    where = (f"entry {name(t['entry'])} -> " if t.get("entry") else "") + f"supernode {name(t.get('supernode'))}"
    head = (f"request {t['request_id']}  trace {t['trace_id']}  status {t.get('status') or t.get('state')}\n"
            f"{where}  wall {t['wall_ms']:.1f} ms  first token {_ms(t.get('ttft_ms'), 1)} ms  "
            f"prompt {t.get('prompt_tokens', 0)} tokens, {t.get('completion_tokens', 0)} generated in "
            f"{t.get('steps', 0)} steps")
    rows = [["PHASE", "PEER", "LAYERS", "PREFILL ms", "DECODE ms", "TOTAL ms", "%"]]
    wall = t["wall_ms"] or 1.0
    for p in t["phases"]:
        layers = p.get("layers")
        rows.append([PHASE_NAMES.get(p["kind"], p["kind"]), name(p["peer"]),
                     f"{layers[0]}-{layers[1]}" if layers else "", _ms(p.get("prefill_ms")),
                     _ms(p.get("decode_ms")), _ms(p["ms"]), f"{100 * p['ms'] / wall:.1f}"])
    total = sum(p["ms"] for p in t["phases"])
    rows.append(["total", "", "", "", "", _ms(total), f"{100 * total / wall:.1f}"])
    notes = []
    if t.get("overlap_ms"):
        notes.append(f"{t['overlap_ms']:.1f} ms of stage work ran side by side (a pipelined prefill or wave), "
                     "scaled into the wall time")
    if t.get("state") == "running":
        notes.append("still running: the times so far")
    return head + "\n\n" + render_table(rows) + "".join("\n" + n for n in notes)


def format_recent(data: dict) -> str:
    rows = [["REQUEST", "STATE", "STATUS", "WALL ms", "TTFT ms", "TOKENS", "TRACE"]]
    for r in data.get("requests", []):
        rows.append([r["request_id"], r["state"], str(r.get("status") or "-"), _ms(r.get("wall_ms"), 1),
                     _ms(r.get("ttft_ms"), 1), str(r.get("completion_tokens", 0)), r.get("trace_id", "")])
    return render_table(rows)


def cmd_trace(args: argparse.Namespace) -> int:
    base = base_url(args)
    if not args.request_id:
        _, data = _get(base + f"/traces?limit={args.limit}")
        print(json.dumps(data, indent=2) if args.json else format_recent(data))
        return EXIT_OK
    code, data = _get(base + "/traces/" + urllib.parse.quote(args.request_id, safe=""))
    if code != 200:
        message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        print(f"meshctl: {message or f'HTTP {code}'}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps(data, indent=2) if args.json else format_trace(data, _names(base)))
    return EXIT_OK


# -- top --------------------------------------------------------------------------------


def spark(values: list[float | None], width: int) -> str:
    values = values[-width:]
    top = max((v for v in values if v is not None), default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(" " if v is None else SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))]
                   for v in values)


def _pct(part: int, whole: int | None) -> str:
    return f"{100 * part / whole:.2f} %" if whole else "-"


def format_top(live: dict, samples: list[dict], width: int, when: str) -> str:
    """One frame: the latest sample's figures with the last minute as sparklines, the
    peers of the plan, batch jobs, recent requests."""
    names = {p["id"]: p.get("name") or p["id"] for p in live.get("peers", [])}

    def name(node: Any) -> str:  # a node id of the /live answer (JSON)
        return names.get(node, node)

    cur = samples[-1] if samples else {}
    source = live.get("source")
    lines = [f"meshd top  {when}  peer {name(live.get('node'))}"
             + (f"  figures of the supernode {name(source)}" if source != live.get("node") else "")
             + "   q: quit", ""]
    spark_w = max(10, min(60, width - 40))
    series = lambda key: [s.get(key) for s in samples]  # noqa: E731
    lines.append(f"tokens/s   {_ms(cur.get('tokens_per_s'), 1):>8}  {spark(series('tokens_per_s'), spark_w)}")
    lines.append(f"running    {cur.get('running', '-'):>8}  {spark(series('running'), spark_w)}")
    lines.append(f"queued     {cur.get('queued', '-'):>8}  {spark(series('queued'), spark_w)}")
    lines.append(f"TTFT p50   {_ms(cur.get('ttft_p50_ms'), 0):>5} ms  p95 {_ms(cur.get('ttft_p95_ms'), 0)} ms"
                 "  (first tokens of the last minute)")
    if cur:
        lines.append(f"KV cache   {_pct(cur['kv_reserved'], cur['kv_budget']):>8}  reserved {cur['kv_reserved']} "
                     f"of {cur['kv_budget'] or '-'} positions, prefix cache {cur['kv_prefix']}")
    lines.append("")
    rows = [["PEER", "LAYERS", "STAGE ms", "BUSY", "WAIT ms", "HOP ms", "PING ms"]]
    layers = {p["id"]: p.get("layers") for p in live.get("peers", [])}
    for node, fig in (cur.get("peers") or {}).items():
        span = layers.get(node)
        rows.append([name(node), f"{span[0]}-{span[1]}" if span else "-", _ms(fig.get("stage_ms")),
                     f"{100 * (fig.get('busy') or 0):.0f}%", _ms(fig.get("wait_ms")), _ms(fig.get("hop_ms")),
                     _ms(fig.get("rtt_ms"))])
    lines += render_table(rows).splitlines()
    batches = live.get("batches") or []
    if batches:
        lines.append("")
        rows = [["BATCH", "PEER", "STATUS", "PROGRESS", "TOK/S", "ETA s"]]
        for b in batches:
            done = b["completed"] + b["failed"]
            bar_w = 20
            fill = int(bar_w * done / b["total"]) if b["total"] else 0
            rows.append([b["id"], name(b.get("peer", "")), b["status"],
                         f"{done}/{b['total']} [{'#' * fill}{'.' * (bar_w - fill)}]",
                         f"{b.get('tokens_per_s', 0):.1f}", _ms(b.get("eta_s"), 0)])
        lines += render_table(rows).splitlines()
    recent = live.get("recent") or []
    if recent:
        lines.append("")
        rows = [["REQUEST", "STATE", "WALL ms", "TTFT ms", "TOKENS"]]
        for r in recent[:8]:
            rows.append([r["request_id"], r["state"] if r["state"] != "done" else str(r.get("status")),
                         _ms(r.get("wall_ms"), 0), _ms(r.get("ttft_ms"), 0), str(r.get("completion_tokens", 0))])
        lines += render_table(rows).splitlines()
    return "\n".join(line[:width] for line in lines)


class _Keys:
    """Single keys from a terminal (cbreak: no echo, no line buffering; Ctrl-C still interrupts)."""

    def __init__(self, stream):
        self.stream = stream
        self.fd = stream.fileno() if stream.isatty() else None
        self._saved = None

    def __enter__(self):
        if self.fd is not None:
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc):
        if self._saved is not None and self.fd is not None:  # (saved only from a terminal's fd)
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait(self, seconds: float) -> str:
        """The keys pressed within ``seconds`` ('' if none; without a terminal, just the wait)."""
        if self.fd is None:
            time.sleep(seconds)
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, seconds))
        return os.read(self.fd, 64).decode("utf-8", "replace") if ready else ""


def cmd_top(args: argparse.Namespace) -> int:
    try:
        return _top(args)
    except KeyboardInterrupt:  # Ctrl-C: an ordinary way to leave (the terminal is back by now)
        return EXIT_OK


def _top(args: argparse.Namespace) -> int:
    base = base_url(args)
    out = sys.stdout
    screen = out.isatty()
    samples: collections.deque[dict] = collections.deque(maxlen=KEEP)
    source, seq = None, 0
    _get(base + "/live?since=0", timeout=args.interval + 2)  # no answer at all: exit 2 before drawing
    frames = misses = 0
    with contextlib.ExitStack() as stack:
        keys = stack.enter_context(_Keys(sys.stdin))
        if screen:
            out.write("\x1b[?1049h\x1b[?25l")  # the alternate screen, no cursor
            stack.callback(lambda: (out.write("\x1b[?25h\x1b[?1049l"), out.flush()))
        while args.count is None or frames < args.count:
            began = time.monotonic()
            frame: str | None = None
            try:
                code, live = _get(base + f"/live?since={seq}", timeout=args.interval + 2)
                if code != 200:
                    raise Unreachable(f"HTTP {code}")
                misses = misses + 1 if live.get("relay_failed") and source not in (None, live.get("source")) else 0
                if 0 < misses < 5:
                    pass  # the supernode's figures came late: keep its frame a while, not this peer's zeros
                else:
                    if live.get("source") != source or live.get("seq", 0) < seq:
                        samples.clear()  # another supernode, or a restart: start over
                        asked, source, seq = seq, live.get("source"), 0
                        if asked:  # these came after a number of the other's: all of them next time
                            continue
                    newest = samples[-1]["seq"] if samples else 0
                    samples.extend(s for s in live.get("samples", []) if s.get("seq", 0) > newest)
                    seq = live.get("seq", 0)
                    frame = format_top(live, list(samples), shutil.get_terminal_size().columns,
                                       time.strftime("%H:%M:%S"))
            except Unreachable as exc:  # keep watching: the daemon may be restarting
                frame = f"meshd top  {time.strftime('%H:%M:%S')}  {exc}   q: quit"
            if frame is not None:
                if screen:
                    out.write("\x1b[H" + frame.replace("\n", "\x1b[K\n") + "\x1b[K\x1b[J")
                else:
                    out.write(("\n" if frames else "") + frame + "\n")
                out.flush()
                frames += 1
            if args.count is not None and frames >= args.count:
                break
            if "q" in keys.wait(args.interval - (time.monotonic() - began)).lower():
                break
    return EXIT_OK


def add_parsers(sub, command) -> None:
    """``trace`` and ``top`` on meshctl's subparsers (``command`` makes one with --url and --json)."""
    trace = command("trace", "a recent request's timeline across the peers, by x-request-id or trace id "
                             "(without one: the recent requests)")
    trace.add_argument("request_id", nargs="?", help="the request's x-request-id (or its W3C trace id)")
    trace.add_argument("--limit", type=int, default=20, help="without a request id: how many to list")
    top = command("top", "live figures in the terminal: tokens/s, requests, TTFT, KV cache, per-peer stage "
                         "and hop times, batch jobs (q or Ctrl-C to quit)", json_flag=False)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    top.add_argument("--count", type=int, help="stop after this many frames")
