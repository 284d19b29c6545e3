"""One frozen configuration, built once: TOML file < MESHD_* environment < flags.

Every key is named the same way in all three places: a flag ``--secret-file`` is
the TOML key ``secret_file`` and the variable ``MESHD_SECRET_FILE``. List values
(``peer``, ``mdns_interface``) are TOML arrays, comma-separated in the environment,
and repeated flags.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import tomllib
from types import UnionType
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from meshd.errors import ConfigError

DEFAULT_PORT = 8470
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def default_state_dir() -> Path:
    """$STATE_DIRECTORY under systemd, else the XDG state dir."""
    if systemd := os.environ.get("STATE_DIRECTORY"):
        return Path(systemd.split(":")[0])
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "meshd"


SPECULATE = ("auto", "always", "off")

@dataclass(frozen=True, slots=True)
class Config:
    name: str = field(default_factory=socket.gethostname)
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    mesh: str = "home"
    secret_file: Path | None = None
    model: str = "smollm2-135m"
    # Chats render with this template (a built-in name: chatml, llama3, gemma, mistral, phi3,
    # qwen; or a Jinja file) over the model's own; None: the model's (shards/chat.py). Only
    # the supernode renders: a member's setting applies once it becomes the supernode.
    chat_template: str | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    device: str = "auto"
    # torch threads; None: torch's default (all cores). Several daemons on one box
    # want 1 each: OpenMP threads waiting on a descheduled sibling cost up to 10x.
    threads: int | None = None
    dtype: str = "auto"
    mdns: bool = True
    mdns_interface: tuple[str, ...] = ()
    peer: tuple[str, ...] = ()
    advertise_vram: int | None = None
    # Bytes of memory this peer offers for layers; None: free VRAM, else 70% of RAM.
    mem_budget: int | None = None
    heartbeat_s: float = 1.0
    missed_beats: int = 3
    # How long a supernode waits after the view changes before it plans, so
    # peers that start together produce one plan, not one each.
    settle_s: float = 1.0
    # A peer that joins (or comes back) waits for the next plan until the streams
    # in flight end, at most this long: a join never pauses them otherwise.
    join_defer_s: float = 30.0
    accept_timeout_s: float = 300.0
    drain_timeout_s: float = 20.0
    # How long a request waits for a (new) supernode's plan before a 503.
    failover_wait_s: float = 30.0
    # Fetch the rest of the model in the background once a span is loaded, so
    # that any survivor can take over as supernode or take a lost span.
    replicate: bool = True
    max_frame_bytes: int = 64 * 1024 * 1024
    max_body_bytes: int = 1024 * 1024
    max_tokens_limit: int = 4096
    # HTTP connections held at once (past it, the oldest idle one is closed for a new
    # one), and how long one may sit idle or take to send its headers (or body).
    max_connections: int = 1024
    http_idle_s: float = 30.0
    # KV cache positions (summed over sessions, prompt + max_tokens each in the whole
    # 256-position chunks the stages' caches take) the supernode admits before
    # answering 503; None: a quarter of the memory budget (of the plan's tightest stage).
    # Never more than the plan's stages hold in half their memory (store.STAGE_KV_SHARE).
    kv_budget_tokens: int | None = None
    # Batch jobs (OpenAI's Batch API): lines this peer keeps in flight at once (enough
    # to fill a step's batch; the scheduler keeps interactive requests ahead of them),
    # and the size bound of the batch store (SQLite in the state dir: files, results).
    batch_concurrency: int = 32
    batch_max_bytes: int = 1 << 30
    # A peer holding a replica of another peer's running batch job takes it over (runs
    # its remaining lines, answers for it) once that peer has been gone this long.
    batch_takeover_s: float = 120.0
    # Finished sessions whose KV stays on the stages for a new request that starts
    # with the same tokens (a chat's next turn); inside the KV budget; 0: none.
    prefix_cache_entries: int = 32
    # Speculative decoding: the supernode drafts tokens from a session's own tokens (prompt
    # lookup) and checks them in the step it runs anyway; the tokens are the same either way.
    # "auto": drafts as long as pay on this peer's measured step costs; "always": every
    # match drafted in full (rows nearly free: a GPU; or to compare); "off".
    speculate: str = "auto"
    # A small model with the served model's tokenizer (a name in the state dir's models, or
    # a directory) that drafts where prompt lookup has no guess, loaded whole by the peer
    # that is supernode; the tokens are the same with or without it.
    draft_model: str | None = None
    log_level: str = "info"
    # Browser origins allowed to call the API (CORS), "*" for any; none by default.
    # /v1/mesh/* (control) answers only cors_mesh_origins, none by default.
    cors_origins: tuple[str, ...] = ()
    cors_mesh_origins: tuple[str, ...] = ()
    # Names (besides loopback, this machine's hostname and its addresses) that a control
    # or Batch API call's Host header may give: a DNS alias or a reverse proxy's name;
    # ".example.org" for a domain and its subdomains, "*" for any (no DNS-rebinding check).
    allowed_hosts: tuple[str, ...] = ()
    # HTTP API keys (one per line): when set, completions and models need
    # "Authorization: Bearer KEY"; control endpoints (drain) need a control key,
    # or an API key when no control key file is set.
    api_key_file: Path | None = None
    control_key_file: Path | None = None
    # HTTPS for the API (clients, and peers fetching shard files); peer links then ride
    # wss on the same port. Peers are authenticated and their frames sealed by the Noise
    # handshake either way (meshd/control/secure.py); tls_ca, when set, also verifies
    # peers' certificates (chain only: peers are found by address, not name).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    # Testing and benchmarks only: extra milliseconds per layer on every forward,
    # to simulate a slow box (or to make a generation last long enough to fault).
    debug_layer_delay_ms: float = 0.0
    # Benchmarks only, where the kernel has no netem: one-way delay (± jitter)
    # added to every frame this peer sends.
    debug_link_delay_ms: float = 0.0
    debug_link_jitter_ms: float = 0.0
    # Debugging only (every peer alike): frames between peers travel in clear after the
    # (still authenticated) handshake, so a packet capture can read them.
    debug_plaintext_links: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not self.mesh or len(self.mesh) > 63:
            raise ConfigError("mesh: must be 1-63 characters")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("chat_template: a built-in name or a file, not empty")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads: must be at least 1")
        if self.max_connections < 8:
            raise ConfigError("max_connections: must be at least 8")
        if self.http_idle_s <= 0:
            raise ConfigError("http_idle_s: must be > 0")
        if self.speculate not in SPECULATE:
            raise ConfigError(f"speculate: one of {', '.join(SPECULATE)}")
        if self.draft_model is not None and not self.draft_model.strip():
            raise ConfigError("draft_model: a model name or a directory, not empty")
        if not 1 <= self.batch_concurrency <= 1024:
            raise ConfigError("batch_concurrency: must be from 1 to 1024")
        if self.batch_max_bytes < 1 << 20:
            raise ConfigError("batch_max_bytes: must be at least 1 MiB")
        if not 1.0 <= self.batch_takeover_s <= 30 * 86400:
            raise ConfigError("batch_takeover_s: must be from 1 second to 30 days")
        if not 0 <= self.prefix_cache_entries <= 4096:
            raise ConfigError("prefix_cache_entries: must be 0 (off) to 4096")
        if self.heartbeat_s <= 0 or self.missed_beats < 1:
            raise ConfigError("heartbeat_s must be > 0 and missed_beats >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together")
        for addr in self.peer:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not (port.isascii() and port.isdigit()):
                raise ConfigError(f"peer: {addr!r} is not HOST:PORT")

    @property
    def secret_path(self) -> Path:
        return self.secret_file or self.state_dir / "secret"

    def load_secret(self) -> bytes:
        """The mesh secret; a missing default secret is generated (mode 0600) for a one-box mesh."""
        path = self.secret_path
        if not path.exists():
            if self.secret_file is not None:
                raise ConfigError(f"secret_file: {path} does not exist")
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        secret = path.read_bytes().strip()
        if len(secret) < 16:
            raise ConfigError(f"secret_file: {path} holds fewer than 16 bytes")
        return secret

    def load_keys(self, path: Path | None) -> frozenset[str]:
        if path is None:
            return frozenset()
        try:
            keys = frozenset(line.strip() for line in path.read_text().splitlines() if line.strip())
        except OSError as exc:
            raise ConfigError(f"key file {path}: {exc}") from None
        if not keys:
            raise ConfigError(f"key file {path} holds no key")
        return keys

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as plain values (no secret is ever held here)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        return out


def _coerce(name: str, annotation: Any, value: Any, source: str) -> Any:
    """Turn a TOML/env/flag value into the field's type, naming the key on failure."""
    types = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    if value is None and type(None) in types:
        return None
    kinds = [t for t in types if t is not type(None)]
    kind = kinds[0]
    try:
        if get_origin(kind) is tuple:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise TypeError("expected a list of strings")
            return tuple(value)
        if kind is bool:
            if isinstance(value, str):
                low = value.lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if not isinstance(value, bool):
                raise TypeError("expected true or false")
            return value
        if kind is int:
            if isinstance(value, bool) or isinstance(value, float):
                raise TypeError("expected an integer")
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise TypeError("expected a number")
            return float(value)
        if kind is Path:
            if not isinstance(value, (str, Path)):
                raise TypeError("expected a path")
            return Path(value).expanduser()
        if not isinstance(value, str):
            raise TypeError("expected a string")
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} (from {source}): bad value {value!r}: {exc}") from None


