"""Codec cost per hop: encode + decode of the frames one decode step sends, in µs.

One row per session (a decode step) at SmolLM2-135M's width, fp32 (CPU) and fp16
(CUDA), for one session and a 16-session batch, the request and its answer. Beside
``protocol.codec`` it times the floor: msgpack alone packing and unpacking the same
map (the tensor as raw bytes), so the ratio is what checking and building typed
messages costs on top. Median of several timed runs, best of three rounds.

    .venv/bin/python bench/bench_codec.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402
import torch  # noqa: E402

from protocol.codec import decode, encode  # noqa: E402
from protocol.messages import ForwardBatch, ResultBatch, Segment, SessionId  # noqa: E402
from shards.wire import from_wire, to_wire  # noqa: E402

HIDDEN = 576


def frames(sessions: int, dtype: torch.dtype):
    hidden = to_wire(torch.randn(sessions, HIDDEN).to(dtype))
    segments = tuple(Segment(SessionId(f"{i:016x}"), 100 + i, 1) for i in range(sessions))
    return ForwardBatch(7, 1000, segments, hidden), ResultBatch(7, 1000, hidden)


def best_us(fn, number: int, repeat: int) -> float:
    return min(statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6 for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs (200 x 3 instead of 2000 x 5)")
    number, repeat = (200, 3) if ap.parse_args().quick else (2000, 5)
    print(f"{'frame':<28}{'bytes':>8}{'codec µs':>10}{'msgpack µs':>12}{'ratio':>7}")
    for sessions in (1, 16):
        for dtype in (torch.float32, torch.float16):
            for msg in frames(sessions, dtype):
                data = encode(msg)
                raw = msgpack.unpackb(data, raw=False)

                def floor() -> None:
                    msgpack.unpackb(msgpack.packb(raw, use_bin_type=True), raw=False)

                # as a link does it: the tensor in, the frame out, and a tensor back
                ours = best_us(lambda: from_wire(decode(encode(msg)).hidden), number, repeat)
                base = best_us(floor, number, repeat)
                name = f"{type(msg).__name__} {sessions}x{HIDDEN} {str(dtype)[6:]}"
                print(f"{name:<28}{len(data):>8}{ours:>10.1f}{base:>12.1f}{ours / base:>7.1f}")


if __name__ == "__main__":
    main()
