"""The mesh against one node, on the real model, with real daemons (not a test).

    sudo .venv/bin/python bench/bench_mesh.py [--model DIR] [--tokens 128] [--rounds 2] [--threads 2]

(a) decode tokens/s of a 3-peer mesh over one node: one ``meshd run`` alone (mesh
    "bench-solo") and three in a mesh ("bench-trio"), all up at once, each asked in
    turn for the same greedy completion (streamed; decode rate = tokens after the first
    over the time between the first and the last token); the best round of each.
(b) time from a simultaneous start of 4 daemons (one with the model, three with only
    its name and empty state dirs, fetching their spans) to a converged active plan.
(c) bytes on the wire per decode step per hop: the codec's encoded size of a decode
    ForwardBatch and its ResultBatch (hidden 576, fp32), and the kernel's counters
    of each stage host's interface over a long and a one-token generation (the
    difference is decode only), less the idle rate (heartbeats).

Daemons run in network namespaces on a bridge (tests/netlab.py) when root; otherwise on
127.0.0.1 with mDNS bound to loopback. Prints the figures; compare within one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from locate import add_model_flag, need_model  # noqa: E402
from tests.meshlab import PORT, MeshLab, complete  # noqa: E402
from tests.netlab import Lab, netlab_available, reap_stale  # noqa: E402

GiB = 1 << 30
PROMPT = "The three most important things to know about Python are"


# -- loopback stand-in for a namespace lab ------------------------------------------------


@dataclass
class LoopHost:
    lab: LoopLab
    name: str
    addr: str = "127.0.0.1"
    procs: list = field(default_factory=list)

    def popen(self, argv, **kw):
        proc = subprocess.Popen(argv, **kw)
        self.procs.append(proc)
        self.lab.procs.append(proc)
        return proc

    def run(self, argv, **kw):
        kw.setdefault("timeout", 60)
        return subprocess.run(argv, **kw)


class LoopLab:
    """Hosts that are all 127.0.0.1 (distinct ports); no link counters."""

    namespaces = False

    def __init__(self) -> None:
        self.procs: list = []
        self.n = 0

    def add_host(self) -> LoopHost:
        self.n += 1
        return LoopHost(self, f"h{self.n}")

    def uplink(self) -> str:
        return "127.0.0.1"

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def new_lab():
    if netlab_available():
        reap_stale()
        lab = Lab()
        lab.namespaces = True
        return lab
    return LoopLab()


_ports = iter(range(18470, 18600))


def start(ml: MeshLab, host, **kw):
    """A daemon in ``host``; on loopback each gets its own port (mDNS runs on the
    host's address either way, 127.0.0.1 there)."""
    port = PORT if getattr(ml.lab, "namespaces", False) else next(_ports)
    return ml.start(host, port=port, **kw)


# -- measuring ----------------------------------------------------------------------------


def stream_timed(url: str, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """Greedy streamed completion: the token ids and the arrival time of each."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read()[:300])
    tokens, times = [], []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.perf_counter()
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            raise RuntimeError(event["error"])
        for c in event["choices"]:
            for t in c.get("token_ids", []):
                tokens.append(t)
                times.append(now)
    conn.close()
    return tokens, times


def decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def iface_bytes(host) -> tuple[int, int] | None:
    """(rx, tx) bytes of a lab host's eth0, from the kernel."""
    if not isinstance(host, LoopHost):
        out = host.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/tx_bytes"],
                       capture_output=True, text=True)
        rx, tx = out.stdout.split()
        return int(rx), int(tx)
    return None


def codec_sizes(hidden: int = 576) -> dict[str, int]:
    import torch

    from protocol.codec import encode
    from protocol.messages import ForwardBatch, ResultBatch, Segment
    from shards.wire import to_wire

    sid = "0123456789abcdef"  # a session id as the scheduler makes them (8 random bytes, hex)
    x = torch.zeros(1, hidden, dtype=torch.float32)
    sizes = {"ForwardBatch": len(encode(ForwardBatch(7, 1000, (Segment(sid, 100, 1),), to_wire(x)))),
             "ResultBatch": len(encode(ResultBatch(7, 1000, to_wire(x))))}
    return sizes


# -- the phases ---------------------------------------------------------------------------


def phase_speed(args, work: Path) -> dict:
    lab = new_lab()
    mesh = MeshLab(lab, work / "speed")
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    model = str(args.model)
    try:
        solo = start(mesh, lab.add_host(), name="solo", model=model, mesh="bench-solo", vram=GiB, env=env)
        trio = [start(mesh, lab.add_host(), name=f"trio{i}", model=model, mesh="bench-trio", vram=(3 - i) * GiB,
                      env=env) for i in range(3)]
        mesh.wait_converged([solo], timeout=300)
        view = mesh.wait_converged(trio, timeout=300)
        names = {d.node_id: d.name for d in trio}
        plan = [(names.get(a["node"], a["node"]), a["start"], a["stop"]) for a in view["plan"]]
        sn = next(d for d in trio if d.node_id == view["supernode"])
        stages = [d for d in trio if d is not sn and any(a["node"] == d.node_id for a in view["plan"])]
        print(f"(a) up: solo and trio converged; trio supernode {sn.name}, plan {plan}", flush=True)
        for d in (solo, sn):  # warm-up: first forwards allocate
            complete(d.url, PROMPT, 8)

        rates: dict[str, list[float]] = {"solo": [], "trio": []}
        outputs = {}
        for _ in range(args.rounds):
            for label, d in (("solo", solo), ("trio", sn)):
                toks, times = stream_timed(d.url, PROMPT, args.tokens)
                rates[label].append(decode_rate(times))
                outputs.setdefault(label, toks)
                print(f"    round: {label} {len(toks)} tokens, decode {rates[label][-1]:.2f} tok/s", flush=True)

        # (c) measured: per stage host, a long and a one-token generation, less idle.
        wire = {}
        if stages and iface_bytes(stages[0].host) is not None:
            def counters():
                return {d.name: iface_bytes(d.host) for d in stages}

            c0, t0 = counters(), time.monotonic()
            time.sleep(3.0)
            c1, idle_s = counters(), time.monotonic() - t0
            idle = {k: (c1[k][0] - c0[k][0]) / idle_s + (c1[k][1] - c0[k][1]) / idle_s for k in c0}
            b0, t0 = counters(), time.monotonic()
            toks_long, _ = stream_timed(sn.url, PROMPT, args.tokens)
            b1, long_s = counters(), time.monotonic() - t0
            toks_one, _ = stream_timed(sn.url, PROMPT, 1)
            b2, one_s = counters(), time.monotonic() - t0 - long_s
            steps = len(toks_long) - len(toks_one)
            for k in b0:
                long_b = (b1[k][0] - b0[k][0]) + (b1[k][1] - b0[k][1]) - idle[k] * long_s
                one_b = (b2[k][0] - b1[k][0]) + (b2[k][1] - b1[k][1]) - idle[k] * one_s
                rx_step = ((b1[k][0] - b0[k][0]) - (b2[k][0] - b1[k][0])) / steps
                tx_step = ((b1[k][1] - b0[k][1]) - (b2[k][1] - b1[k][1])) / steps
                wire[k] = {"bytes_per_step": round((long_b - one_b) / steps, 1), "rx_per_step": round(rx_step, 1),
                           "tx_per_step": round(tx_step, 1), "idle_bytes_per_s": round(idle[k], 1), "steps": steps}
        return {"solo_tok_s": rates["solo"], "trio_tok_s": rates["trio"], "plan": plan,
                "tokens": {k: len(v) for k, v in outputs.items()}, "same_tokens": outputs["solo"] == outputs["trio"],
                "wire": wire, "threads": args.threads}
    finally:
        mesh.close()
        lab.close()


def phase_start(args, work: Path, present: bool = False) -> dict:
    """(b): with ``present``, every daemon has the model's shards already (the
    issue's figure); else one has them and three fetch their spans."""
    lab = new_lab()
    mesh = MeshLab(lab, work / ("start-present" if present else "start"))
    try:
        hosts = [lab.add_host() for _ in range(4)]  # before the clock: the lab is not the mesh
        ds = [start(mesh, hosts[0], name="s0", model=str(args.model), vram=4 * GiB)]
        ds += [start(mesh, h, name=f"s{i}", model=str(args.model) if present else args.model.name,
                     vram=(4 - i) * GiB)
               for i, h in enumerate(hosts[1:], start=1)]
        view = mesh.wait_converged(ds, timeout=600)
        t0 = min(d.started_wall for d in ds)
        fetched = {}
        for d in ds:
            recs = d.log_events("shard_fetched")
            active = next((r for r in d.log_events("plan_active") if r.get("term") == view["term"]), None)
            until = active["timestamp"] if active else "~"
            fetched[d.name] = sum(r["bytes"] for r in recs if r["timestamp"] <= until)
        first_active = {d.name: _wall(r["timestamp"]) - t0 for d in ds
                        for r in d.log_events("plan_active")[:1]}
        names = {d.node_id: d.name for d in ds}
        return {"converged_s": view["converged_s"],
                "plan": [(names.get(a["node"], a["node"]), a["start"], a["stop"]) for a in view["plan"]],
                "term": view["term"], "bytes_fetched_before_active": fetched, "first_plan_active_s": first_active}
    finally:
        mesh.close()
        lab.close()


def _wall(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flag(p)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per daemon (1: on shared cores, OpenMP barriers under contention cost 10x)")
    p.add_argument("--skip-start", action="store_true", help="skip (b)")
    args = p.parse_args()
    args.model = need_model(args.model).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-mesh-"))
    mode = "network namespaces" if netlab_available() else "loopback (no namespaces)"
    print(f"bench_mesh: model {args.model.name}, {args.tokens} greedy tokens, {args.rounds} rounds, "
          f"{args.threads} torch threads per daemon, {mode}; logs in {work}", flush=True)

    sizes = codec_sizes()
    print("\n(c) codec, one decode row (hidden 576 fp32 = 2304 bytes of data):")
    for k, v in sizes.items():
        print(f"    {k:13s} {v} bytes encoded (+4 WebSocket header from the server side, +8 from the dialer)")
    fwd, res = sizes["ForwardBatch"], sizes["ResultBatch"]
    print(f"    per hop per decode step: {fwd} + {res} = {fwd + res} bytes of frames")

    speed = phase_speed(args, work)
    solo, trio = max(speed["solo_tok_s"]), max(speed["trio_tok_s"])
    print(f"\n(a) decode, {speed['tokens']} tokens, same tokens: {speed['same_tokens']}; plan {speed['plan']}")
    print(f"    single node  {solo:6.2f} tok/s  (rounds {[round(r, 2) for r in speed['solo_tok_s']]})")
    print(f"    3-peer mesh  {trio:6.2f} tok/s  (rounds {[round(r, 2) for r in speed['trio_tok_s']]})")
    print(f"    mesh / single = {trio / solo:.3f}")
    if speed["wire"]:
        print("\n(c) measured on each stage host's eth0 (kernel counters: frames + WebSocket + TCP/IP + acks):")
        for k, w in speed["wire"].items():
            print(f"    {k}: {w['bytes_per_step']} bytes per decode step (rx {w['rx_per_step']}, "
                  f"tx {w['tx_per_step']}; over {w['steps']} steps; idle {w['idle_bytes_per_s']} B/s subtracted)")
    if not args.skip_start:
        present = phase_start(args, work, present=True)
        print(f"\n(b) 4 daemons started together, shards present on each: converged active plan "
              f"in {present['converged_s']:.2f} s [target < 5 s] (plan {present['plan']})")
        print(f"    first plan_active per daemon, s after the first spawn: "
              f"{ {k: round(v, 2) for k, v in present['first_plan_active_s'].items()} }")
        st = phase_start(args, work)
        print(f"\n(b) 4 daemons started together (1 with the model, 3 fetching): converged active plan "
              f"in {st['converged_s']:.2f} s (term {st['term']}, plan {st['plan']})")
        print(f"    first plan_active per daemon, s after the first spawn: "
              f"{ {k: round(v, 2) for k, v in st['first_plan_active_s'].items()} }")
        print(f"    bytes fetched before the plan went active: {st['bytes_fetched_before_active']}")
    print(json.dumps({"a": speed, "b": None if args.skip_start else st, "c": sizes}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
