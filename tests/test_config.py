"""Configuration: one TOML file < MESHD_* environment < flags; unknown keys and bad
values refused with the key named, by ``build_config`` and by the real commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.config import build_config
from meshd.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def meshd(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
    return subprocess.run([sys.executable, "-m", "meshd.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=base | (env or {}))


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "meshd.toml"
    path.write_text(text)
    return path


def test_file_then_environment_then_flags(tmp_path):
    f = toml(tmp_path, 'port = 9000\nmesh = "file"\nname = "from-file"\npeer = ["10.0.0.1:1"]\n')
    assert build_config(f, environ={}).port == 9000
    c = build_config(f, environ={"MESHD_PORT": "9100", "MESHD_MESH": "env", "MESHD_PEER": "a:1, b:2"})
    assert (c.port, c.mesh, c.name, c.peer) == (9100, "env", "from-file", ("a:1", "b:2"))
    c = build_config(f, environ={"MESHD_PORT": "9100"}, flags={"port": 9200, "name": None})
    assert (c.port, c.name) == (9200, "from-file")  # a flag not given does not override


def test_meshd_table_and_dashes_are_accepted(tmp_path):
    c = build_config(toml(tmp_path, '[meshd]\nsecret-file = "/etc/meshd/secret"\nmdns = false\n'), environ={})
    assert str(c.secret_file) == "/etc/meshd/secret" and c.mdns is False


@pytest.mark.parametrize("text, named", [
    ("prot = 8470\n", "'prot'"),
    ("[meshd]\nport = 1\nbogus_key = 2\n", "'bogus_key'"),
])
def test_unknown_file_keys_are_named(tmp_path, text, named):
    with pytest.raises(ConfigError, match=named):
        build_config(toml(tmp_path, text), environ={})


def test_unknown_environment_variable_is_named():
    with pytest.raises(ConfigError, match="MESHD_PROT"):
        build_config(environ={"MESHD_PROT": "1"})


def test_the_kernel_cache_variable_does_not_stop_the_daemon():
    """shards/qblocks.py documents $MESHD_KERNEL_CACHE; a daemon started with it set refused
    to start ("unknown environment variable")."""
    assert build_config(environ={"MESHD_KERNEL_CACHE": "/var/cache/meshd"}).port == build_config(environ={}).port


@pytest.mark.parametrize("source, named", [
    ({"file": "port = 70000\n"}, "port"),
    ({"file": 'port = "eighty"\n'}, "port"),
    ({"file": 'device = "tpu"\n'}, "device"),
    ({"file": "mdns = 3\n"}, "mdns"),
    ({"file": 'peer = "10.0.0.1"\n'}, "peer"),
    ({"env": {"MESHD_HEARTBEAT_S": "soon"}}, "heartbeat_s"),
    ({"env": {"MESHD_MDNS": "maybe"}}, "mdns"),
    ({"env": {"MESHD_DRAIN_TIMEOUT_S": "x"}}, "drain_timeout_s"),
    ({"flags": {"dtype": "int4"}}, "dtype"),
    ({"env": {"MESHD_SPECULATE": "sometimes"}}, "speculate"),
])
def test_bad_values_are_named(tmp_path, source, named):
    file = toml(tmp_path, source["file"]) if "file" in source else None
    with pytest.raises(ConfigError, match=named):
        build_config(file, environ=source.get("env", {}), flags=source.get("flags"))


def test_broken_toml_names_the_file(tmp_path):
    f = toml(tmp_path, "port = \n")
    with pytest.raises(ConfigError, match=str(f)):
        build_config(f, environ={})


# -- the real commands -----------------------------------------------------------------


def test_meshd_run_refuses_an_unknown_key_at_start(tmp_path):
    out = meshd("run", "--config", str(toml(tmp_path, "port = 8470\nmodle = 'x'\n")),
                "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 2, out.stderr
    assert "configuration error" in out.stderr and "'modle'" in out.stderr
    assert not (tmp_path / "state").exists()  # refused before it touched anything


def test_meshd_run_refuses_a_bad_environment_value(tmp_path):
    out = meshd("run", "--state-dir", str(tmp_path / "state"), env={"MESHD_PORT": "http"})
    assert out.returncode == 2 and "MESHD_PORT" in out.stderr and "port" in out.stderr, out.stderr


def test_config_show_prints_the_effective_config_with_the_secret_redacted(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-" + "x" * 40 + "\n")
    f = toml(tmp_path, f'mesh = "lab"\nport = 9001\nsecret_file = "{secret}"\n')
    out = meshd("config", "show", "--config", str(f), env={"MESHD_PORT": "9002", "MESHD_NAME": "box-7"})
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert (shown["mesh"], shown["port"], shown["name"]) == ("lab", 9002, "box-7")
    assert "s3cr3t" not in out.stdout
    assert shown["secret"] == f"<set, in {secret}>"
    assert shown["drain_timeout_s"] == 20.0 and shown["log_level"] == "info"


def test_config_show_refuses_what_run_refuses(tmp_path):
    out = meshd("config", "show", "--config", str(toml(tmp_path, "colour = 'blue'\n")))
    assert out.returncode == 2 and "'colour'" in out.stderr


def test_the_example_config_is_valid():
    c = build_config(REPO / "systemd/meshd.toml.example", environ={})
    assert c.port == 8470 and c.mesh == "home"
