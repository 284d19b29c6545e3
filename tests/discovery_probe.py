"""Run one Discovery for a bounded time and print its events as JSON lines.

    python -m tests.discovery_probe --id n1 --mesh m --duration 15 [--interface ADDR ...]

Lines: {"ev": "ready"|"seen"|"gone"|"closing"|"exit", "t": wall-clock seconds, ...}.
SIGTERM closes gracefully (goodbye packet); --duration bounds the run regardless.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time

T0 = time.time()  # before the heavy imports, so start-up time is counted

import structlog  # noqa: E402

from meshd.control.discovery import Advert, Discovery, PeerGone, PeerSeen  # noqa: E402


def out(ev: str, **fields) -> None:
    print(json.dumps({"ev": ev, "t": time.time(), **fields}), flush=True)


async def main(args: argparse.Namespace) -> None:
    advert = Advert(node_id=args.id, name=args.name or args.id, mesh=args.mesh, version=args.version,
                    host="0.0.0.0", port=args.port, vram=args.vram, ram=args.ram, device="cpu")
    queue: asyncio.Queue = asyncio.Queue()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    disc = Discovery(advert, queue, args.interface)
    await disc.start()
    out("ready", t0=T0, interfaces=disc.interfaces)
    deadline = loop.time() + args.duration
    try:
        while not stop.is_set() and loop.time() < deadline:
            try:
                async with asyncio.timeout(min(0.2, max(0.0, deadline - loop.time()))):
                    event = await queue.get()
            except TimeoutError:
                continue
            match event:
                case PeerSeen(advert=a):
                    out("seen", **dataclasses.asdict(a))
                case PeerGone(node_id=node_id):
                    out("gone", id=node_id)
    finally:
        out("closing")
        await disc.close()
        out("exit")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--id", required=True)
    p.add_argument("--name")
    p.add_argument("--mesh", default="test")
    p.add_argument("--version", type=int, default=1)
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--vram", type=int, default=0)
    p.add_argument("--ram", type=int, default=1 << 30)
    p.add_argument("--interface", action="append")
    p.add_argument("--duration", type=float, default=20.0)
    a = p.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    asyncio.run(main(a))
