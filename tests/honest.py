"""An honest client beside an attack: it sends its requests over and over in a thread and
keeps how many were served, the slowest answer and every failure, so that a test can assert
the peer kept serving others while it was attacked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


# A liveness bound, not a speed figure: the attacks these tests replay held a peer for a
# minute or more (a 1e9-item schema, an 8 s mask step per token, a drain that never
# returned); an honest short request on a loaded two-core box in the full suite has taken
# 5.2 s. Twenty seconds tells the two apart without measuring the machine.
LIVE_S = 20.0


class Honest:
    """``send(path, body)`` -> (status, data), raising OSError when the peer does not answer;
    ``requests``: the (path, body) pairs sent in turn (body None: a GET)."""

    def __init__(self, send: Callable[[str, dict | None], tuple[int, object]],
                 requests: Sequence[tuple[str, dict | None]], join_s: float = 60):
        self.send, self.requests, self.join_s = send, requests, join_s
        self.worst, self.failures, self.served = 0.0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for path, body in self.requests:
                t0 = time.monotonic()
                try:
                    status, data = self.send(path, body)
                except OSError as exc:
                    status, data = 0, {"error": str(exc)}
                self.worst = max(self.worst, time.monotonic() - t0)
                if status == 200:
                    self.served += 1
                else:
                    self.failures.append((path, status, data))

    def assert_live(self) -> None:
        """Every honest request was answered, at least one was served, none waited LIVE_S."""
        assert not self.failures, self.failures[:3]
        assert self.served > 0 and self.worst < LIVE_S, (self.served, self.worst)

    def __enter__(self) -> Honest:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.join_s)
