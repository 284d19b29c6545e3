"""Request timelines: where a request's time went, across peers, kept for the last few
hundred requests; and the W3C trace context (``traceparent``) each request carries.

A ``Trace`` is one completion request on this peer. On the supernode it holds the
moments that split its wall time: arrival, admission (body read, tokenized, KV
reserved), the steps that carried its first choice (``control/timing.StepTimes``,
shared with the other sessions of the step), and the end. A lane keeps running sums
of its steps (``Chain``), so a session that rides a run of its lane's steps in a row
adds them up with one subtraction when the run ends (it changes lane, is left out of
a step, gets its first token, ends): a step costs a session a few attribute reads,
not a sum per part. That gives a partition of the wall time into phases:

- ``admit``: arrival to admission (the body, tokenizing, the KV reservation)
- ``queue``: admitted, waiting for a step that carries it (before its first, between two)
- ``wait`` per peer: in that peer's engine queue behind other calls
- ``stage`` per peer: the forward through its span (what the stage reports)
- ``hop`` per peer: the link there and back (network, sealing, msgpack)
- ``sample``: the supernode's embedding, head and sampling
- ``scheduler``: in a step, the rest (Python between the calls, waiting for a plan)
- ``stream``: after the last step, to the answer's end
- ``proxy`` (at the entry peer, added when a trace is read there): its own part and the tunnel

each split into its prefill part (until the first token) and its decode part. Steps
whose parts ran side by side (a wave, a pipelined prefill) are scaled to their length,
so the phases always add up to the wall time; ``overlap_ms`` says by how much they ran
in parallel. An entry peer keeps a short record of the requests it proxied and merges
it with the supernode's trace when asked (``serving/observe.py``).
"""

from __future__ import annotations

import collections
import itertools
import re
import secrets
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass

from meshd.control.timing import HOP, SAMPLE, STAGE, WAIT, Key, StepTimes

KEEP = 256  # finished requests kept, newest first out
TTFT_WINDOW_S = 60.0  # live TTFT percentiles: first tokens of the last minute
ADMIT, QUEUE, SCHEDULER, STREAM, PROXY = "admit", "queue", "scheduler", "stream", "proxy"
OVERLAP: Key = ("overlap", "")  # in a chain's sums: seconds of parts that ran side by side
KIND_ORDER = {ADMIT: 0, QUEUE: 1, WAIT: 2, STAGE: 2, HOP: 2, SAMPLE: 3, SCHEDULER: 4, STREAM: 5, PROXY: 6}
PER_STAGE = {WAIT: 0, STAGE: 1, HOP: 2}  # within one peer's block, in the order a call sees them
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


