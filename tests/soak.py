"""A chaos soak: four real daemons in namespaces, concurrent greedy clients, and a fault
every ``gap`` seconds from a fixed rotation (SIGKILL + restart 10 s later, SIGSTOP 6 s,
a cable pulled 5 s, SIGTERM + restart, each on a stage or on the supernode, whichever
holds the role when it lands). Every answer is checked against the unfaulted one.

What counts as documented (README, "When a peer goes away"): a request sent straight
to a peer while it is killed, stopping or restarting (a refused or cut connection, a
503 "shutting down"). Anything else that is not exact is a defect: a wrong token, a 200
cut short, an error at a peer that was not faulted.

Used by tests/test_soak.py (bounded, a few minutes) and bench/bench_soak.py (>= 10 min).
Every wait is bounded; daemons are ended by pid by the lab.
"""

from __future__ import annotations

import datetime
import itertools
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.faultlab import Clients, Outcome, restart
from tests.meshlab import Daemon, MeshLab, greedy_reference
from tests.netlab import Lab

GiB = 1 << 30
VRAMS = (8, 4, 2, 1)
LAYER_DELAY_MS = 10.0
PROMPT = "A mesh of small machines"
TOKENS = 64
RESTART_AFTER_S = 10.0
FAULTS = ("kill", "stop", "cable", "term")


@dataclass
class Fault:
    kind: str
    victim: str  # daemon name
    role: str  # stage | supernode
    url: str
    t0: float
    t1: float = 0.0  # when the victim serves again (or the fault ended)


