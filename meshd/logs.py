"""structlog set-up: a console renderer on a terminal, JSON lines otherwise (systemd, CI)."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def setup_logging(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog once per process; JSON when stderr is not a terminal or under systemd."""
    if json is None:
        json = not sys.stderr.isatty() or "INVOCATION_ID" in os.environ or "JOURNAL_STREAM" in os.environ
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
