"""Fault-injection helpers on top of ``tests.meshlab`` (which stays as it is).

    s = Stream(entry.url, PROMPT, 64).start()   # a streamed completion read on a thread
    s.wait_tokens(16)                           # ... until 16 token ids have arrived
    victim.kill()                               # the fault, for real
    s.join()                                    # every token id, each with its arrival time
    s.gap_after(t_fault)                        # seconds from the fault to the next token

    d2 = restart(mesh, victim)                  # the same argv and state dir: the same node id

Everything is bounded in time; the stream runs on a daemon thread so a hung
mesh cannot hang the test process past its timeout.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tests.meshlab import POLL_S, Daemon, MeshLab, daemon_env, plan_spans

STREAM_TIMEOUT_S = 120.0
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Stream:
    """One streamed completion, read event by event with arrival times."""

    url: str
    prompt: str | list[int]
    max_tokens: int
    extra: dict = field(default_factory=dict)  # e.g. temperature, seed
    timeout: float = STREAM_TIMEOUT_S
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() of each token's arrival
    events: list = field(default_factory=list)
    error: BaseException | None = None
    t_sent: float = 0.0

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="meshd-test-stream")
        self._got = threading.Condition()

    def body(self) -> dict:
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "stream": True} | self.extra

    def start(self) -> Stream:
        self._thread.start()
        return self

    def _run(self) -> None:
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        try:
            self.t_sent = time.monotonic()
            conn.request("POST", "/v1/completions", json.dumps(self.body()), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise AssertionError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            data: list[str] = []
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                raw = resp.readline()
                if not raw:
                    break
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data: "):
                    data.append(line[6:])
                elif line == "" and data:
                    self._event("\n".join(data))
                    data = []
                    if self.events and self.events[-1] == "[DONE]":
                        break
        except BaseException as exc:  # handed to join()
            self.error = exc
        finally:
            conn.close()
            with self._got:
                self._got.notify_all()

    def _event(self, payload: str) -> None:
        now = time.monotonic()
        event = payload if payload == "[DONE]" else json.loads(payload)
        with self._got:
            self.events.append(event)
            if isinstance(event, dict):
                for choice in event.get("choices", []):
                    for tok in choice.get("token_ids", []):
                        self.tokens.append(tok)
                        self.times.append(now)
            self._got.notify_all()

    def wait_tokens(self, n: int, timeout: float = 60.0) -> float:
        """Until ``n`` tokens have arrived; the arrival time of the n-th."""
        deadline = time.monotonic() + timeout
        with self._got:
            while len(self.tokens) < n:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise AssertionError(f"{len(self.tokens)} of {n} tokens within {timeout:.0f} s "
                                         f"(error: {self.error!r}, events {self.events[-3:]})")
                self._got.wait(min(left, 0.5))
            return self.times[n - 1]

    def join(self, timeout: float | None = None) -> list[int]:
        self._thread.join(self.timeout if timeout is None else timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the stream did not end within {self.timeout:.0f} s; {len(self.tokens)} tokens")
        if self.error is not None:
            raise AssertionError(f"the stream failed after {len(self.tokens)} tokens: {self.error!r}")
        return list(self.tokens)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    def gap_after(self, t: float) -> float:
        """Seconds from ``t`` to the first token that arrived after it."""
        after = [x for x in self.times if x > t]
        assert after, f"no token arrived after the fault ({len(self.tokens)} in all)"
        return after[0] - t

    def longest_silence(self, since: float) -> float:
        """The longest wait from ``since`` on: to the first token after it, or between two
        tokens after it (0.0 when none came)."""
        return self.longest_silence_span(since)[1]

    def longest_silence_span(self, since: float) -> tuple[float, float]:
        """(when it began, how long) of ``longest_silence(since)``."""
        after = [since] + [x for x in self.times if x > since]
        return max(((a, b - a) for a, b in zip(after, after[1:])), key=lambda span: span[1], default=(since, 0.0))

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


def restart(mesh: MeshLab, old: Daemon) -> Daemon:
    """Start ``old``'s command again in its host, with its state dir (so its node id)."""
    assert not old.alive(), f"{old.name} is still running"
    with open(old.log_path, "ab") as log:
        proc = old.host.popen(old.argv, stdout=log, stderr=subprocess.STDOUT, env=daemon_env(), cwd=REPO)
    d = dataclasses.replace(old, proc=proc, started=time.monotonic(), started_wall=time.time())
    mesh.daemons.append(d)
    return d


def wait_status(mesh: MeshLab, daemon: Daemon, ok, what: str, timeout: float = 30.0) -> dict:
    """Until ``ok(status)`` holds on ``daemon``'s /status; that status."""
    deadline = time.monotonic() + timeout
    last = None
    for _ in range(int(timeout / POLL_S) + 1):
        last = daemon.status(timeout=2)
        if last is not None and ok(last):
            return last
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    brief = None if last is None else {k: last.get(k) for k in ("supernode", "term", "serving", "reason")} | {
        "plan": plan_spans(last), "peers": [(p["id"], p["state"]) for p in last.get("peers", [])]}
    raise AssertionError(f"{daemon.name}: not {what} within {timeout:.0f} s; last /status {brief}"
                         + mesh.fail_report())


def peer_state(view: dict, node_id: str) -> str | None:
    return next((p["state"] for p in view.get("peers", []) if p["id"] == node_id), None)