# -- W3C trace context ----------------------------------------------------------------

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A request's place in a distributed trace (https://www.w3.org/TR/trace-context/):
    the caller's trace id (or a new one), the caller's span (``parent_id``, None when the
    trace starts here) and this peer's own span, which goes on upstream and back in the
    answer's ``traceparent``."""

    trace_id: str
    span_id: str
    flags: str = "01"
    parent_id: str | None = None
    state: str = ""  # tracestate, passed on as it came

    @classmethod
    def from_headers(cls, traceparent: str | None, tracestate: str | None = None) -> TraceContext:
        """The caller's context when its ``traceparent`` is valid, else a new trace (as the
        spec says: an invalid traceparent is ignored, and its tracestate with it)."""
        span = secrets.token_hex(8)
        m = _TRACEPARENT.fullmatch(traceparent.strip()) if traceparent else None
        if m is not None:
            version, trace_id, parent, flags, rest = m.groups()
            valid = (version != "ff" and trace_id != "0" * 32 and parent != "0" * 16
                     and (version != "00" or rest is None))  # version 00 is exactly 55 characters
            if valid:
                state = tracestate.strip() if tracestate and _TRACESTATE.fullmatch(tracestate.strip()) else ""
                return cls(trace_id, span, flags, parent, state)
        return cls(secrets.token_hex(16), span)

    def header(self) -> str:
        """This peer's span as a ``traceparent`` value (version 00)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


# -- one request ------------------------------------------------------------------------


class Trace:
    """One completion request on this peer (see the module's docstring)."""

    __slots__ = ("request_id", "ctx", "path", "node", "entry", "supernode", "proxied", "started", "arrived",
                 "admitted", "ended", "first_step", "first_token", "status", "prompt_tokens",
                 "completion_tokens", "n_steps", "prefill", "decode", "last_end", "run_base", "run_last",
                 "overlap", "sessions")

    def __init__(self, request_id: str, ctx: TraceContext, path: str, node: str, entry: str | None = None):
        self.request_id = request_id
        self.ctx = ctx
        self.path = path
        self.node = node  # this peer
        self.entry = entry  # the member that proxied it here, if one did
        self.supernode: str | None = None  # where an entry peer sent it
        self.proxied = False  # this peer only proxied it (its trace is the supernode's)
        self.started = time.time()
        self.arrived = time.monotonic()
        self.admitted: float | None = None
        self.ended: float | None = None
        self.first_step: float | None = None
        self.first_token: float | None = None
        self.status: int | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.n_steps = 0
        self.prefill: dict[Key, float] = {}  # (kind, node) -> seconds, until the first token
        self.decode: dict[Key, float] = {}  # and after it
        self.last_end = 0.0  # end of the last step added up (or admission)
        self.run_base: dict[Key, float] | None = None  # the chain's sums before the run of steps it rides now
        self.run_last: StepTimes | None = None  # the last step of that run
        self.overlap = 0.0
        self.sessions: list = []  # its choices' sessions, for the token counts

    # -- recording (the scheduler's and the API's) --

    def admit(self) -> None:
        self.admitted = self.last_end = time.monotonic()

    def stepped(self, times: StepTimes, token: bool) -> None:
        """A step (or a pipelined prefill) that carried this request's first choice;
        ``token``: it gave a token. The hot path: most calls only move ``run_last``."""
        if self.ended is not None:  # its answer ended while the step's lane still held it
            return
        self.n_steps += 1
        last = self.run_last
        if last is not None and times.chain is last.chain and times.seq == last.seq + 1:
            self.run_last = times  # the next step of its lane: still the same run
        else:
            if self.first_step is None:
                self.first_step = times.began
            prefill = self.first_token is None
            self._close_run(prefill)
            if times.began > self.last_end:  # waiting for this step
                self._add(QUEUE, self.node, times.began - self.last_end, prefill)
            if times.sums is None:  # a step of no lane (a pipelined prefill): on its own
                for key, seconds in shares(times, self.node):
                    self._add(*key, seconds, prefill)
                self.last_end = max(self.last_end, times.ended)
            else:
                self.run_base, self.run_last = times.base, times
        if token and self.first_token is None:
            self._close_run(prefill=True)
            self.first_token = times.ended

    def _add(self, kind: str, node: str, seconds: float, prefill: bool) -> None:
        if seconds > 0.0:
            sums = self.prefill if prefill else self.decode
            if kind == OVERLAP[0]:
                self.overlap += seconds
            else:
                sums[(kind, node)] = sums.get((kind, node), 0.0) + seconds

    def _close_run(self, prefill: bool) -> None:
        """The run of lane steps ridden so far into the sums: its last step's running sums
        less those before its first (its steps' shares and the gaps between them)."""
        last = self.run_last
        if last is None:
            return
        base = self.run_base or {}
        assert last.sums is not None  # run_last is always a lane's step: Chain.link gave it sums
        for key, total in last.sums.items():
            self._add(*key, total - base.get(key, 0.0), prefill)
        self.last_end = max(self.last_end, last.ended)
        self.run_base = self.run_last = None

    def end(self, status: int) -> None:
        self.ended = time.monotonic()
        self.status = status
        if self.sessions:
            self.prompt_tokens = sum(s.prompt_len for s in self.sessions)
            self.completion_tokens = sum(len(s.generated) for s in self.sessions)
        self.sessions = []
        if self.proxied:
            self._add(PROXY, self.node, self.ended - self.arrived, True)
            return
        prefill = self.first_token is None
        self._close_run(prefill)
        if self.admitted is None:  # refused before admission: it was all admission
            self._add(ADMIT, self.node, self.ended - self.arrived, True)
            return
        self._add(ADMIT, self.node, self.admitted - self.arrived, True)
        # after the last step (or, with none, since admission): the answer's end
        self._add(STREAM if self.n_steps else QUEUE, self.node, self.ended - self.last_end, prefill)

    # -- reading --

    @property
    def done(self) -> bool:
        return self.ended is not None

    @property
    def wall_s(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.arrived

    def summary(self) -> dict:
        if self.sessions:  # running: its tokens so far
            self.completion_tokens = sum(len(s.generated) for s in self.sessions)
        return {
            "request_id": self.request_id, "trace_id": self.ctx.trace_id, "path": self.path,
            "state": "done" if self.done else "running", "status": self.status, "started": round(self.started, 3),
            "wall_ms": round(self.wall_s * 1000, 3),
            "ttft_ms": None if self.first_token is None else round((self.first_token - self.arrived) * 1000, 3),
            "completion_tokens": self.completion_tokens, "entry": self.entry,
            "proxied_to": self.supernode if self.proxied else None,
        }

    def to_json(self, layers: Callable[[str], list[int] | None] = lambda node: None,
                order: Callable[[str], int] = lambda node: 0) -> dict:
        """The timeline: phases in the order a request meets them (stages in plan order:
        ``order(node)``), each with its prefill and decode seconds."""
        self._close_run(self.first_token is None)  # a running request: what it has so far (a new run follows)
        phases: list[dict[str, Any]] = []
        for kind, node in {**self.prefill, **self.decode}:
            pre, dec = self.prefill.get((kind, node), 0.0), self.decode.get((kind, node), 0.0)
            phase: dict[str, Any] = {"kind": kind, "peer": node, "prefill_ms": round(pre * 1000, 3),
                                     "decode_ms": round(dec * 1000, 3), "ms": round((pre + dec) * 1000, 3)}
            if kind in PER_STAGE:
                phase["layers"] = layers(node)
            phases.append(phase)
        phases.sort(key=lambda p: (KIND_ORDER[p["kind"]], order(p["peer"]) if p["kind"] in PER_STAGE else 0,
                                   PER_STAGE.get(p["kind"], 0)))
        out = self.summary() | {
            "span_id": self.ctx.span_id, "parent_id": self.ctx.parent_id, "node": self.node,
            "supernode": self.supernode if self.proxied else self.node,
            "prompt_tokens": self.prompt_tokens, "steps": self.n_steps,
            "overlap_ms": round(self.overlap * 1000, 3), "phases": phases,
        }
        return out


def shares(st: StepTimes, node: str) -> list[tuple[Key, float]]:
    """A step's parts as its sessions' timelines take them: scaled to its length where
    they ran side by side (with the overlap, under ``OVERLAP``), else with the rest of the
    step as the scheduler's (``node``: this peer)."""
    length = max(0.0, st.ended - st.began)
    total = sum(st.parts.values())
    if total > length:
        scale = length / total
        return [(key, s * scale) for key, s in st.parts.items()] + [(OVERLAP, total - length)]
    return [*st.parts.items(), ((SCHEDULER, node), length - total)]


class Chain:
    """One lane's steps in order, with running sums: after each step, the seconds of every
    part (``shares``) and of the gaps between its steps since the lane began. A session that
    rode steps i..j of the lane in a row spent ``sums(j) - base(i)`` in them; the lane pays
    for the sums once per step, whatever its batch."""

    __slots__ = ("node", "sums", "last", "seq")

    def __init__(self, node: str):
        self.node = node
        self.sums: dict[Key, float] = {}
        self.last: StepTimes | None = None
        self.seq = 0

    def link(self, st: StepTimes) -> None:
        """``st`` (ended) as the lane's next step: its number, and the sums before and after it."""
        base = dict(self.sums)
        if self.last is not None and st.began > self.last.ended:
            key = (QUEUE, self.node)
            base[key] = base.get(key, 0.0) + (st.began - self.last.ended)
        after = dict(base)
        for key, seconds in shares(st, self.node):
            after[key] = after.get(key, 0.0) + seconds
        self.seq += 1
        st.chain, st.seq, st.base, st.sums = self, self.seq, base, after
        self.sums, self.last = after, st


# -- the store ----------------------------------------------------------------------------


class TraceStore:
    """This peer's requests: those running, and the last ``keep`` finished (by request id)."""

    def __init__(self, node: str, keep: int = KEEP, on_done: Callable[[Trace], None] | None = None):
        self.node = node
        self.keep = keep
        self.on_done = on_done
        self.active: dict[int, Trace] = {}
        self.finished: collections.OrderedDict[str, Trace] = collections.OrderedDict()
        self.ttfts: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    def begin(self, request_id: str, ctx: TraceContext, path: str, entry: str | None = None) -> Trace:
        trace = Trace(request_id, ctx, path, self.node, entry)
        self.active[id(trace)] = trace
        return trace

    def finish(self, trace: Trace, status: int) -> None:
        if self.active.pop(id(trace), None) is None:
            return
        trace.end(status)
        self.finished.pop(trace.request_id, None)  # a repeated id: the newest stands
        self.finished[trace.request_id] = trace
        while len(self.finished) > self.keep:
            self.finished.popitem(last=False)
        if trace.first_token is not None:
            self.ttfts.append((trace.first_token, trace.first_token - trace.arrived))
        if self.on_done is not None:
            self.on_done(trace)

    def get(self, key: str) -> Trace | None:
        """The newest request with this request id (or this trace id)."""
        for trace in reversed(self.active.values()):
            if key in (trace.request_id, trace.ctx.trace_id):
                return trace
        if (found := self.finished.get(key)) is not None:
            return found
        return next((t for t in reversed(self.finished.values()) if t.ctx.trace_id == key), None)

    def recent(self, n: int = 20) -> list[dict]:
        """The newest ``n`` requests: running ones first (at most half of them, so that a
        busy peer still shows finished ones), then finished ones."""
        running = [t.summary() for t in itertools.islice(
            (t for t in reversed(self.active.values()) if not t.proxied), n // 2)]
        done = [t.summary() for t in itertools.islice(reversed(self.finished.values()), n - len(running))]
        return running + done

    def counts(self) -> tuple[int, int]:
        """(running, queued): requests this peer serves that have had a step, and those
        admitted or arriving that have not (proxied ones count at their supernode)."""
        running = queued = 0
        for t in self.active.values():
            if t.proxied:
                continue
            if t.first_step is None:
                queued += 1
            else:
                running += 1
        return running, queued

    def ttft_quantiles(self, qs: tuple[float, ...] = (0.5, 0.95), window_s: float = TTFT_WINDOW_S
                       ) -> list[float | None]:
        """Quantiles of the time to first token of the requests whose first token came in
        the last ``window_s`` (None when none did)."""
        cutoff = time.monotonic() - window_s
        values = sorted(s for at, s in self.ttfts if at >= cutoff)
        if not values:
            return [None for _ in qs]
        return [values[min(len(values) - 1, int(q * len(values)))] for q in qs]
