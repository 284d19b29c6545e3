"""Chaos soak: four real daemons in namespaces (tiny model, 8/4/2/1 GiB advertised, 10 ms
per-layer delay), concurrent greedy clients spread over every peer, and a fault every
15-30 s from the rotation SIGKILL (restarted 10 s later), SIGSTOP 6 s, cable pulled
5 s, SIGTERM (restarted), each on a stage and on the supernode in turn (tests/soak.py).

Prints: requests, exact answers, errors by kind (documented: a request sent straight to a
peer while it was down or stopping), faults, the longest pause inside an exact stream
(the first token included), and each daemon's RSS over time. Exits 1 on any defect
(a wrong token, a 200 cut short, an error that is not documented).

    sudo .venv/bin/python bench/bench_soak.py [--minutes 10] [--clients 6] [--gap 15,30] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.netlab import Lab, netlab_available, reap_stale  # noqa: E402
from tests.soak import Soak  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tiny_model(workdir: Path) -> Path:
    from shards.convert import convert  # noqa: PLC0415
    from shards.tiny import write_tiny_hf_model  # noqa: PLC0415

    return convert(write_tiny_hf_model(workdir / "hf" / "tiny-llama"), workdir / "tiny-llama", progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--gap", default="15,30", help="seconds between faults: MIN,MAX")
    ap.add_argument("--model", type=Path, help="a model directory (default: the tiny test model, made here)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="copy the daemons' logs here at the end (the work dir is removed), to read a pause by")
    args = ap.parse_args()
    if not netlab_available():
        log("needs root (network namespaces)")
        return 2
    reap_stale()
    gap = tuple(float(x) for x in args.gap.split(","))
    with tempfile.TemporaryDirectory(prefix="meshd-soak-") as tmp:
        work = Path(tmp)
        model = args.model or tiny_model(work)
        lab = Lab()
        soak = None
        try:
            log(f"starting 4 daemons on {model}")
            soak = Soak(lab, work / "mesh", model, log=log)
            t0 = time.monotonic()
            result = soak.run(args.minutes * 60, gap, args.clients, seed=args.seed)
            took = time.monotonic() - t0
            summary = result.summary()
            print(f"soak: {took / 60:.1f} min, {args.clients} clients, a fault every {args.gap} s")
            print(f"requests {summary['requests']}  exact {summary['exact']}  faults {summary['faults']}  "
                  f"longest pause in an exact stream {summary['longest_pause_s']} s "
                  f"(during {summary['longest_pause_during']}; began {summary['longest_pause_began']} "
                  f"on {summary['longest_pause_url']})")
            for kind, count in sorted(summary["kinds"].items()):
                print(f"  {kind:60s} {count}")
            print("faults: " + ", ".join(f"{f.kind}/{f.role}/{f.victim}" for f in result.faults))
            print("RSS MB per daemon over time (s: " + " ".join(sorted(result.rss[0][1])) + ")")
            for t, row in result.rss[:: max(1, len(result.rss) // 20)] + result.rss[-1:]:
                print(f"  {t:7.1f}  " + "  ".join(f"{row.get(n, 0) // 1024:5d}" for n in sorted(result.rss[0][1])))
            defects = result.defects()
            for o in defects[:20]:
                print(f"DEFECT {o.kind} {o.url} {'stream' if o.streamed else 'whole'} {o.detail}")
            print(json.dumps(summary))
            return 1 if defects else 0
        finally:
            if soak is not None:
                soak.close()
            lab.close()
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for path in (work / "mesh").glob("*.log"):
                    shutil.copy2(path, args.keep / path.name)
                log(f"daemon logs kept in {args.keep}")


if __name__ == "__main__":
    sys.exit(main())
