"""systemd's notify protocol (sd_notify), without a dependency: a datagram to $NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

log = structlog.get_logger()


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None):
        self.address = address
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None

    @classmethod
    def from_env(cls) -> Notifier:
        address = os.environ.get("NOTIFY_SOCKET")
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if pid and pid != str(os.getpid()):
            usec = None
        return cls(address, int(usec) if usec and usec.isdigit() else None)

    def send(self, state: str) -> None:
        if not self.address:
            return
        addr = self.address
        if addr.startswith("@"):  # an abstract socket
            addr = "\0" + addr[1:]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            try:
                s.connect(addr)
                s.sendall(state.encode())
            except OSError as exc:
                log.warning("sd_notify_failed", state=state, error=str(exc))

    def ready(self) -> None:
        self.send("READY=1\nSTATUS=plan active, serving")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    async def watchdog(self) -> None:
        """WATCHDOG=1 from the event loop itself, so a wedged loop gets the unit restarted."""
        if self.watchdog_interval is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
