"""Chat templates rendered in worker processes that are killed past a time limit.

A chat template comes with the model file: it is untrusted code. Jinja's sandbox keeps it
away from Python's internals (shards/chat.py), but not from looping: three nested
``range(100000)`` loops run for hours, and a string of gigabytes takes seconds to build.
Neither can be stopped inside a thread, so every render runs in one of a few worker
processes (shards/template_worker.py: jinja2 and shards.chat only), with bounds:

- time: a render that passes ``RENDER_S`` of wall clock is ended by killing its worker
  (SIGKILL), and a new worker takes its place;
- output: the rendered text is counted as it is generated and refused past ``max_chars``
  (the caller's bound: what its context window could ever hold), and a ``*`` that would
  make a string or list longer than that is refused before it is built;
- memory: each worker runs under ``RLIMIT_AS`` (``WORKER_MEMORY``);
- CPU: workers run niced (``NICE``), below the daemon's engine and event loop.

Each exceeded bound is a ``TemplateLimit`` (a ModelError: a 400 for the request) naming
it. A worker serves renders one at a time over its stdin/stdout (length-prefixed JSON);
the calling thread waits on the pipe, so it holds no lock and the GIL is free meanwhile.
A normal render costs a pipe round trip on top of Jinja's own time (well under 1 ms).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, cast

from shards.errors import ModelError

RENDER_S = 1.0  # wall clock of one render, in its worker
COMPILE_S = 5.0  # wall clock of compiling a template and finding the names it reads (once per template)
MAX_RENDER_CHARS = 1 << 24  # the output ceiling whatever the caller asks
WORKER_MEMORY = 1 << 30  # RLIMIT_AS of a worker (Python + jinja2 take ~40 MiB)
POOL_SIZE = 4  # workers rendering at once (more renders wait for one): as many as tokenize threads
WARM = 2  # workers started with the tokenizer; the others when renders overlap
START_S = 60.0  # a worker's start-up (Python + jinja2 import; slow on a busy box)
MAX_POW = 1 << 12  # the largest exponent ``**`` takes in a template
NICE = 10  # a worker's scheduling priority below the daemon's

HEADER = struct.Struct(">I")
_ROOT = str(Path(__file__).resolve().parent.parent)


class TemplateLimit(ModelError):
    """A render that passed one of the bounds above; ``limit`` names it (also the
    request's error code)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


class WorkerUnavailable(ModelError):
    """No render worker could be started (says nothing of the template)."""


TIME_LIMIT, OUTPUT_LIMIT, MEMORY_LIMIT = "chat_template_time_limit", "chat_template_output_limit", \
    "chat_template_memory_limit"


# -- the parent's side -------------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        code = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
                "from shards.template_worker import main; main()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     close_fds=True, start_new_session=True)
        # Its ends of the two pipes (PIPE above: never None).
        self.stdin, self.stdout = cast(IO[bytes], self.proc.stdin), cast(IO[bytes], self.proc.stdout)
        self.ready = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.stdin, self.stdout):
            try:
                f.close()
            except OSError:
                pass

    def send(self, request: dict) -> None:
        data = json.dumps(request, ensure_ascii=False).encode("utf-8", "replace")
        self.stdin.write(HEADER.pack(len(data)) + data)
        self.stdin.flush()

    def receive(self, deadline: float) -> dict | None:
        """The worker's next answer, or None once ``deadline`` (monotonic) has passed."""
        head = self._read(HEADER.size, deadline)
        if head is None:
            return None
        body = self._read(HEADER.unpack(head)[0], deadline)
        return None if body is None else json.loads(body)

    def _read(self, n: int, deadline: float) -> bytes | None:
        fd, out = self.stdout.fileno(), bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError(f"the chat template worker exited ({self.proc.poll()})")
            out += chunk
        return bytes(out)


class RenderPool:
    """Up to ``size`` workers, started by ``warm`` or when every one is busy (so an honest
    chat does not wait out a bad template's time limit); a killed one is replaced."""

    def __init__(self, size: int = POOL_SIZE, render_s: float = RENDER_S):
        self.size, self.render_s = size, render_s
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()

    def warm(self, count: int = WARM) -> None:
        with self._lock:
            while len(self._workers) < min(count, self.size):
                self._add()

    def _add(self) -> None:
        w = _Worker()
        self._workers.add(w)
        self._idle.put(w)

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle.empty() and len(self._workers) < self.size:
                self._add()
        return self._idle.get()  # bounded: each render holds a worker RENDER_S at most

    def _replace(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._workers.discard(w)
            self._add()

    def render(self, source: str, context: Mapping, max_chars: int) -> str:
        answer = self._call({"op": "render", "source": source, "context": context, "max_chars": max_chars},
                            self.render_s, "rendering")
        return answer["text"]

    def inspect(self, source: str) -> frozenset[str]:
        """The names ``source`` reads from its caller; ModelError where it does not compile.
        In a worker too: Jinja evaluates constant expressions while it compiles (and while
        it finds the names), ``{{ '%2000000000d' % 1 }}`` a 2 GB string."""
        answer = self._call({"op": "inspect", "source": source}, COMPILE_S, "compiling")
        return frozenset(answer["variables"])

    def _call(self, request: dict, limit_s: float, doing: str) -> dict:
        w = self._take()
        try:
            if not w.ready:
                started: dict | Exception | None
                try:
                    started = w.receive(time.monotonic() + START_S)
                except (OSError, EOFError, ValueError) as exc:
                    started = exc
                if not isinstance(started, dict):
                    raise WorkerUnavailable(f"the chat template worker did not start ({started or 'no answer'})")
                w.ready = True
            w.send(request)
            answer = w.receive(time.monotonic() + limit_s)
        except (OSError, EOFError) as exc:  # it died under the render (its memory, a crash): a new one
            self._replace(w)
            raise TemplateLimit(f"chat template: {doing} it stopped its worker ({exc}); its memory limit is "
                                f"{WORKER_MEMORY >> 20} MiB", MEMORY_LIMIT) from None
        except BaseException:
            self._replace(w)
            raise
        if answer is None:
            self._replace(w)
            raise TemplateLimit(f"chat template: {doing} it ran past its time limit of {limit_s:g} s", TIME_LIMIT)
        self._idle.put(w)
        if "error" not in answer:
            return answer
        if answer.get("limit"):
            raise TemplateLimit(answer["error"], answer["limit"])
        raise ModelError(answer["error"])

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                w.kill()
            self._workers.clear()
            self._idle = queue.SimpleQueue()


_POOL: RenderPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> RenderPool:
    """The process's render pool (one per process: the workers are its children)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = RenderPool()
            atexit.register(_POOL.close)
        return _POOL


def inspect(source: str) -> frozenset[str]:
    """The names ``source`` reads from its caller (compiled in a worker, bounded in time and
    memory); ModelError where it does not compile."""
    return pool().inspect(source)


def render(source: str, context: Mapping, max_chars: int | None = None) -> str:
    """``source`` rendered with ``context`` (JSON data) in a worker, within the bounds above."""
    limit = MAX_RENDER_CHARS if max_chars is None else max(1, min(int(max_chars), MAX_RENDER_CHARS))
    return pool().render(source, context, limit)
