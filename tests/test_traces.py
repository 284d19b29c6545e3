"""A request's timeline as arithmetic: steps folded into phases that add up to the wall
time, the W3C trace context parsed as the spec says, and the bounds of what is kept."""

from __future__ import annotations

import time

import pytest

from meshd.control.timing import StepTimes
from meshd.serving.traces import Chain, Trace, TraceContext, TraceStore

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def step(began: float, ended: float, chain: Chain | None = None, **parts: float) -> StepTimes:
    """A step that ran from ``began`` to ``ended`` with these parts (``stage_a=0.01``),
    linked into ``chain`` (its lane) when given."""
    st = StepTimes()
    st.began, st.ended = began, ended
    for key, seconds in parts.items():
        kind, node = key.split("_")
        st.add(kind, node, seconds)
    if chain is not None:
        chain.link(st)
    return st


def phases(trace: Trace) -> dict[tuple[str, str], dict]:
    return {(p["kind"], p["peer"]): p for p in trace.to_json()["phases"]}


def test_a_stage_cannot_claim_more_than_its_call_took():
    st = StepTimes()
    st.forward("b", elapsed=0.010, seconds=5.0, queued=3.0)  # a peer that lies, or a clock that jumps
    st.forward("c", elapsed=0.010, seconds=-1.0, queued=0.004)
    st.forward("a", elapsed=0.010, seconds=0.006, local=True)
    assert st.parts == {("stage", "b"): 0.010, ("wait", "c"): 0.004, ("hop", "c"): 0.006,
                        ("stage", "a"): 0.006, ("wait", "a"): pytest.approx(0.004)}
    assert st.calls == {"b": 1, "c": 1, "a": 1}


@pytest.mark.parametrize("lane", [False, True], ids=["steps-alone", "lane-runs"])
def test_phases_add_up_to_the_wall_time_split_at_the_first_token(lane):
    """The same steps give the same phases whether a session adds them up one by one or
    as runs of its lane's steps."""
    now = time.monotonic()
    chain = Chain("a") if lane else None
    t = Trace("r1", TraceContext(TRACE_ID, SPAN), "/v1/completions", "a")
    t.arrived = now - 1.0
    t.admitted = t.last_end = now - 0.99
    # Prefill: waits 10 ms, then a step of 100 ms: 60 ms stage a, 30 ms stage b + hop, 10 ms unaccounted.
    t.stepped(step(now - 0.98, now - 0.88, chain, stage_a=0.06, stage_b=0.02, hop_b=0.01), token=True)
    # Decode: two steps whose parts ran side by side (200 ms of work in 100 ms), 20 ms apart.
    t.stepped(step(now - 0.80, now - 0.70, chain, stage_a=0.1, stage_b=0.1), token=True)
    t.stepped(step(now - 0.68, now - 0.58, chain, stage_a=0.05, sample_a=0.01), token=True)
    t.end(200)
    got = phases(t)
    assert sum(p["ms"] for p in got.values()) == pytest.approx(t.wall_s * 1000, abs=1e-3)
    assert got[("admit", "a")]["prefill_ms"] == pytest.approx(10.0, abs=1e-3)
    assert got[("queue", "a")]["prefill_ms"] == pytest.approx(10.0, abs=1e-3)
    assert got[("queue", "a")]["decode_ms"] == pytest.approx(80.0 + 20.0, abs=1e-3)
    assert got[("stage", "a")]["prefill_ms"] == pytest.approx(60.0, abs=1e-3)
    assert got[("stage", "a")]["decode_ms"] == pytest.approx(50.0 + 50.0, abs=1e-3)  # the overlap scaled by 1/2
    assert got[("scheduler", "a")]["prefill_ms"] == pytest.approx(10.0, abs=1e-3)
    assert got[("scheduler", "a")]["decode_ms"] == pytest.approx(40.0, abs=1e-3)
    assert got[("stream", "a")]["decode_ms"] >= 580.0
    assert t.to_json()["overlap_ms"] == pytest.approx(100.0, abs=1e-3)
    assert t.to_json()["ttft_ms"] == pytest.approx(120.0, abs=1e-3)
    assert [p["kind"] for p in t.to_json(order={"a": 0, "b": 1}.get)["phases"]] == \
        ["admit", "queue", "stage", "stage", "hop", "sample", "scheduler", "stream"]


