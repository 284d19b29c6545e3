"""``meshd install-service``: the systemd unit, /etc/meshd/meshd.toml and the secret.

The unit is rendered here, from one template; ``systemd/meshd.service`` in the
repository is this render for ``/usr/local/bin/meshd`` (a test keeps the two
equal). Existing config and secret files are never overwritten: a reinstall
keeps the mesh's secret, so the other peers still let this one in.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import cast

from meshd.config import Config

DEFAULT_EXEC = "/usr/local/bin/meshd"
UNIT_NAME = "meshd.service"

# Shutdown is three bounded waits of drain_timeout_s each (hand the span away,
# finish in-flight sessions, close HTTP): the stop timeout must outlast them.
DRAIN_WAITS = 3
STOP_MARGIN_S = 30

UNIT = """\
# meshd: one peer of a peer-to-peer inference mesh.
# Installed by `meshd install-service`; config in /etc/meshd/meshd.toml,
# the mesh secret in /etc/meshd/secret (mode 0600, handed in as a credential).
[Unit]
Description=meshd peer-to-peer LLM inference mesh
Wants=network-online.target
After=network-online.target

[Service]
# READY=1 is sent once the plan is active and the API answers; WATCHDOG=1 comes
# from the event loop itself, so a wedged loop gets the unit restarted.
Type=notify
NotifyAccess=main
ExecStart={exec} run --config /etc/meshd/meshd.toml --secret-file %d/secret
LoadCredential=secret:/etc/meshd/secret
WatchdogSec=30
Restart=on-failure
RestartSec=5
# The first start may fetch and convert the model, and waits for peers.
TimeoutStartSec=15min
# Longer than the drain: {drain_waits} waits of drain_timeout_s ({drain:g} s) plus a margin.
TimeoutStopSec={stop}
KillMode=mixed
# One descriptor per connection and peer link: the daemon keeps max_connections
# (1024) below this. MemoryMax: a runaway daemon is stopped (and restarted) before
# the box swaps itself to a halt; the model's weights and KV caches fit well below.
LimitNOFILE=65536
MemoryMax=90%

DynamicUser=yes
StateDirectory=meshd
StateDirectoryMode=0700
ConfigurationDirectory=meshd
Environment=HOME=%S/meshd
UMask=0077

# GPUs: /dev/nvidia* and /dev/dri, /dev/kfd (ROCm) stay reachable (no
# PrivateDevices), and the groups that own them are given to the service user.
SupplementaryGroups=video render
PrivateDevices=no

NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
# IPv4/IPv6 for the API, peer links and mDNS; unix for sd_notify; netlink to list interfaces.
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK

[Install]
WantedBy=multi-user.target
"""

CONFIG = """\
# meshd configuration. Every key is also a `meshd run` flag (--secret-file) and a
# MESHD_* environment variable (MESHD_SECRET_FILE); flags win over the
# environment, which wins over this file. Unknown keys are refused at start.
# `meshd config show --config /etc/meshd/meshd.toml` prints what is in force.

# name = "box-1"              # default: the host name
mesh = "home"                 # peers of other meshes are ignored
port = 8470
host = "0.0.0.0"
model = "smollm2-135m"        # a name in the state dir, or a model directory
# chat_template = "gemma"     # for a model without one: chatml, llama3, gemma, mistral, phi3, qwen, or a .jinja file
device = "auto"               # auto, cpu, cuda, mps
dtype = "auto"
# peer = ["10.0.0.2:8470"]    # static peers where multicast does not pass
# mdns_interface = ["10.0.0.1"]
# allowed_hosts = ["meshd.example.org"]  # Host names control/Batch API calls may give besides this box's own
# The unit hands /etc/meshd/secret to the daemon itself (--secret-file); copy
# that file to every peer of the mesh.
drain_timeout_s = {drain:g}     # keep TimeoutStopSec in meshd.service above {drain_waits}x this
"""


def stop_timeout_s(drain_timeout_s: float) -> int:
    return int(DRAIN_WAITS * drain_timeout_s + STOP_MARGIN_S)


def _default_drain_s() -> float:
    """Config's default drain_timeout_s (a field with a plain default, not a factory)."""
    return cast(float, Config.__dataclass_fields__["drain_timeout_s"].default)


def render_unit(exec_path: str = DEFAULT_EXEC, drain_timeout_s: float | None = None) -> str:
    drain = _default_drain_s() if drain_timeout_s is None else drain_timeout_s
    return UNIT.format(exec=exec_path, drain=drain, drain_waits=DRAIN_WAITS, stop=stop_timeout_s(drain))


def render_config(drain_timeout_s: float | None = None) -> str:
    drain = _default_drain_s() if drain_timeout_s is None else drain_timeout_s
    return CONFIG.format(drain=drain, drain_waits=DRAIN_WAITS)


def meshd_executable() -> str:
    """The meshd command of this installation (the venv's, when run from one)."""
    beside = Path(sys.executable).with_name("meshd")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("meshd") or DEFAULT_EXEC


def write_secret(path: Path) -> bool:
    """A fresh 256-bit secret, mode 0600 from its creation; False if one is there."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return True


def install(root: Path = Path("/"), exec_path: str | None = None, enable: bool = False,
            out=sys.stdout) -> dict[str, Path]:
    """Write the unit, and the config and secret where absent, under ``root``."""
    unit = root / "etc/systemd/system" / UNIT_NAME
    etc = root / "etc/meshd"
    config, secret = etc / "meshd.toml", etc / "secret"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(render_unit(exec_path or meshd_executable()))
    unit.chmod(0o644)
    print(f"wrote {unit}", file=out)
    etc.mkdir(parents=True, exist_ok=True)
    etc.chmod(0o755)
    if config.exists():
        print(f"kept {config}", file=out)
    else:
        config.write_text(render_config())
        config.chmod(0o644)
        print(f"wrote {config}", file=out)
    print(f"{'wrote' if write_secret(secret) else 'kept'} {secret} (mode 0600; copy it to every peer)", file=out)
    live = root == Path("/") and Path("/run/systemd/system").is_dir()
    if live:
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        if enable:
            subprocess.run(["systemctl", "enable", "--now", UNIT_NAME], check=True)
            print("meshd enabled and started: `journalctl -u meshd -f`, `meshctl status`", file=out)
            return {"unit": unit, "config": config, "secret": secret}
    print("next: systemctl daemon-reload && systemctl enable --now meshd; then `meshctl status`", file=out)
    return {"unit": unit, "config": config, "secret": secret}
