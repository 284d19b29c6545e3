"""Shard transfer between peers: a peer that lacks the files of its span fetches
exactly those over HTTP from a peer that has them, checked by sha256.

Requests carry an HMAC over (node id, time, path) with the mesh secret, so only
members of the mesh can read its weights.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from pathlib import Path

import aiohttp
import structlog
from aiohttp import web

from meshd.errors import ModelError, ShardCorrupt, ShardMissing
from shards.manifest import MANIFEST_FILE, Manifest, check_file_name

log = structlog.get_logger()

FILES_TAG = b"meshd-files-v1"
AUTH_HEADER = "X-Meshd-Auth"
MAX_SKEW_S = 300
_CHUNK = 1 << 20
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists files; a real one is a few KiB


def files_token(secret: bytes, node_id: str, path: str, now: float | None = None) -> str:
    ts = str(int(now if now is not None else time.time()))
    mac = hmac.new(secret, b"|".join([FILES_TAG, node_id.encode(), ts.encode(), path.encode()]), hashlib.sha256)
    return f"{node_id}:{ts}:{mac.hexdigest()}"


def check_files_token(secret: bytes, token: str, path: str) -> str:
    """The requesting node id, or web.HTTPForbidden."""
    try:
        node_id, ts, _mac = token.split(":")
        fresh = abs(time.time() - int(ts)) <= MAX_SKEW_S
    except ValueError:
        raise web.HTTPForbidden(reason="malformed mesh token") from None
    expected = files_token(secret, node_id, path, now=int(ts))
    if not fresh or not hmac.compare_digest(expected, token):
        raise web.HTTPForbidden(reason="bad or stale mesh token")
    return node_id


def files_path(model: str, name: str) -> str:
    return f"/mesh/files/{model}/{name}"


async def fetch_manifest(session: aiohttp.ClientSession, base: str, secret: bytes, me: str, model: str) -> Manifest:
    path = files_path(model, MANIFEST_FILE)
    async with session.get(base + path, headers={AUTH_HEADER: files_token(secret, me, path)}) as resp:
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
        async with session.get(base + path, headers={AUTH_HEADER: files_token(secret, me, path)}) as resp:
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
