"""Where one step's time went, as the supernode sees it: each stage's forward, its
wait for its engine, the hop there and back, and the supernode's own head work.

A step's ``StepTimes`` is made by the scheduler and set in ``STEP_TIMES`` for the
step's task (and the sibling tasks of a wave, which copy the context); a runner adds
its share when its call returns, as ``URGENT`` travels with an engine call. One step
costs a few clock reads per stage and one small dict, whatever its batch; the
sessions it carried keep a reference to it (``serving/traces.py``), not a copy.
"""

from __future__ import annotations

import contextvars
import time

STAGE, WAIT, HOP, SAMPLE = "stage", "wait", "hop", "sample"

Key = tuple[str, str]  # (kind, node id)


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds to the microsecond, as /status and /live show times (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 3)


class StepTimes:
    """One step (or one prompt's pipelined prefill): when it ran and the seconds of each
    part, by (kind, node). Parts of sibling tasks add up past the step's length where
    they overlapped (a wave, a wavefront prefill); ``serving/traces.py`` scales them."""

    __slots__ = ("began", "ended", "parts", "calls", "chain", "seq", "base", "sums")

    def __init__(self) -> None:
        self.began = time.monotonic()
        self.ended = 0.0
        self.parts: dict[Key, float] = {}
        self.calls: dict[str, int] = {}  # forwards through each node's span
        # Its place in its lane's running sums, set by serving/traces.Chain.link: which lane,
        # its number there, and those sums before and after it (None: a step of no lane).
        self.chain: object = None
        self.seq = 0
        self.base: dict[Key, float] | None = None
        self.sums: dict[Key, float] | None = None

    def add(self, kind: str, node: str, seconds: float) -> None:
        if seconds > 0.0:
            key = (kind, node)
            self.parts[key] = self.parts.get(key, 0.0) + seconds

    def forward(self, node: str, elapsed: float, seconds: float, queued: float = 0.0, *,
                local: bool = False) -> None:
        """One call through ``node``'s span that took ``elapsed`` here, of which the stage
        says ``seconds`` were its forward and ``queued`` its wait for its engine (clamped:
        a peer's figures cannot claim more than the call took). The rest is the hop, or,
        for this peer's own span, the wait for its engine."""
        seconds = min(max(seconds, 0.0), elapsed)
        queued = min(max(queued, 0.0), elapsed - seconds)
        self.add(STAGE, node, seconds)
        if local:
            self.add(WAIT, node, elapsed - seconds)
        else:
            self.add(WAIT, node, queued)
            self.add(HOP, node, elapsed - seconds - queued)
        self.calls[node] = self.calls.get(node, 0) + 1


# The step the current task's engine and link calls belong to (None: not timed).
STEP_TIMES: contextvars.ContextVar[StepTimes | None] = contextvars.ContextVar("meshd_step_times", default=None)


class Totals:
    """Seconds and calls per (kind, node) since start, summed over every step: what the
    live figures take differences of each second and /metrics exports as counters."""

    def __init__(self) -> None:
        self.seconds: dict[Key, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, times: StepTimes) -> None:
        for key, s in times.parts.items():
            self.seconds[key] = self.seconds.get(key, 0.0) + s
        for node, n in times.calls.items():
            self.calls[node] = self.calls.get(node, 0) + n
