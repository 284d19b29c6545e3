"""What ``meshctl`` and its ``batch`` commands (batchctl.py) share: the peer's base URL
from the options, API-key headers, the error for no answer at all, and text tables."""

from __future__ import annotations

import argparse


class Unreachable(Exception):
    """No HTTP answer at all (refused, timed out, not HTTP)."""


def base_url(args: argparse.Namespace) -> str:
    url = args.url.rstrip("/")
    return url if "://" in url else "http://" + url


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def render_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
