"""What recording request timelines costs the serving path, in µs.

Per lane step the scheduler makes one ``StepTimes``; each stage's call adds its share
(``StepTimes.forward``), the pipeline its head work, ``Pipeline.totals`` sums the step
and the lane's ``Chain`` links it (its running sums): that is the per-step cost,
whatever the batch. Every session of the step then gets it (``Trace.stepped``: while
it rides its lane's steps in a row, a check and an assignment): the per-token cost.
Both are timed here on a 3-stage plan (the supernode's own span and two links), the
minimum of many repeats (the least disturbed run), then a whole 64-session generation of
1000 steps, read back once (``to_json``, what /traces does). Compare with a decode
step: 15-75 ms on a CPU peer for a batch (DESIGN.md), a few ms on a GPU.

    .venv/bin/python bench/bench_trace_overhead.py
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshd.control.timing import SAMPLE, StepTimes, Totals  # noqa: E402
from meshd.serving.traces import Chain, TraceContext, TraceStore  # noqa: E402


def one_step(totals: Totals, lane: Chain) -> StepTimes:
    times = StepTimes()
    times.forward("sup", 0.004, 0.0035, local=True)
    times.forward("b", 0.006, 0.004, 0.0005)
    times.forward("c", 0.006, 0.004, 0.0005)
    times.add(SAMPLE, "sup", 0.001)
    times.ended = time.monotonic()
    totals.add(times)
    lane.link(times)
    return times


def best_us(fn, number: int, repeat: int = 15) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    totals, lane = Totals(), Chain("sup")
    per_step = best_us(lambda: one_step(totals, lane), 2000)
    store = TraceStore("sup")
    trace = store.begin("r", TraceContext.from_headers(None), "/v1/completions")
    trace.admit()
    steps = [one_step(totals, lane) for _ in range(25600)]
    trace.stepped(steps[0], True)
    it = iter(steps[1:])
    per_token = best_us(lambda: trace.stepped(next(it), True), 1000, repeat=25)

    def generation() -> None:
        traces = [store.begin(f"g{i}", TraceContext.from_headers(None), "/v1/completions") for i in range(64)]
        for t in traces:
            t.admit()
        for _ in range(1000):
            times = one_step(totals, lane)
            for t in traces:
                t.stepped(times, True)
        for t in traces:
            store.finish(t, 200)
        traces[0].to_json()

    whole = min(timeit.repeat(generation, number=1, repeat=3))
    print(f"per step (StepTimes, 3 stages, totals):      {per_step:6.2f} µs")
    print(f"per session per step (riding its lane):      {per_token:6.2f} µs")
    print(f"64 sessions x 1000 steps, finished and read: {whole * 1e3:6.1f} ms "
          f"({whole / 64000 * 1e6:.2f} µs per token)")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    main()
