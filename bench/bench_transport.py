"""What sealing peer frames costs: per frame, and in decode tokens/s on a mesh.

    sudo .venv/bin/python bench/bench_transport.py [--model DIR] [--tokens 128] [--rounds 3] [--repeat 2000]

(a) µs per frame, one side's send and the other's receive of one link, in process: the
    codec alone (encode + decode), and the codec plus the Noise channel (seal + open:
    ChaCha20-Poly1305 in 16 KiB pieces, meshd/control/secure.py), for decode frames of
    typical hidden sizes (576 SmolLM2-135M, 2048 Llama-3.2-1B, 4096 Llama-3-8B, 8192
    Llama-3-70B; fp16 and fp32; batch 1 and 8) and a 128-row prefill chunk. The median
    of ``--repeat`` runs each; the extra µs is what one hop pays for sealing.
(b) decode tok/s of two 3-peer meshes up at once in one run: one sealed (the default)
    and one with ``--debug-plaintext-links``, asked in turn for the same greedy
    completion (streamed), interleaved rounds; the best round of each, side by side.

Daemons run in network namespaces when root (tests/netlab.py), else on 127.0.0.1.
Compare within one run; the machine's other load moves both columns alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from bench_mesh import PROMPT, decode_rate, new_lab, start, stream_timed  # noqa: E402
from locate import add_model_flag, need_model  # noqa: E402
from meshd.control.secure import Channel, LocalIdentity  # noqa: E402
from shards.wire import from_wire, to_wire  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.messages import ForwardBatch, NodeId, Segment, SessionId  # noqa: E402
from tests.meshlab import MeshLab, complete  # noqa: E402

GiB = 1 << 30
SECRET = os.urandom(32).hex().encode()


def channel_pair(max_frame: int = 64 << 20) -> tuple[Channel, Channel]:
    """Both ends of one link's channel, after a real NNpsk0 handshake in memory."""
    a = LocalIdentity(NodeId("a"), "a", "bench", SECRET).noise(initiator=True)
    b = LocalIdentity(NodeId("b"), "b", "bench", SECRET).noise(initiator=False)
    b.read_message(a.write_message(b""))
    a.read_message(b.write_message(b""))
    return Channel(a, False, max_frame), Channel(b, False, max_frame)


def frame_of(rows: int, hidden: int, dtype: torch.dtype) -> ForwardBatch:
    segments = tuple(Segment(SessionId(f"s{i}"), 100, 1) for i in range(rows)) if rows <= 8 else \
        (Segment(SessionId("s0"), 0, rows),)
    return ForwardBatch(1, 1, segments, to_wire(torch.randn(rows, hidden).to(dtype)))


def per_frame_us(msg: ForwardBatch, repeat: int) -> tuple[float, float, int, int]:
    """(codec µs, codec + channel µs, frame bytes, wire bytes) per frame, medians."""
    send, recv = channel_pair()
    plain, sealed = [], []
    wire = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        data = encode(msg)
        from_wire(decode(data).hidden)
        t1 = time.perf_counter()
        data = encode(msg)
        pieces = send.seal(data)
        for p in pieces:
            out = recv.open(p)
        from_wire(decode(out).hidden)
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        sealed.append(t2 - t1)
        wire = sum(len(p) for p in pieces)
    return statistics.median(plain) * 1e6, statistics.median(sealed) * 1e6, len(data), wire


def phase_frames(args) -> list[dict]:
    cases = [(rows, h, dt) for h in (576, 2048, 4096, 8192) for dt in (torch.float16, torch.float32)
             for rows in (1, 8)] + [(128, 576, torch.float32), (128, 4096, torch.float16)]
    out = []
    for rows, hidden, dtype in cases:
        repeat = args.repeat if rows <= 8 else max(20, args.repeat // 20)
        plain, sealed, size, wire = per_frame_us(frame_of(rows, hidden, dtype), repeat)
        out.append({"rows": rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."), "bytes": size,
                    "wire_bytes": wire, "codec_us": round(plain, 1), "sealed_us": round(sealed, 1),
                    "extra_us": round(sealed - plain, 1)})
        r = out[-1]
        print(f"    {rows:4d} x {hidden:5d} {r['dtype']:8s} {size:9d} B  codec {plain:8.1f} µs  "
              f"codec+seal+open {sealed:8.1f} µs  extra {sealed - plain:7.1f} µs  (+{wire - size} B on the wire)",
              flush=True)
    return out


def phase_mesh(args, work: Path) -> dict:
    lab = new_lab()
    mesh = MeshLab(lab, work / "mesh")
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    model = str(args.model)
    try:
        meshes = {}
        for label, extra in (("sealed", ()), ("plaintext", ("--debug-plaintext-links",))):
            meshes[label] = [start(mesh, lab.add_host(), name=f"{label}{i}", model=model, mesh=f"bench-{label}",
                                   vram=(3 - i) * GiB, env=env, extra=extra) for i in range(3)]
        entry = {}
        for label, daemons in meshes.items():
            view = mesh.wait_converged(daemons, timeout=300)
            sn = next(d for d in daemons if d.node_id == view["supernode"])
            entry[label] = sn
            print(f"(b) {label}: converged, plan {[(a['start'], a['stop']) for a in view['plan']]}", flush=True)
            complete(sn.url, PROMPT, 8)  # warm-up: first forwards allocate
        rates: dict[str, list[float]] = {k: [] for k in meshes}
        outputs = {}
        for _ in range(args.rounds):
            for label, sn in entry.items():
                toks, times = stream_timed(sn.url, PROMPT, args.tokens)
                rates[label].append(decode_rate(times))
                outputs.setdefault(label, toks)
                print(f"    round: {label} {len(toks)} tokens, decode {rates[label][-1]:.2f} tok/s", flush=True)
        return {"rates": rates, "same_tokens": outputs["sealed"] == outputs["plaintext"], "threads": args.threads}
    finally:
        mesh.close()
        lab.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flag(p)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=2000, help="runs per frame size in (a)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--skip-mesh", action="store_true", help="only (a)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"bench_transport: (a) {args.repeat} runs per decode frame size; (b) {args.tokens} greedy tokens, "
          f"{args.rounds} rounds", flush=True)
    print("\n(a) one hop's frame, send + receive, median:")
    frames = phase_frames(args)
    if args.skip_mesh:
        return 0
    args.model = need_model(args.model).resolve()
    work = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    res = phase_mesh(args, work)
    sealed, plain = max(res["rates"]["sealed"]), max(res["rates"]["plaintext"])
    print(f"\n(b) 3-peer mesh decode, same tokens: {res['same_tokens']} (logs in {work})")
    print(f"    sealed (default)        {sealed:6.2f} tok/s  (rounds {[round(r, 2) for r in res['rates']['sealed']]})")
    print(f"    --debug-plaintext-links {plain:6.2f} tok/s  (rounds {[round(r, 2) for r in res['rates']['plaintext']]})")
    print(f"    sealed / plaintext = {sealed / plain:.3f}")
    small = next(f for f in frames if f["rows"] == 1 and f["hidden"] == 576 and f["dtype"] == "float32")
    print(f"    for scale: sealing a 576-wide decode frame costs {small['extra_us']} µs per hop and direction")
    return 0


if __name__ == "__main__":
    sys.exit(main())
