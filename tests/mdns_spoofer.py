"""An attacker on the LAN without the mesh secret, spoofing mDNS: it advertises the
node ids of real peers at its own address, and keeps changing the adverts.

    python -m tests.mdns_spoofer --interface ADDR --mesh lab --version V \
        --victim ID [--victim ID ...] --duration 60 [--period 0.2]

For each victim it registers ``--names`` services under names of its own, plus one
under the victim's exact service name (registered without the uniqueness probe, as a
responder that ignores the rules would). Every ``--period`` seconds each service's
TXT moves to another port: one of the impostor ports, where a WebSocket server
answers the handshake with random bytes, or a port nobody listens on. The TXT claims
more VRAM than any real peer, so a peer that believed it would elect the attacker.

Prints JSON lines: {"ev": "ready"|"updates"|"exit", ...}. Bounded by --duration
whatever happens; SIGTERM ends it early, with its "exit" line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import time

from aiohttp import web
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from meshd.control.discovery import SERVICE_TYPE

GiB = 1 << 30


def out(ev: str, **fields) -> None:
    print(json.dumps({"ev": ev, "t": time.time(), **fields}), flush=True)


async def impostor(host: str, port: int, accepted: list[int]) -> web.AppRunner:
    """A /mesh/ws that answers the dialer's first handshake message with noise."""

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        accepted[0] += 1
        await ws.receive()
        await ws.send_bytes(os.urandom(96))
        await ws.receive()
        return ws

    app = web.Application()
    app.router.add_get("/mesh/ws", ws_handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def info(name: str, victim: str, args: argparse.Namespace, port: int) -> AsyncServiceInfo:
    txt = {"v": str(args.version), "id": victim, "mesh": args.mesh, "name": f"spoof-{victim}",
           "vram": str(512 * GiB), "ram": str(512 * GiB), "dev": "cuda", "port": str(port)}
    return AsyncServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port, properties=txt,
                            server=f"spoof-{name[:40]}.local.", addresses=[socket.inet_aton(args.interface)])


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.duration
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    accepted = [0]
    runners = [await impostor(args.interface, p, accepted) for p in args.impostor_port]
    ports = itertools.cycle(args.impostor_port + args.closed_port)
    zc = AsyncZeroconf(interfaces=[args.interface], ip_version=IPVersion.V4Only)
    services: list[tuple[str, str]] = []
    for victim in args.victim:
        services += [(f"{victim}-{i}", victim) for i in range(args.names)]
        services.append((victim[:63], victim))  # the real service's own name
    infos = {}
    for name, victim in services:
        infos[name] = info(name, victim, args, next(ports))
        await (await zc.async_register_service(infos[name], cooperating_responders=True))
    out("ready", services=[n for n, _ in services])
    updates = 0
    try:
        while loop.time() < deadline and not stop.is_set():
            await asyncio.sleep(args.period)
            for name, victim in services:
                infos[name] = info(name, victim, args, next(ports))
                await zc.async_update_service(infos[name])  # announced in the background
                updates += 1
            if updates % (10 * len(services)) == 0:
                out("updates", updates=updates, accepted=accepted[0])
    finally:
        out("exit", updates=updates, accepted=accepted[0])
        await zc.async_close()
        for r in runners:
            await r.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--interface", required=True)
    p.add_argument("--mesh", required=True)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--victim", action="append", required=True)
    p.add_argument("--names", type=int, default=3, help="services under names of its own, per victim")
    p.add_argument("--impostor-port", type=int, action="append", default=[])
    p.add_argument("--closed-port", type=int, action="append", default=[])
    p.add_argument("--period", type=float, default=0.2)
    p.add_argument("--duration", type=float, default=60.0)
    asyncio.run(main(p.parse_args()))