def test_a_session_left_out_of_a_step_or_moved_to_another_lane_counts_only_its_own():
    """Runs break where a session skips a step of its lane (a batch session left out) or
    changes lane: the step it missed is queue to it, and another lane's sums are not its."""
    now = time.monotonic()
    lane, other = Chain("a"), Chain("a")
    t = Trace("r4", TraceContext(TRACE_ID, SPAN), "/v1/completions", "a")
    t.arrived = t.admitted = t.last_end = now - 1.0
    other_step = step(now - 1.0, now - 0.9, other, stage_a=0.1)  # a step of another lane, before it came
    del other_step
    t.stepped(step(now - 0.9, now - 0.8, other, stage_a=0.1), token=True)  # its first token, in lane "other"
    t.stepped(step(now - 0.8, now - 0.7, lane, stage_a=0.1), token=True)  # a decode lane from here on
    step(now - 0.7, now - 0.6, lane, stage_a=0.1)  # left out of this one
    t.stepped(step(now - 0.6, now - 0.5, lane, stage_a=0.1), token=True)
    t.stepped(step(now - 0.5, now - 0.4, lane, stage_a=0.1), token=True)
    t.end(200)
    got = phases(t)
    assert got[("stage", "a")]["prefill_ms"] == pytest.approx(100.0, abs=1e-3)
    assert got[("stage", "a")]["decode_ms"] == pytest.approx(300.0, abs=1e-3)
    assert got[("queue", "a")]["decode_ms"] == pytest.approx(100.0, abs=1e-3)  # the step it sat out
    assert sum(p["ms"] for p in got.values()) == pytest.approx(t.wall_s * 1000, abs=1e-3)
    assert t.n_steps == 4


def test_a_long_generation_costs_a_session_no_memory_per_step():
    now = time.monotonic()
    lane = Chain("a")
    t = Trace("r2", TraceContext(TRACE_ID, SPAN), "/v1/completions", "a")
    t.arrived = t.admitted = t.last_end = now - 10.0
    for i in range(1000):
        t.stepped(step(now - 10.0 + i * 0.005, now - 10.0 + i * 0.005 + 0.004, lane, stage_a=0.004), token=True)
        if i == 500:
            assert t.to_json()["phases"]  # read while it runs: what it has so far
    assert not hasattr(t, "__dict__") and t.run_last is not None  # a run: its ends, not its steps
    t.end(200)
    got = phases(t)
    assert got[("stage", "a")]["ms"] == pytest.approx(4000.0, abs=1e-2)
    assert got[("queue", "a")]["ms"] == pytest.approx(999 * 1.0, abs=1e-2)  # 1 ms between steps
    assert sum(p["ms"] for p in got.values()) == pytest.approx(t.wall_s * 1000, abs=1e-3)


def test_a_refused_request_is_all_admission():
    t = Trace("r3", TraceContext(TRACE_ID, SPAN), "/v1/completions", "a")
    t.end(400)
    phases = t.to_json()["phases"]
    assert [p["kind"] for p in phases] == ["admit"]  # (its ms rounds to 0.0 on a fast box: not asserted)
    assert phases[0]["ms"] == pytest.approx(t.wall_s * 1000, abs=1e-3)


@pytest.mark.parametrize("header, kept", [
    (f"00-{TRACE_ID}-{SPAN}-01", True),
    (f"00-{TRACE_ID}-{SPAN}-00", True),
    (f"01-{TRACE_ID}-{SPAN}-01-what-a-later-version-adds", True),  # a newer version: read what we know
    (f"00-{TRACE_ID}-{SPAN}-01-extra", False),  # version 00 is exactly 55 characters
    (f"ff-{TRACE_ID}-{SPAN}-01", False),
    (f"00-{'0' * 32}-{SPAN}-01", False),
    (f"00-{TRACE_ID}-{'0' * 16}-01", False),
    (f"00-{TRACE_ID.upper()}-{SPAN}-01", False),
    (f"00-{TRACE_ID[:-1]}-{SPAN}-01", False),
    ("", False), (None, False), ("garbage", False),
])
def test_traceparent_as_the_w3c_spec_reads_it(header, kept):
    ctx = TraceContext.from_headers(header, "vendor=abc")
    if kept:
        assert (ctx.trace_id, ctx.parent_id, ctx.state) == (TRACE_ID, SPAN, "vendor=abc")
        assert ctx.span_id != SPAN and ctx.flags == header[53:55]
    else:  # a new trace; the tracestate goes with the traceparent it came with
        assert ctx.trace_id != TRACE_ID and ctx.parent_id is None and ctx.state == ""
    assert len(ctx.trace_id) == 32 and len(ctx.span_id) == 16
    assert ctx.header() == f"00-{ctx.trace_id}-{ctx.span_id}-{ctx.flags}"


def test_the_store_keeps_the_last_few_hundred_and_finds_them_by_either_id():
    store = TraceStore("a", keep=5)
    traces = [store.begin(f"r{i}", TraceContext.from_headers(None), "/v1/completions") for i in range(8)]
    assert store.counts() == (0, 8)
    traces[0].first_step = time.monotonic()
    assert store.counts() == (1, 7)
    for t in traces:
        store.finish(t, 200)
    assert store.counts() == (0, 0) and list(store.finished) == [f"r{i}" for i in range(3, 8)]
    assert store.get("r1") is None and store.get("r7") is traces[7]
    assert store.get(traces[4].ctx.trace_id) is traces[4]
    assert [r["request_id"] for r in store.recent(3)] == ["r7", "r6", "r5"]
