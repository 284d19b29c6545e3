"""Live figures: one sample a second into a ring of the last 15 minutes, on every peer.

What a sample holds is what this peer sees as supernode (elsewhere most of it is zero:
``serving/observe.py`` answers a member's ``/live`` with its supernode's samples):
tokens/s, requests running and queued, TTFT p50/p95 over the last minute, KV positions
reserved and held by the prefix cache, and per peer of the plan its stage time, its
wait for its engine and the hop (ms per call, from ``Pipeline.totals``), how busy its
span was and its link's ping RTT. Sampling reads counters and a handful of dicts; the
serving path pays nothing for it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import cast

from meshd.control.mesh import MeshView
from meshd.control.timing import HOP, STAGE, WAIT, Totals, ms
from meshd.serving.scheduler import Scheduler
from meshd.serving.traces import TraceStore

INTERVAL_S = 1.0
WINDOW_S = 900  # 15 minutes of samples
RECENT = 12  # recent requests in a /live answer


class LiveFeed:
    """The ring of samples and the task that fills it (owned by the node's TaskGroup)."""

    def __init__(self, view: MeshView, name: str, scheduler: Scheduler, totals: Callable[[], Totals],
                 traces: TraceStore, batches: Callable[[], list[dict]], interval_s: float = INTERVAL_S,
                 window_s: int = WINDOW_S):
        self.view = view
        self.name = name  # this peer's name
        self.scheduler = scheduler
        self.totals = totals
        self.traces = traces
        self.batches = batches
        self.interval_s = interval_s
        self.samples: collections.deque[dict] = collections.deque(maxlen=max(1, int(window_s / interval_s)))
        self.seq = 0
        self._last: tuple[float, int, dict, dict] | None = None  # (when, tokens, seconds, calls) at the last sample

    async def run(self) -> None:
        due = time.monotonic()
        while True:
            due += self.interval_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if time.monotonic() - due > self.interval_s:  # the loop was stalled: no burst of catch-up samples
                due = time.monotonic()
            self.sample()

    def sample(self) -> dict:
        now = time.monotonic()
        totals = self.totals()
        tokens = self.scheduler.tokens_generated
        seconds, calls = dict(totals.seconds), dict(totals.calls)
        last = self._last
        self._last = (now, tokens, seconds, calls)
        dt = now - last[0] if last is not None else 0.0
        running, queued = self.traces.counts()
        p50, p95 = self.traces.ttft_quantiles()
        self.seq += 1
        sample = {
            "seq": self.seq, "t": round(time.time(), 3),
            "tokens_per_s": round((tokens - last[1]) / dt, 2) if last is not None and dt > 0 else 0.0,
            "running": running, "queued": queued,
            "ttft_p50_ms": ms(p50), "ttft_p95_ms": ms(p95),
            "kv_reserved": self.scheduler.reserved_tokens, "kv_prefix": self.scheduler.prefix.held,
            "kv_budget": self.scheduler.kv_budget_tokens,
            "peers": self._peers(dt, seconds, calls, last),
        }
        self.samples.append(sample)
        return sample

    def _peers(self, dt: float, seconds: dict, calls: dict, last) -> dict[str, dict]:
        """Per peer of the plan (and each linked one): ms per call of its stage, its wait
        and the hop over the last interval (None without calls), its busy share, its RTT."""
        view = self.view
        nodes = [a.node for a in view.plan.assignments] if view.plan is not None else []
        nodes += [pid for pid in sorted(view.links) if pid not in nodes]
        before_s, before_c = (last[2], last[3]) if last is not None else ({}, {})
        out: dict[str, dict] = {}
        for node in nodes:
            n = calls.get(node, 0) - before_c.get(node, 0)
            spent = {kind: seconds.get((kind, node), 0.0) - before_s.get((kind, node), 0.0)
                     for kind in (STAGE, WAIT, HOP)}
            link = view.links.get(node)
            out[node] = {
                "calls": n,
                "stage_ms": ms(spent[STAGE] / n) if n else None,
                "wait_ms": ms(spent[WAIT] / n) if n else None,
                "hop_ms": ms(spent[HOP] / n) if n and node != view.node_id else None,
                "busy": round(min(1.0, spent[STAGE] / dt), 3) if dt > 0 else 0.0,
                "rtt_ms": round(link.rtt_ms, 3) if link is not None and link.rtt_ms is not None else None,
            }
        return out

    def since(self, seq: int) -> list[dict]:
        """The samples after ``seq`` (all of them for 0, or for a seq from before a restart)."""
        if seq <= 0 or seq > self.seq:
            return list(self.samples)
        return [s for s in self.samples if s["seq"] > seq]

    def snapshot(self, since: int = 0) -> dict:
        """This peer's /live answer."""
        view = self.view
        peers = [{"id": view.node_id, "name": self.name, "layers": view.span_of(view.node_id),
                  "role": view.role(view.node_id), "self": True}]
        for pid, link in sorted(view.links.items()):
            peers.append({"id": pid, "name": link.hello.name, "layers": view.span_of(pid), "role": view.role(pid)})
        return {
            "node": view.node_id, "source": view.node_id, "supernode": view.supernode,
            # (``samples`` is made with a maxlen: the window)
            "interval_s": self.interval_s, "window_s": int(cast(int, self.samples.maxlen) * self.interval_s),
            "seq": self.seq, "samples": self.since(since), "peers": peers,
            "plan": [a.node for a in view.plan.assignments] if view.plan is not None else [],
            "batches": [b | {"peer": view.node_id} for b in self.batches()],
            "recent": self.traces.recent(RECENT),
        }
