"""Failover: how long a token stream pauses when a peer is lost, and what the replay costs.

Real ``meshd run`` daemons in network namespaces (needs root), faults injected for real:

  (a) SIGKILL of a stage peer: the gap from the kill to the next token (target < 1 s);
  (b) SIGKILL of the supernode: the entry peer resubmits the history to the next one;
  (c) SIGSTOP of a stage peer: only the heartbeat catches it (1 s beats, 3 missed);
  (d) replay cost against history length: a stream with an H-token prompt, a stage
      SIGKILLed after 2 tokens; the time from the re-plan becoming active (the
      supernode's ``plan_active``) to the next token is the replay of H + 2 positions
      through the new owners plus one decode step; the unfaulted time to first token
      (a prefill of H) is shown beside it.

(a)-(c) run on the tiny model, four daemons (8, 4, 2, 1 GiB advertised), a 10 ms per-layer
delay so that a 64-token stream lasts ~5 s and the fault lands at token 16; the stream
goes through a non-supernode peer that is not the victim. (d) runs on the real model
(SmolLM2-135M, three daemons) when it is there, else on the tiny one (512 positions).
Heartbeat flags are the defaults. After each repetition the victim is restarted on its
state dir and the mesh converges again. Every wait is bounded.

    sudo .venv/bin/python bench/bench_failover.py [--reps 3] [--histories 32,128,512,1024]
         [--model DIR] [--only a,b,c,d]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from locate import model_dir  # noqa: E402
from tests.faultlab import Stream, restart  # noqa: E402
from tests.meshlab import Daemon, MeshLab, greedy_reference  # noqa: E402
from tests.netlab import Lab, netlab_available, reap_stale  # noqa: E402

GiB = 1 << 30
TINY_PROMPT = "A mesh of small machines"
TINY_TOKENS, FAULT_AT, LAYER_DELAY_MS = 64, 16, 10.0
SENTENCES = [
    "The harbour lights came on one by one as the fishing boats returned.",
    "A mesh of small machines runs one model that none of them could hold alone.",
    "She wrote the numbers down carefully: 17, 42, 256 and 1024.",
    "Every stage keeps a cache of keys and values for each session it serves.",
    "When a peer goes quiet, the others notice after three missed heartbeats.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ts(record: dict) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


class Mesh:
    """A mesh of daemons kept whole between repetitions."""

    def __init__(self, lab: Lab, workdir: Path, model: Path, vrams: list[int], delay: float | None):
        self.mesh = MeshLab(lab, workdir)
        self.daemons = [self.mesh.start(lab.add_host(), model=str(model), vram=v * GiB, layer_delay_ms=delay)
                        for v in vrams]
        self.view: dict = {}

    def heal(self) -> dict:
        for i, d in enumerate(self.daemons):
            d.cont()
            if not d.alive():
                self.daemons[i] = restart(self.mesh, d)
        self.view = self.mesh.wait_converged(self.daemons, n_stages=2, timeout=180)
        return self.view

    def by_id(self, node_id: str) -> Daemon:
        return next(d for d in self.daemons if d.node_id == node_id)

    def roles(self) -> tuple[Daemon, Daemon, Daemon, Daemon]:
        """(supernode, heir by the election rule, a stage victim, an entry that is neither)."""
        sup = self.by_id(self.view["supernode"])
        heir = self.daemons[1]
        victim = self.by_id(next(a["node"] for a in self.view["plan"] if a["node"] != sup.node_id))
        entry = next(d for d in reversed(self.daemons) if d not in (sup, victim, heir)) \
            if len(self.daemons) > 3 else next(d for d in self.daemons if d not in (sup, victim))
        return sup, heir, victim, entry

    def close(self) -> None:
        for d in self.mesh.daemons:
            d.cont()
        self.mesh.close()


def stream_fault(url: str, prompt: str, n: int, at: int, fault, timeout: float = 180) -> tuple[Stream, float, float]:
    """A stream; ``fault()`` once ``at`` tokens arrived. (stream, fault time, epoch - monotonic)."""
    offset = time.time() - time.monotonic()
    s = Stream(url, prompt, n, timeout=timeout).start()
    s.wait_tokens(at, timeout=timeout)
    t = time.monotonic()
    fault()
    s.join(timeout)
    assert not s.errors and s.done, f"the stream failed: {s.errors or s.events[-2:]}"
    return s, t, offset


def summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"median {statistics.median(xs):.3f} s  min {min(xs):.3f}  max {max(xs):.3f}  (n={len(xs)})"


# -- (a)-(c) ---------------------------------------------------------------------------------


def bench_gaps(lab: Lab, work: Path, tiny: Path, reps: int, which: set[str]) -> dict:
    m = Mesh(lab, work / "gaps", tiny, [8, 4, 2, 1], LAYER_DELAY_MS)
    out: dict = {}
    try:
        m.heal()
        ref = greedy_reference(tiny, TINY_PROMPT, TINY_TOKENS)
        scenarios = [("a", "SIGKILL stage"), ("b", "SIGKILL supernode"), ("c", "SIGSTOP stage")]
        for key, name in scenarios:
            if key not in which:
                continue
            gaps, beats, wrong = [], [], 0
            for rep in range(reps):
                m.heal()
                sup, heir, victim, entry = m.roles()
                target = sup if key == "b" else victim
                fault = target.kill if key in "ab" else target.stop
                s, t, _ = stream_fault(entry.url, TINY_PROMPT, TINY_TOKENS, FAULT_AT, fault)
                target.cont()
                gap = s.gap_after(t)
                steady = statistics.median(s.intervals()[: FAULT_AT - 1])
                gaps.append(gap)
                beats.append(steady)
                wrong += s.tokens != ref
                log(f"({key}) {name} rep {rep + 1}: gap {gap * 1000:.0f} ms (steady {steady * 1000:.0f} ms/token), "
                    f"tokens {'equal' if s.tokens == ref else 'DIFFER'}; victim {target.name}, entry {entry.name}")
            out[key] = {"name": name, "gaps_s": [round(g, 4) for g in gaps], "steady_s": round(statistics.median(beats), 4),
                        "mismatches": wrong}
    finally:
        m.close()
    return out


# -- (d) -------------------------------------------------------------------------------------


def prompt_of(model: Path, n: int) -> tuple[str, int]:
    from shards.tokenizer import MeshTokenizer

    tok = MeshTokenizer.load(model)
    text = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(n))  # plenty
    ids = tok.encode(text)[:n]
    text = tok.decode(ids)
    return text, len(tok.encode(text))


def bench_replay(lab: Lab, work: Path, model: Path, reps: int, histories: list[int], delay: float | None) -> dict:
    vrams = [3, 2, 1]
    m = Mesh(lab, work / "replay", model, vrams, delay)
    out: dict = {}
    try:
        m.heal()
        for h in histories:
            prompt, n_tok = prompt_of(model, h)
            rows = []
            for rep in range(reps):
                m.heal()
                sup, _, victim, entry = m.roles()
                s, t, offset = stream_fault(entry.url, prompt, 8, 2, victim.kill)
                active = [r for r in sup.log_events("plan_active") if ts(r) > t + offset]
                replays = [r for r in sup.log_events("session_replay") if ts(r) > t + offset]
                assert active, "no plan_active after the kill in the supernode's log"
                t_active = ts(active[0]) - offset
                first = next(x for x in s.times if x > t)
                ttft = s.times[0] - s.t_sent
                row = {"gap_s": round(first - t, 4), "after_replan_s": round(first - t_active, 4),
                       "replan_s": round(t_active - t, 4), "ttft_s": round(ttft, 4),
                       "replayed": replays[0]["tokens"] if replays else None}
                rows.append(row)
                log(f"(d) history {n_tok}: rep {rep + 1}: {row}")
            out[n_tok] = rows
    finally:
        m.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replay-reps", type=int, default=2)
    ap.add_argument("--histories", default="32,128,512,1024")
    ap.add_argument("--model", type=Path, default=model_dir(),
                    help="the real model's directory for (d) (default: %(default)s, where `make test` puts it; "
                         "the tiny model where it is absent)")
    ap.add_argument("--only", default="a,b,c,d")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    if not netlab_available():
        log("needs root and `ip netns`")
        return 2
    which = set(args.only.split(","))
    reap_stale()
    from shards.convert import convert
    from shards.tiny import write_tiny_hf_model

    work = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    tiny = convert(write_tiny_hf_model(work / "hf" / "tiny-llama"), work / "tiny-llama", progress=False)
    real = args.model
    results: dict = {}
    t0 = time.monotonic()
    with Lab() as lab:
        if which & {"a", "b", "c"}:
            results["gaps"] = bench_gaps(lab, work, tiny, args.reps, which)
    histories = [int(x) for x in args.histories.split(",")]
    if "d" in which:
        with Lab() as lab:
            if (real / "manifest.json").is_file():
                results["replay_model"] = "smollm2-135m (3 peers, no layer delay)"
                results["replay"] = bench_replay(lab, work, real, args.replay_reps, histories, None)
            else:
                results["replay_model"] = "tiny (no real model here; 512 positions at most)"
                results["replay"] = bench_replay(lab, work, tiny, args.replay_reps, [h for h in histories if h < 500],
                                                 LAYER_DELAY_MS)
    results["seconds"] = round(time.monotonic() - t0, 1)

    print("\nfailover, heartbeat 1 s x 3 missed beats (defaults)")
    for key, r in results.get("gaps", {}).items():
        print(f"  ({key}) {r['name']:<18} gap to next token: {summary(r['gaps_s'])}; "
              f"steady {r['steady_s'] * 1000:.0f} ms/token; wrong streams {r['mismatches']}")
    if "replay" in results:
        print(f"\nreplay after a stage SIGKILL, {results['replay_model']}")
        print("  history  gap(kill->token)  re-plan  first step after re-plan  unfaulted TTFT")
        for n_tok, rows in results["replay"].items():
            med = {k: statistics.median([r[k] for r in rows]) for k in ("gap_s", "replan_s", "after_replan_s", "ttft_s")}
            print(f"  {n_tok:>7}  {med['gap_s']:>15.3f} s  {med['replan_s']:>6.3f} s  {med['after_replan_s']:>23.3f} s"
                  f"  {med['ttft_s']:>12.3f} s   (median of {len(rows)})")
    print(f"\n{results['seconds']} s in all")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
