"""A lab of hosts built from network namespaces on one bridge.

    root ns ── <prefix> (veth, .254) ─┐
                                      │  <prefix>-br: br0 (own namespace; the root
    <prefix>-h1: eth0 (.1) ── p1 ─────┤  namespace has bridge-nf-call-iptables=1)
    <prefix>-h2: eth0 (.2) ── p2 ─────┘

Every name carries a per-run prefix `<base><pid>-<n>`, so parallel runs never
collide and `reap_stale` can delete the labs of runs that died. Each lab gets
its own /24 inside 198.18.0.0/15 (the range RFC 2544 sets aside for tests).
The host end of each veth is `eth0` so default interface filtering treats it as
a real NIC. IPv6 is off everywhere (no DAD stall, no stray multicast). The root
end carries no multicast: it is there only so pytest can speak HTTP to hosts.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from functools import cache

from tests.fixtures.shared import worker_count, worker_index

BASE = "mt"
NET = ipaddress.ip_network("198.18.0.0/15")
_SUBNETS = list(NET.subnets(new_prefix=24))
_counter = itertools.count()
_taken: set[ipaddress.IPv4Network] = set()  # subnets of this process's open labs


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def _sysctl(ns: str | None, key: str, value: str) -> None:
    argv = ["sysctl", "-qw", f"{key}={value}"]
    if ns is not None:
        argv = ["ip", "netns", "exec", ns, *argv]
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def _pid_alive(pid: int) -> bool:
    """Exists and is not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _kill_pids(pids: list[int], timeout: float = 3.0) -> None:
    """SIGTERM each pid, then SIGKILL what is left after `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.02)
        pids = [p for p in pids if _pid_alive(p)]
        if not pids:
            return


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


@cache
def netlab_available() -> bool:
    """True when we are root and can make a namespace with a veth in it."""
    if os.geteuid() != 0:
        return False
    ns = f"{BASE}{os.getpid()}-probe"
    try:
        if _ip("netns", "add", ns, check=False).returncode != 0:
            return False
        made = _ip("-n", ns, "link", "add", "name", "vprobe0", "type", "veth", "peer", "name", "vprobe1", check=False)
        return made.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        _ip("netns", "delete", ns, check=False)


def reap_stale(base: str = BASE) -> list[str]:
    """Delete labs (namespaces and root links) whose creating pid is gone."""
    pattern = re.compile(rf"^{re.escape(base)}(\d+)-")
    reaped = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = pattern.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_pids(_ns_pids(ns))  # only ever processes a lab of ours started
            _ip("netns", "delete", ns, check=False)
            reaped.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = re.match(rf"^{re.escape(base)}(\d+)-\d+$", name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "delete", name, check=False)
            reaped.append(name)
    return reaped


@dataclass
class Host:
    lab: Lab
    name: str
    ns: str
    addr: str | None  # None for a namespace with only loopback
    port: str | None  # the bridge-side veth end, in the bridge namespace
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(argv), **kw)

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start a program in the namespace; `ip netns exec` execs, so .pid is the program's."""
        proc = subprocess.Popen(self.argv(argv), **kw)
        self.procs.append(proc)
        self.lab.procs.append(proc)
        return proc

    def link_down(self) -> None:
        """Pull the cable: the bridge-side end goes down, the host sees no carrier."""
        assert self.port is not None
        _ip("-n", self.lab.bridge_ns, "link", "set", self.port, "down")

    def link_up(self) -> None:
        assert self.port is not None
        _ip("-n", self.lab.bridge_ns, "link", "set", self.port, "up")
        _ip("-n", self.ns, "route", "replace", "224.0.0.0/4", "dev", "eth0")


class Lab:
    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or f"{BASE}{os.getpid()}-{next(_counter)}"
        assert len(self.prefix) <= 15, "the root-namespace veth is named after the prefix"
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._uplink: str | None = None
        self.subnet = self._free_subnet()
        self._addrs = self.subnet.hosts()
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "name", "br0", "type", "bridge", "mcast_snooping", "0")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _free_subnet(self) -> ipaddress.IPv4Network:
        """A /24 derived from the prefix, skipping any the root namespace already routes or
        another lab of this process holds. Parallel test workers draw from disjoint shares of
        the range (worker k of n: every n-th /24 from k), so two labs made at the same moment
        in two workers never pick the same one before either has routed it."""
        routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
        k, n = worker_index(), worker_count()
        share = _SUBNETS[k::n]
        start = sum(map(ord, self.prefix)) * 7 + os.getpid()
        for i in range(len(share)):
            net = share[(start + i) % len(share)]
            if net not in _taken and str(net.network_address).rsplit(".", 1)[0] + "." not in routes:
                _taken.add(net)
                return net
        raise RuntimeError("no free /24 left in 198.18.0.0/15")

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _sysctl(ns, "net.ipv6.conf.all.disable_ipv6", "1")
        _sysctl(ns, "net.ipv6.conf.default.disable_ipv6", "1")
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_host(self, name: str | None = None, link: bool = True) -> Host:
        """A namespace on the bridge (eth0 + lo), or with `link=False` just lo."""
        name = name or f"h{len(self.hosts) + 1}"
        ns = f"{self.prefix}-{name}"
        self._add_ns(ns)
        addr = port = None
        if link:
            addr = str(next(self._addrs))
            port = f"p{len(self.hosts) + 1}"
            _ip("-n", self.bridge_ns, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        host = Host(self, name, ns, addr, port)
        self.hosts[name] = host
        return host

    def uplink(self) -> str:
        """Give this (root-namespace) process a route to the hosts; returns our address (.254)."""
        if self._uplink is None:
            dev = self.prefix
            _ip("link", "add", "name", dev, "type", "veth", "peer", "name", "up0", "netns", self.bridge_ns)
            self._uplink = dev
            _sysctl(None, f"net.ipv6.conf.{dev}.disable_ipv6", "1")
            _ip("link", "set", dev, "multicast", "off")
            _ip("addr", "add", f"{self.subnet[254]}/{self.subnet.prefixlen}", "dev", dev)
            _ip("-n", self.bridge_ns, "link", "set", "up0", "master", "br0", "up")
            _ip("link", "set", dev, "up")
        return str(self.subnet[254])

    def close(self) -> None:
        """Kill what the lab started (by pid), then delete its namespaces and links."""
        _kill_pids([p.pid for p in self.procs if p.poll() is None])
        for p in self.procs:
            try:
                p.wait(timeout=1)  # reap; _kill_pids already SIGKILLed any holdout
            except subprocess.TimeoutExpired:
                pass
        for ns in self._namespaces:
            _kill_pids(_ns_pids(ns))  # e.g. children of what we started
        for ns in reversed(self._namespaces):
            _ip("netns", "delete", ns, check=False)
        self._namespaces.clear()
        if self._uplink is not None:
            _ip("link", "delete", self._uplink, check=False)  # gone with its peer already
            self._uplink = None
        _taken.discard(self.subnet)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
