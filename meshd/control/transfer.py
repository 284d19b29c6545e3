"""Shard transfer between peers: a peer that lacks the files of its span fetches
exactly those over HTTP from a peer that has them, checked by sha256 against the
manifest (whose digest comes over the sealed link in the Plan).

Each request carries ``X-Meshd-Auth: NODE:TIME:NONCE:MAC``, an HMAC-SHA256 under a
key derived from the mesh secret over (method, path, body hash, node, time, nonce):
only members read the mesh's weights, a token is good for one request within
``MAX_AGE_S`` of its time (never ahead of the clock by more than ``MAX_AHEAD_S``),
and its nonce is remembered until then, so a captured token cannot be replayed.
Bulk weights stay on HTTP rather than the link so a transfer never holds up a
decode frame; they are public model weights, integrity is the manifest's sha256.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections import OrderedDict
from pathlib import Path

import aiohttp
import structlog
from aiohttp import web

from meshd.control.secure import files_key
from meshd.errors import ModelError, ShardCorrupt, ShardMissing
from shards.manifest import MANIFEST_FILE, Manifest, check_file_name

log = structlog.get_logger()

FILES_TAG = b"meshd-files-v2"
AUTH_HEADER = "X-Meshd-Auth"
MAX_AGE_S = 60  # a token's life, and how long its nonce is remembered
MAX_AHEAD_S = 10  # clock skew between peers that is tolerated
MAX_REMEMBERED = 65536  # nonces held at once (only valid tokens are remembered)
_TOKEN = re.compile(r"([A-Za-z0-9_.-]{1,64}):([0-9]{1,12}):([0-9a-f]{32}):([0-9a-f]{64})")
_CHUNK = 1 << 20
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists files; a real one is a few KiB


def _mac(key: bytes, method: str, path: str, body: bytes, node_id: str, ts: str, nonce: str) -> str:
    parts = [FILES_TAG, method.encode(), path.encode(), hashlib.sha256(body).hexdigest().encode(),
             node_id.encode(), ts.encode(), nonce.encode()]
    return hmac.new(key, b"\n".join(parts), hashlib.sha256).hexdigest()


def files_token(secret: bytes, node_id: str, path: str, method: str = "GET", body: bytes = b"",
                now: float | None = None) -> str:
    ts = str(int(now if now is not None else time.time()))
    nonce = os.urandom(16).hex()
    return f"{node_id}:{ts}:{nonce}:{_mac(files_key(secret), method, path, body, node_id, ts, nonce)}"


class TokenCheck:
    """The receiving side: one per node, it remembers the nonces it has taken."""

    def __init__(self, secret: bytes):
        self._key = files_key(secret)
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it expires, oldest first

    def check(self, token: str | None, method: str, path: str, body: bytes = b"") -> str:
        """The requesting node id, else ``web.HTTPUnauthorized`` (never anything else:
        a header that is not ASCII, not the shape, stale, forged or replayed alike)."""
        now = time.time()
        m = _TOKEN.fullmatch(token) if token and token.isascii() else None
        if m is None:
            raise web.HTTPUnauthorized(reason="missing or malformed mesh token")
        node_id, ts, nonce, mac = m.groups()
        if not -MAX_AHEAD_S <= now - int(ts) <= MAX_AGE_S:
            raise web.HTTPUnauthorized(reason="stale mesh token (are the peers' clocks set?)")
        if not hmac.compare_digest(mac, _mac(self._key, method, path, body, node_id, ts, nonce)):
            raise web.HTTPUnauthorized(reason="bad mesh token")
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise web.HTTPUnauthorized(reason="mesh token replayed")
        if len(self._seen) >= MAX_REMEMBERED:
            raise web.HTTPServiceUnavailable(reason="too many mesh requests at once")
        self._seen[nonce] = now + MAX_AGE_S + MAX_AHEAD_S
        return node_id


# A source that stalls (or trickles) must not hold a plan's load, or replication, forever:
# no byte for STALL_S fails the fetch, and so does a file slower than MIN_RATE bytes/s.
STALL_S = 60.0
MIN_RATE = 100_000


def _deadline(size: int) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=STALL_S + size / MIN_RATE, connect=10, sock_read=STALL_S)


def files_path(model: str, name: str) -> str:
    return f"/mesh/files/{model}/{name}"


async def fetch_manifest(session: aiohttp.ClientSession, base: str, secret: bytes, me: str, model: str) -> Manifest:
    path = files_path(model, MANIFEST_FILE)
    async with session.get(base + path, headers={AUTH_HEADER: files_token(secret, me, path)},
                           timeout=_deadline(MAX_MANIFEST_BYTES)) as resp:
        if resp.status != 200:
            raise ShardMissing(f"{base} has no manifest for {model}: HTTP {resp.status}")
        raw = await resp.content.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ModelError(f"{base} sent a manifest over {MAX_MANIFEST_BYTES} bytes")
        return Manifest.from_bytes(raw)


async def fetch_files(
    session: aiohttp.ClientSession, base: str, secret: bytes, me: str, manifest: Manifest,
    names: list[str], dest: Path,
) -> int:
    """Download ``names`` into ``dest`` (each to a temp file, sha256 checked, then
    renamed into place); returns bytes fetched. Progress is logged per file."""
    dest.mkdir(parents=True, exist_ok=True)
    total = sum(manifest.files[n].size for n in names)
    done = 0
    for name in names:
        check_file_name(name)
        entry = manifest.files[name]
        path = files_path(manifest.name, name)
        tmp = dest / f".{name}.part"
        digest = hashlib.sha256()
        t0 = time.monotonic()
        async with session.get(base + path, headers={AUTH_HEADER: files_token(secret, me, path)},
                               timeout=_deadline(entry.size)) as resp:
            if resp.status != 200:
                raise ShardMissing(f"{base} could not send {name}: HTTP {resp.status}")
            with open(tmp, "wb") as f:
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    digest.update(chunk)
                    f.write(chunk)
                    if f.tell() > entry.size:
                        break
                size = f.tell()
        if size != entry.size or digest.hexdigest() != entry.sha256:
            tmp.unlink(missing_ok=True)
            raise ShardCorrupt(f"{name} from {base} does not match the manifest (size {size}, want {entry.size})")
        os.replace(tmp, dest / name)
        done += size
        log.info("shard_fetched", file=name, bytes=size, seconds=round(time.monotonic() - t0, 3),
                 progress=f"{done}/{total}", source=base)
    return done


def missing_files(model_dir: Path, manifest: Manifest, names: list[str]) -> list[str]:
    """The files of ``names`` that are absent or of the wrong size (hashes are checked at load)."""
    out = []
    for name in names:
        p = model_dir / name
        if not p.is_file() or p.stat().st_size != manifest.files[name].size:
            out.append(name)
    return out


def serve_file(model_dir: Path | None, manifest: Manifest | None, model: str, name: str) -> web.FileResponse:
    if model_dir is None or manifest is None or manifest.name != model:
        raise web.HTTPNotFound(reason=f"model {model} is not here")
    try:
        check_file_name(name)
    except ModelError:
        raise web.HTTPBadRequest(reason="bad file name") from None
    if name != MANIFEST_FILE and name not in manifest.files:
        raise web.HTTPNotFound(reason=f"{name} is not in the manifest")
    path = model_dir / name
    # Only the regular files of the model directory go out: a symlink there (placed by
    # a user or anything else) could point at any file this process may read.
    if path.is_symlink():
        raise web.HTTPForbidden(reason=f"{name} is a symlink; only regular files are served")
    if not path.is_file():
        raise web.HTTPNotFound(reason=f"{name} is not on this peer")
    return web.FileResponse(path)
