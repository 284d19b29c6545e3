"""A chat template render worker (shards/template_sandbox.py starts it with ``python -c``):
length-prefixed JSON requests on stdin (``render``: a template with its variables and an
output bound; ``inspect``: the names a template reads), one answer each on stdout. It
limits its own memory (``RLIMIT_AS``) and priority, and exits when its daemon is gone; the
daemon kills it when a render passes the time limit.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

import jinja2
from jinja2 import meta

from shards.chat import bounded_environment
from shards.template_sandbox import (
    HEADER,
    MAX_RENDER_CHARS,
    MEMORY_LIMIT,
    NICE,
    OUTPUT_LIMIT,
    WORKER_MEMORY,
    TemplateLimit,
)


def _watch_parent(parent: int) -> None:
    """A worker whose daemon is gone goes too (its stdin closes, but it may be looping)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main() -> None:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    except (ValueError, OSError):
        pass  # a platform without it: the time limit still holds
    # Below the daemon's own threads: a render that spins until it is killed takes a core
    # from nobody who has work (a normal render is ~0.1 ms either way).
    os.nice(NICE)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    compiled: dict[str, jinja2.Template] = {}

    def answer(obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "replace")
        stdout.write(HEADER.pack(len(data)) + data)
        stdout.flush()

    answer({"ready": True})

    def compile_(source: str, max_chars: int) -> jinja2.Template:
        template = compiled.get(source)
        if template is None:
            if len(compiled) >= 8:
                compiled.clear()
            try:
                template = compiled[source] = bounded_environment(max_chars).from_string(source)
            except jinja2.TemplateError as exc:
                raise _NoCompile(f"the chat template does not compile: {exc}") from None
        template.environment.max_chars = max_chars  # type: ignore[attr-defined]
        return template

    while head := stdin.read(HEADER.size):
        req = json.loads(stdin.read(HEADER.unpack(head)[0]))
        max_chars = int(req.get("max_chars", MAX_RENDER_CHARS))
        try:
            template = compile_(req["source"], max_chars)
            if req["op"] == "inspect":
                names = meta.find_undeclared_variables(template.environment.parse(req["source"]))
                answer({"variables": sorted(names)})
                continue
            parts, n = [], 0
            for piece in template.generate(**req["context"]):
                n += len(piece)
                if n > max_chars:
                    raise TemplateLimit(f"chat template: the rendered prompt passed its limit of {max_chars} "
                                        "characters", OUTPUT_LIMIT)
                parts.append(piece)
            text = "".join(parts)
            parts = []
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate, written as an escape in the template
                raise jinja2.TemplateError("the rendered prompt is not valid Unicode") from None
            answer({"text": text})
        except TemplateLimit as exc:
            answer({"error": str(exc), "limit": exc.limit})
        except _NoCompile as exc:
            answer({"error": str(exc)})
        except MemoryError:
            parts, text = [], ""
            answer({"error": f"chat template: rendering passed the memory limit of {WORKER_MEMORY >> 20} MiB",
                    "limit": MEMORY_LIMIT})
        except jinja2.TemplateError as exc:  # raise_exception() in the template, a sandbox refusal, ...
            answer({"error": f"chat template: {exc}"})
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            answer({"error": f"chat template: {type(exc).__name__}: {exc}"})


class _NoCompile(Exception):
    pass
