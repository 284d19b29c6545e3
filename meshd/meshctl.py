"""``meshctl``: look at and steer a mesh through any peer's HTTP API.

Exit codes: 0 the mesh serves, 1 it answers but cannot serve, 2 no answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8470"
EXIT_SERVING, EXIT_NOT_SERVING, EXIT_UNREACHABLE = 0, 1, 2


def get_json(url: str, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # a 503 still carries the JSON body
        return json.loads(exc.read())


def human_bytes(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_status(status: dict) -> str:
    head = (f"mesh model {status.get('model')}  term {status.get('term')}  "
            f"supernode {status.get('supernode') or '-'}  "
            f"{'serving' if status.get('serving') else 'NOT serving: ' + str(status.get('reason'))}")
    rows = [["PEER", "NAME", "ADDR", "ROLE", "DEVICE", "VRAM", "RAM", "LAYERS", "STATE", "RTT"]]
    for p in status.get("peers", []):
        layers = p.get("layers")
        rtt = p.get("rtt_ms")
        rows.append([
            p["id"] + (" *" if p.get("self") else ""), p.get("name") or "-", p.get("addr") or "-", p["role"],
            p.get("device") or "-", human_bytes(p.get("vram")), human_bytes(p.get("ram")),
            f"{layers[0]}-{layers[1]}" if layers else "-", p["state"],
            "-" if rtt is None else f"{rtt:.2f} ms",
        ])
    plan = " ".join(f"{a['node']}[{a['start']}:{a['stop']})" for a in status.get("plan", [])) or "none"
    terms = "\n".join(f"  term {t['term']}: {t.get('reason') or '-'}" for t in status.get("terms", [])[-5:])
    return f"{head}\nplan {plan}\n\n{render_table(rows)}" + (f"\n\nterms\n{terms}" if terms else "")


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status = get_json(args.url.rstrip("/") + "/status")
    except (OSError, ValueError) as exc:
        print(f"meshctl: no answer from {args.url}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return EXIT_SERVING if status.get("serving") else EXIT_NOT_SERVING


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="meshctl", description="Look at and steer a meshd mesh.")
    top.add_argument("--url", default=DEFAULT_URL, help=f"any peer's API (default {DEFAULT_URL})")
    sub = top.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="the mesh as this peer sees it")
    status.add_argument("--url", default=argparse.SUPPRESS)
    status.add_argument("--json", action="store_true", help="raw JSON")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    match args.command:
        case "status":
            return cmd_status(args)
    return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
