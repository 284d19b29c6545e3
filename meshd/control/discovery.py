"""mDNS discovery: advertise this node and turn zeroconf's browser into events.

zeroconf's callbacks only put events on the queue, or start a TXT resolution in
a task this object owns. mDNS finds peers and hears goodbyes; it cannot tell a
crashed peer from a live one (PTR TTLs are >= 1125 s), so liveness is the peer
link's heartbeat, not this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass

import ifaddr
import structlog
from zeroconf import IPVersion, NonUniqueNameException, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from meshd.errors import ConfigError

log = structlog.get_logger(__name__)

SERVICE_TYPE = "_meshd._tcp.local."
VIRTUAL_PREFIXES = ("docker", "veth", "br-", "virbr", "vnet", "tun", "tap", "cni", "flannel", "cali", "zt", "wg")
RESOLVE_TIMEOUT_MS = 3000
RELIST_S = 5.0  # every advert listed now is told again this often (see Discovery._relist_loop)
MAX_SERVICES = 256  # services of our type kept at once: a flood of names cannot grow memory
MAX_HOSTS = 4  # IPv4 addresses taken from one service (a multi-homed peer lists several)
CLOSE_TIMEOUT_S = 3.0
_IP_MULTICAST_ALL = 49  # Linux; not exported by the socket module


@dataclass(frozen=True, slots=True)
class Advert:
    node_id: str
    name: str
    mesh: str
    version: int
    host: str
    port: int
    vram: int
    ram: int
    device: str

    def txt(self) -> dict[str, str]:
        return {"v": str(self.version), "id": self.node_id, "mesh": self.mesh, "name": self.name,
                "vram": str(self.vram), "ram": str(self.ram), "dev": self.device, "port": str(self.port)}

    @classmethod
    def from_info(cls, info: AsyncServiceInfo) -> Advert:
        """Raises KeyError/ValueError on a TXT record that is not ours."""
        return cls.all_from_info(info)[0]

    @classmethod
    def all_from_info(cls, info: AsyncServiceInfo) -> list[Advert]:
        """One advert per IPv4 address of the service (at most MAX_HOSTS; one with
        ``host=""`` where there is none). Raises KeyError/ValueError on a TXT record
        that is not ours."""
        txt = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
        advert = cls(node_id=txt["id"], name=txt.get("name", txt["id"]), mesh=txt["mesh"],
                     version=int(txt["v"]), host="", port=int(txt["port"]),
                     vram=int(txt["vram"]), ram=int(txt["ram"]), device=txt["dev"])
        hosts = info.parsed_addresses(IPVersion.V4Only)[:MAX_HOSTS]
        return [dataclasses.replace(advert, host=h) for h in hosts] or [advert]


@dataclass(frozen=True, slots=True)
class PeerSeen:
    advert: Advert


@dataclass(frozen=True, slots=True)
class PeerGone:
    node_id: str


DiscoveryEvent = PeerSeen | PeerGone


def _is_up(name: str) -> bool:
    """IFF_UP from SIOCGIFFLAGS (asks the kernel of our own namespace; /sys may be stale)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            flags = fcntl.ioctl(s, 0x8913, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return False
    return bool(struct.unpack_from("H", flags, 16)[0] & 0x1)


def default_interfaces(adapters: list[ifaddr.Adapter] | None = None, is_up=_is_up) -> list[str]:
    """IPv4 addresses of the UP, non-loopback, non-virtual interfaces."""
    out = []
    for adapter in ifaddr.get_adapters() if adapters is None else adapters:
        name = adapter.nice_name
        if name.startswith(VIRTUAL_PREFIXES) or not is_up(name):
            continue
        for ip in adapter.ips:
            if ip.is_IPv4:
                addr = ipaddress.IPv4Address(ip.ip)
                if not (addr.is_loopback or addr.is_link_local):
                    out.append(str(addr))
    return out


def _confine(zc: Zeroconf, interfaces: list[str]) -> None:
    """Keep mDNS on the chosen interfaces only.

    zeroconf's listen socket is bound to 0.0.0.0:5353. Linux would by default
    hand it multicast from any interface where some other socket joined the
    group (IP_MULTICAST_ALL), and zeroconf answers a unicast query through the
    socket it came in on. So: no foreign groups, and in loopback mode the socket
    is pinned to `lo`, so nothing ever leaves through a real NIC.
    """
    loopback_only = all(ipaddress.IPv4Address(a).is_loopback for a in interfaces)
    for reader in zc.engine.readers:
        sock = reader.transport.get_extra_info("socket")
        if sock is None or sock.getsockname()[0] != "0.0.0.0":
            continue
        with contextlib.suppress(OSError):  # not Linux: the option does not exist
            sock.setsockopt(socket.IPPROTO_IP, _IP_MULTICAST_ALL, 0)
        if loopback_only:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")


class Discovery:
    def __init__(self, advert: Advert, queue: asyncio.Queue, interfaces: list[str] | None = None) -> None:
        self.advert = advert
        self.queue = queue
        if interfaces is None:
            interfaces = default_interfaces()
            if not interfaces:
                log.warning("mdns_no_interfaces", fallback="127.0.0.1",
                            hint="no UP non-virtual IPv4 interface; only peers on this host will be "
                                 "found; use --mdns-interface ADDR or --peer HOST:PORT")
        self.interfaces = list(interfaces) or ["127.0.0.1"]
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._resolving: dict[str, asyncio.Task] = {}  # service name -> its resolution
        self._seen: dict[str, tuple[Advert, ...]] = {}  # service name -> what it resolved to last
        self._relist: asyncio.Task | None = None
        self._ignored: dict[str, str] = {}  # service name -> why, so each is logged once

    def _service_info(self, instance: str | None = None) -> AsyncServiceInfo:
        a, label = self.advert, self.advert.node_id[:63]
        return AsyncServiceInfo(
            SERVICE_TYPE, f"{instance or label}.{SERVICE_TYPE}", port=a.port, properties=a.txt(),
            server=f"meshd-{label[:50]}.local.", addresses=[socket.inet_aton(i) for i in self.interfaces])

    async def start(self) -> None:
        a = self.advert
        self._info = self._service_info()
        try:
            self._zc = AsyncZeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        except OSError as e:
            raise ConfigError(f"mdns: cannot bind {self.interfaces} (--mdns-interface): {e}") from e
        await self._zc.zeroconf.async_wait_for_start()
        bound = {t.transport.get_extra_info("sockname")[0] for t in self._zc.zeroconf.engine.senders}
        if missing := [i for i in self.interfaces if i not in bound]:
            log.warning("mdns_interface_unusable", addresses=missing, hint="not an address of this host?")
        if not bound:
            await self._zc.async_close()
            self._zc = None
            raise ConfigError(f"mdns: none of {self.interfaces} can be bound (--mdns-interface)")
        _confine(self._zc.zeroconf, self.interfaces)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        self._relist = asyncio.get_running_loop().create_task(self._relist_loop())
        try:
            await (await self._zc.async_register_service(self._info, allow_name_change=False))
        except NonUniqueNameException:
            # Anyone on the LAN can answer for our name (mDNS proves nothing), and node ids
            # outlive restarts: refusing to start would let a stranger keep this peer down.
            # The TXT record carries the node id, so the instance name is only a label: take
            # one nobody can have guessed. (A copied state dir, two peers with one node id,
            # is told apart where it can be: their handshake refuses a link to oneself.)
            taken = self._info.name
            self._info = self._service_info(f"{a.node_id[:50]}-{secrets.token_hex(4)}")
            await (await self._zc.async_register_service(self._info, allow_name_change=True))
            log.warning("mdns_name_taken", name=taken, advertised_as=self._info.name,
                        hint="another advert answers for this node id: a spoofer on the LAN, "
                             "or a copy of this state dir (delete its node-id file)")
        log.info("mdns_started", interfaces=self.interfaces, node=a.node_id, mesh=a.mesh)

    @property
    def peers(self) -> dict[str, Advert]:
        """Peers mDNS lists now, by node id. A peer that crashed and came back with the
        same advert makes no event (its records did not change): redial from here."""
        return {a.node_id: a for adverts in self._seen.values() for a in adverts}

    async def update(self, advert: Advert) -> None:
        """Re-announce new TXT fields (same node id); peers get PeerSeen again."""
        assert self._zc is not None and advert.node_id == self.advert.node_id
        self.advert = advert
        self._info = self._service_info(self._info.name.removesuffix(f".{SERVICE_TYPE}") if self._info else None)
        await (await self._zc.async_update_service(self._info))

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if self._zc is None:  # closing
            return
        if task := self._resolving.pop(name, None):
            task.cancel()
        if state_change is ServiceStateChange.Removed:
            self._ignored.pop(name, None)
            if adverts := self._seen.pop(name, None):
                self._emit(PeerGone(adverts[0].node_id))
            return
        task = asyncio.get_running_loop().create_task(self._resolve(self._zc, name))
        self._resolving[name] = task
        task.add_done_callback(lambda t: self._resolving.get(name) is t and self._resolving.pop(name))

    async def _resolve(self, zc: AsyncZeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.info("mdns_unresolved", service=name)
            return
        try:
            adverts = tuple(Advert.all_from_info(info))
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            return self._ignore(name, f"malformed TXT: {e!r}")
        advert = adverts[0]
        if advert.node_id == self.advert.node_id:
            return self._ignore(name, "self")
        if advert.mesh != self.advert.mesh:
            return self._ignore(name, f"mesh {advert.mesh!r} is not ours")
        if advert.version != self.advert.version:
            return self._ignore(name, f"protocol version {advert.version} != {self.advert.version}")
        if not advert.host:
            return self._ignore(name, "no IPv4 address")
        if name not in self._seen and len(self._seen) >= MAX_SERVICES:
            return self._ignore(name, f"already {MAX_SERVICES} services listed")
        self._ignored.pop(name, None)
        if self._seen.get(name) != adverts:
            self._seen[name] = adverts
            for a in adverts:
                self._emit(PeerSeen(a))

    async def _relist_loop(self) -> None:
        """Tell every advert listed now again, every RELIST_S. The link keeper holds a
        bounded set of addresses per node id, and anyone on the LAN can advertise any
        node id: a real peer's address that a flood of spoofed ones pushed out comes
        back from here, while the service still lists it, even though it never changed."""
        while True:
            await asyncio.sleep(RELIST_S)
            for adverts in list(self._seen.values()):
                for a in adverts:
                    self._emit(PeerSeen(a))

    def _ignore(self, name: str, why: str) -> None:
        if self._ignored.get(name) != why:
            if len(self._ignored) >= MAX_SERVICES:  # only there to log each once: a flood of names forgets
                self._ignored.clear()
            self._ignored[name] = why
            (log.debug if why == "self" else log.info)("mdns_ignored", service=name, why=why)

    def _emit(self, event: DiscoveryEvent) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            log.error("discovery_queue_full", dropped=repr(event))

    async def close(self) -> None:
        """Goodbye packet first (peers drop us in ~ms), then the browser and sockets.
        Safe to call twice, and after a failed start."""
        zc, self._zc = self._zc, None  # from here on, callbacks are ignored
        if self._relist is not None:
            self._relist.cancel()
            self._relist = None
        if zc is None:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await zc.async_unregister_all_services()
                if self._browser is not None:
                    await self._browser.async_cancel()
        except TimeoutError:
            log.warning("mdns_goodbye_timeout", timeout_s=CLOSE_TIMEOUT_S)
        finally:
            tasks = list(self._resolving.values())
            self._resolving.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await zc.async_close()
        log.info("mdns_stopped", node=self.advert.node_id)