def plan_nodes(view: dict) -> set[str]:
    return {a["node"] for a in view.get("plan", [])}


# -- concurrent clients under faults --------------------------------------------------------


@dataclass
class Outcome:
    """One request's end: ``kind`` is exact, wrong (a token differs), truncated (a 200 that
    ended short: no [DONE], or a missing finish reason), or error:<what> (a status or an
    error event: the client was told)."""

    kind: str
    url: str
    streamed: bool
    t_start: float
    t_end: float
    longest_pause: float = 0.0  # between consecutive tokens (streams), seconds
    detail: str = ""
    pause_at: float = 0.0  # when the longest pause began (time.monotonic())


class Clients:
    """``n`` threads, each sending greedy completions of ``prompt`` in turn to its urls
    (streamed and whole alternately) until ``stop()``; every answer is checked against
    ``want``. Bounded: each request by STREAM_TIMEOUT_S, the whole by the caller's stop."""

    def __init__(self, urls_per_client: list[list[str]], prompt: str, want: list[int], extra: dict | None = None):
        self.urls = urls_per_client
        self.prompt, self.want, self.extra = prompt, want, extra or {}
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"meshd-client-{i}")
                         for i in range(len(urls_per_client))]

    def start(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = STREAM_TIMEOUT_S) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            return list(self.outcomes)

    def count(self, kind: str) -> int:
        """How many answers so far were of ``kind`` (e.g. "exact")."""
        with self._lock:
            return sum(o.kind == kind for o in self.outcomes)

    def swap_url(self, old: str, new: str) -> None:
        """A restarted daemon keeps its address; a client that lost one may move."""
        for urls in self.urls:
            urls[:] = [new if u == old else u for u in urls]

    def _loop(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            urls = self.urls[i]
            url = urls[k % len(urls)]
            streamed = (k + i) % 3 != 2  # two streams, then one whole answer
            k += 1
            t0 = time.monotonic()
            outcome = self._streamed(url, t0) if streamed else self._whole(url, t0)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.kind.startswith("error"):
                self._stop.wait(0.5)  # as a client would, before its retry

    def _streamed(self, url: str, t0: float) -> Outcome:
        s = Stream(url, self.prompt, len(self.want), dict(self.extra), timeout=STREAM_TIMEOUT_S).start()
        s._thread.join(STREAM_TIMEOUT_S + 5)
        end = time.monotonic()
        pause_at, pause = s.longest_silence_span(s.t_sent)  # the first token too
        if s.errors:
            return Outcome("error:" + _error_kind(s.errors[-1]["error"]), url, True, t0, end,
                           detail=str(s.errors[-1])[:300])
        if s.error is not None:
            text = str(s.error)
            kind = "error:http " + text.split(":")[0].removeprefix("HTTP ") if text.startswith("HTTP") else (
                "error:connection" if not s.tokens else "truncated")
            return Outcome(kind, url, True, t0, end, detail=text[:300])
        finish = [c.get("finish_reason") for e in s.events if isinstance(e, dict)
                  for c in e.get("choices", []) if c.get("finish_reason")]
        if not s.done or finish[-1:] != ["length"]:
            return Outcome("truncated" if s.tokens == self.want[:len(s.tokens)] else "wrong", url, True, t0, end,
                           detail=f"{len(s.tokens)} tokens, done {s.done}, finish {finish[-1:]}")
        return Outcome("exact" if s.tokens == self.want else "wrong", url, True, t0, end, pause,
                       detail="" if s.tokens == self.want else f"got {s.tokens}", pause_at=pause_at)

    def _whole(self, url: str, t0: float) -> Outcome:
        from tests.meshlab import completion_body, http_json

        try:
            status, data = http_json(url + "/v1/completions", completion_body(self.prompt, len(self.want)) | self.extra,
                                     timeout=STREAM_TIMEOUT_S)
        except (OSError, ValueError) as exc:  # the connection died (a killed entry), or a cut body
            return Outcome("error:connection", url, False, t0, time.monotonic(), detail=str(exc)[:300])
        end = time.monotonic()
        if status != 200:
            return Outcome(f"error:http {status} " + _error_kind(data.get("error") or {}), url, False, t0, end,
                           detail=json.dumps(data)[:300])
        choice = data["choices"][0]
        if choice.get("finish_reason") not in ("stop", "length"):
            return Outcome("truncated", url, False, t0, end, detail=json.dumps(choice)[:300])
        ok = choice["token_ids"] == self.want and choice["finish_reason"] == "length"
        return Outcome("exact" if ok else "wrong", url, False, t0, end, detail="" if ok else json.dumps(choice)[:300])


def _error_kind(err: dict) -> str:
    """A short name for an error the client was told (its code, and its message's gist)."""
    message = str(err.get("message", ""))
    for gist in ("shutting down", "supernode moved", "not the supernode", "KV cache budget", "no new supernode",
                 "could not finish", "no supernode serves", "no active plan", "timed out"):
        if gist in message:
            return f"{err.get('code')}: {gist}"
    return f"{err.get('code')}: {message[:60]}"


def summarize(outcomes: list[Outcome]) -> dict:
    """Counts by kind, and the longest pause of an exact stream."""
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    pauses = [o.longest_pause for o in outcomes if o.kind == "exact" and o.streamed]
    return {"requests": len(outcomes), "kinds": kinds, "longest_pause_s": round(max(pauses, default=0.0), 2)}
