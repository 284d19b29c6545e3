"""The namespace lab itself: reachability, partitions, cleanup, reaping."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.netlab import Lab, _ip, reap_stale

pytestmark = pytest.mark.netns

SERVE = "import socket,sys; s=socket.create_server((sys.argv[1], 8000)); [s.accept()[0].close() for _ in range(50)]"


def reachable(addr: str, timeout: float = 0.5) -> bool:
    try:
        socket.create_connection((addr, 8000), timeout=timeout).close()
        return True
    except OSError:
        return False


def wait_reachable(addr: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if reachable(addr):
            return True
        time.sleep(0.05)
    return False


def test_hosts_reach_each_other_and_the_test_process(lab):
    a, b = lab.add_host(), lab.add_host()
    assert lab.uplink().endswith(".254")
    b.popen([sys.executable, "-c", SERVE, b.addr])
    assert wait_reachable(b.addr)
    probe = f"import socket; socket.create_connection(('{b.addr}', 8000), timeout=1).close()"
    assert a.run([sys.executable, "-c", probe]).returncode == 0
    routes = a.run(["ip", "route"], capture_output=True, text=True).stdout
    assert "224.0.0.0/4 dev eth0" in routes
    ifaces = a.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert " eth0@" in ifaces and "lo:" in ifaces
    v6 = a.run(["sysctl", "-n", "net.ipv6.conf.eth0.disable_ipv6"], capture_output=True, text=True).stdout
    assert v6.strip() == "1"


def test_link_down_partitions_and_link_up_heals(lab):
    b = lab.add_host()
    lab.uplink()
    b.popen([sys.executable, "-c", SERVE, b.addr])
    assert wait_reachable(b.addr)
    b.link_down()
    assert not reachable(b.addr)
    b.link_up()
    assert wait_reachable(b.addr)
    assert "224.0.0.0/4 dev eth0" in b.run(["ip", "route"], capture_output=True, text=True).stdout


def test_close_kills_processes_and_deletes_everything(netlab_session):
    lab = Lab()
    h = lab.add_host()
    lab.uplink()
    proc = h.popen(["sleep", "60"])
    lab.close()
    assert proc.poll() is not None
    names = _ip("netns", "list").stdout
    assert lab.prefix not in names
    assert lab.prefix not in _ip("-o", "link").stdout


def test_reap_stale_deletes_labs_of_dead_runs(netlab_session):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free (and not reused this quickly)
    ns = f"mt{dead.pid}-0-h1"
    _ip("netns", "add", ns)
    try:
        assert ns in reap_stale()
        assert ns not in _ip("netns", "list").stdout
    finally:
        _ip("netns", "delete", ns, check=False)