@dataclass
class SoakResult:
    outcomes: list[Outcome]
    faults: list[Fault]
    rss: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (seconds, name -> RSS KiB)

    def documented(self, o: Outcome) -> bool:
        """An error at a peer while it was down, stopping or restarting."""
        if o.kind == "exact" or o.kind == "wrong":
            return False
        return any(f.url == o.url and f.kind in ("kill", "term") and o.t_start < f.t1 + 2.0 and o.t_end > f.t0
                   for f in self.faults)

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for o in self.outcomes:
            key = o.kind if o.kind == "exact" else o.kind + (" (documented)" if self.documented(o) else "")
            kinds[key] = kinds.get(key, 0) + 1
        slow = max((o for o in self.outcomes if o.kind == "exact" and o.streamed), key=lambda o: o.longest_pause,
                   default=None)
        return {"requests": len(self.outcomes), "exact": kinds.get("exact", 0), "kinds": kinds,
                "faults": len(self.faults), "longest_pause_s": round(slow.longest_pause if slow else 0.0, 2),
                "longest_pause_during": self.during(slow.pause_at, slow.url) if slow else "",
                # wall clock (UTC, as the daemons' logs stamp it) and where that stream was sent
                "longest_pause_began": _wall(slow.pause_at) if slow else "",
                "longest_pause_url": slow.url if slow else "",
                "rss_mb_first_last": {name: (self.rss[0][1].get(name, 0) // 1024, self.rss[-1][1].get(name, 0) // 1024)
                                      for name in (self.rss[-1][1] if self.rss else {})}}

    def during(self, at: float, url: str) -> str:
        """The fault under way at ``at`` (or ended within 5 s of it), as kind/role/victim, and
        whether ``url`` (the entry peer) was its victim: where a pause comes from."""
        hits = [f for f in self.faults if f.t0 - 1.0 <= at <= (f.t1 or f.t0) + 5.0]
        return ", ".join(f"{f.kind}/{f.role}/{f.victim}" + (" (the entry)" if f.url == url else "")
                         for f in hits) or "no fault"

    def defects(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind != "exact" and not self.documented(o)]


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Soak:
    def __init__(self, lab: Lab, workdir: Path, model_dir: Path, log: Callable[[str], None] = print):
        self.lab, self.model_dir, self.log = lab, model_dir, log
        self.mesh = MeshLab(lab, workdir)
        self.daemons: list[Daemon] = [self.mesh.start(lab.add_host(), model=str(model_dir), vram=v * GiB,
                                                      layer_delay_ms=LAYER_DELAY_MS) for v in VRAMS]
        self.reference = greedy_reference(model_dir, PROMPT, TOKENS)
        self.mesh.wait_converged(self.daemons, n_stages=2)

    def close(self) -> None:
        for d in self.mesh.daemons:
            d.cont()
        self.mesh.close()

    def _view(self) -> dict | None:
        for d in self.daemons:
            if d.alive() and (v := d.status(timeout=2)) and v.get("serving") and len(v.get("plan", [])) >= 2:
                return v
        return None

    def _pick(self, role: str) -> Daemon | None:
        view = self._view()
        if view is None:
            return None
        ids = [view["supernode"]] if role == "supernode" else [
            a["node"] for a in view["plan"] if a["node"] != view["supernode"]]
        return next((d for d in self.daemons if d.alive() and d.node_id in ids), None)

    def _serving_again(self, d: Daemon, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (v := d.status(timeout=2)) and v.get("serving"):
                return
            time.sleep(0.5)

    def _inject(self, kind: str, role: str) -> Fault | None:
        victim = self._pick(role)
        if victim is None:
            return None
        i = self.daemons.index(victim)
        fault = Fault(kind, victim.name, role, victim.url, time.monotonic())
        self.log(f"[{time.strftime('%H:%M:%S')}] fault {kind} on {role} {victim.name}")
        if kind == "kill":
            victim.kill()
            time.sleep(RESTART_AFTER_S)
            self.daemons[i] = victim = restart(self.mesh, victim)
        elif kind == "stop":
            victim.stop()
            time.sleep(6.0)
            victim.cont()
        elif kind == "cable":
            victim.host.link_down()
            time.sleep(5.0)
            victim.host.link_up()
        elif kind == "term":
            victim.signal(signal.SIGTERM)
            try:
                victim.proc.wait(60)
            except Exception:  # noqa: BLE001 - a stop that hangs is itself the finding; kill it
                victim.kill()
            self.daemons[i] = victim = restart(self.mesh, victim)
        self._serving_again(victim)
        fault.t1 = time.monotonic()
        return fault

    def run(self, duration_s: float, gap_s: tuple[float, float], clients: int, seed: int = 16,
            rotation: list[tuple[str, str]] | None = None, min_faults: int = 0, min_exact: int = 0,
            max_s: float | None = None) -> SoakResult:
        """Faults from ``rotation`` ((kind, role) pairs, cycled; default: every kind on
        each role) until ``duration_s``, a random gap between, and on (up to ``max_s``) until
        ``min_faults`` faults landed and ``min_exact`` answers were exact: a busy machine
        runs the same soak slower, not a smaller one. Then the mesh converges."""
        rng = random.Random(seed)
        urls = [d.url for d in self.daemons]
        client = Clients([[urls[(i + j) % len(urls)] for j in range(len(urls))] for i in range(clients)],
                         PROMPT, self.reference).start()
        result = SoakResult([], [])
        t_start = time.monotonic()
        stop_rss = threading.Event()

        def sample_rss() -> None:
            while not stop_rss.is_set():
                result.rss.append((round(time.monotonic() - t_start, 1),
                                   {d.name: rss_kib(d.pid) for d in self.daemons if d.alive()}))
                stop_rss.wait(5.0)

        sampler = threading.Thread(target=sample_rss, daemon=True, name="meshd-soak-rss")
        sampler.start()
        faults = itertools.cycle(rotation or [(k, r) for k in FAULTS for r in ("stage", "supernode")])
        cap = max(duration_s, max_s or duration_s)

        def more() -> bool:
            elapsed = time.monotonic() - t_start
            short = len(result.faults) < min_faults or client.count("exact") < min_exact
            return elapsed < duration_s or (short and elapsed < cap)

        try:
            while more():
                time.sleep(rng.uniform(*gap_s))
                if not more():
                    break
                kind, role = next(faults)
                if (fault := self._inject(kind, role)) is not None:
                    result.faults.append(fault)
            time.sleep(2.0)
        finally:
            result.outcomes = client.stop()
            stop_rss.set()
            sampler.join(10)
        # One mesh again once the clients stopped (with streams in flight a join waits for them).
        self.mesh.wait_converged(self.daemons, n_stages=2, timeout=90)
        return result


def _wall(monotonic: float) -> str:
    """A time.monotonic() instant as the UTC wall-clock time the daemons' logs use."""
    wall = time.time() - (time.monotonic() - monotonic)
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat(timespec="milliseconds")