def build_config(
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """Merge the three sources in precedence order; unknown keys and bad values are errors."""
    known = get_type_hints(Config)
    values: dict[str, Any] = {}

    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file}: {exc}") from None
        table = data.get("meshd", data) if isinstance(data.get("meshd"), dict) else data
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"unknown key {key!r} in {file}")
            values[name] = _coerce(name, known[name], value, str(file))

    env = os.environ if environ is None else environ
    for key, value in env.items():
        if not key.startswith("MESHD_") or key in _NOT_CONFIG_ENV:
            continue
        name = key[len("MESHD_"):].lower()
        if name not in known:
            raise ConfigError(f"unknown environment variable {key}")
        values[name] = _coerce(name, known[name], value, key)

    for name, value in (flags or {}).items():
        if value is None or value == ():
            continue
        if name not in known:
            raise ConfigError(f"unknown option --{name.replace('_', '-')}")
        values[name] = _coerce(name, known[name], value, "--" + name.replace("_", "-"))

    return Config(**values)


# Variables with the MESHD_ prefix that are not configuration keys.
# Read elsewhere: the config file's path, the test suite's model, and where shards/qblocks.py
# keeps its built kernel (shards/ imports nothing of meshd/, so it reads its own variable).
_NOT_CONFIG_ENV = frozenset({"MESHD_CONFIG", "MESHD_TEST_MODEL_DIR", "MESHD_KERNEL_CACHE"})


def replace(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, **changes)
