"""This peer's model store: the model's directory and manifest, the engine loaded
for this peer's part of the plan, and the shard files fetched from peers, for a
span when a plan needs them, or all of them in the background (replication), so
that any survivor can later lead or take a lost span."""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeGuard, cast

import aiohttp
import structlog
from aiohttp import web

from meshd.config import Config
from meshd.control.mesh import MeshView
from meshd.control.peers import peer_url
from meshd.control.transfer import fetch_files, fetch_manifest, missing_files, serve_file
from meshd.errors import KNOWN_ERRORS, ModelError, ShardMissing
from protocol.messages import NodeId
from shards.engine import StageEngine
from shards.layers import KVCache
from shards.manifest import MANIFEST_FILE, Manifest, check_model_name
from shards.span import Span

log = structlog.get_logger()

BY_DIGEST = ".by-digest"  # models/.by-digest/<sha256>: a model fetched under a name this peer holds another of
EngineKey = tuple[str, Span | None, bool, bool]  # (manifest digest, span, embed, head)


# Of a peer's memory budget, what its stage's KV caches may hold, whatever the supernode
# admits: twice the share the supernode's default budget plans with (served.KV_SHARE), so
# that a cache dropped a moment late never trips it; what it stops is a supernode that
# admits past what this peer can hold.
STAGE_KV_SHARE = 0.5


def stage_kv_limit(engine: StageEngine, mem_budget: int) -> int | None:
    """The most KV positions ``engine``'s caches may hold on a peer of ``mem_budget`` bytes:
    STAGE_KV_SHARE of it, and never less than one session of the whole context (as the
    supernode's budget is never less than one). None for a span without layers."""
    per_position = engine.kv_bytes_per_position()
    if per_position == 0:
        return None
    context = KVCache.room_for(engine.config.max_position)
    return max(context, int(mem_budget * STAGE_KV_SHARE) // per_position // KVCache.CHUNK * KVCache.CHUNK)


def model_path(config: Config, model: str) -> Path:
    """Where model ``model`` is: a directory as given, or a name in the state dir's models."""
    path = Path(model).expanduser()
    if not (path.is_absolute() or model.startswith(".") or "/" in model):
        path = config.state_dir / "models" / model
    return path


def local_model(config: Config) -> tuple[Path | None, Manifest | None]:
    """The configured model: a directory, or a name in the state dir; its manifest if complete."""
    model = config.model
    path = model_path(config, model)
    if (path / MANIFEST_FILE).is_file():
        return path, Manifest.load(path)
    return path if path.is_absolute() or "/" in model else None, None


class ModelStore:
    def __init__(self, config: Config, view: MeshView, secret: bytes, http: Callable[[], aiohttp.ClientSession],
                 model: tuple[Path | None, Manifest | None] | None = None, threads: int | None = None):
        self.config = config
        # An engine's torch threads: the daemon's (Node.threads); None, the loading thread's default.
        self.threads = threads
        self.view = view
        self._secret = secret
        self._http = http  # the node's client session, which exists once the node runs
        self.model_dir, self.manifest = model if model is not None else local_model(config)
        self.engine: StageEngine | None = None  # the engine of the active plan's part
        self._keys: weakref.WeakKeyDictionary[StageEngine, EngineKey] = weakref.WeakKeyDictionary()
        self.replicating = False

    @property
    def model_name(self) -> str:
        if self.manifest is not None:
            return self.manifest.name
        return Path(self.config.model).name

    def _adopt(self, model_dir: Path, manifest: Manifest) -> None:
        self.model_dir, self.manifest = model_dir, manifest

    # -- the model and the engine ------------------------------------------------------

    async def prepare(self, name: str, sources: Iterable[NodeId], digest: str | None = None) -> tuple[Manifest, Path]:
        """The manifest and directory of model ``name`` (with ``digest`` if given):
        this peer's own copy, else one fetched earlier, else the manifest fetched
        from a source peer (the shard files follow per span in ``load``, and the model
        becomes this peer's once ``load`` succeeds).

        ``name`` is a plain name (checked again here: it becomes a directory). Models
        are kept by content: a manifest whose digest differs from the one already in
        ``models/<name>`` goes to ``models/.by-digest/<digest>``, so a plan naming
        another digest never overwrites this peer's own manifest or shards."""
        check_model_name(name)

        def fits(m: Manifest | None) -> TypeGuard[Manifest]:
            return m is not None and m.name == name and (digest is None or m.digest == digest)

        if fits(self.manifest):  # its own: a manifest comes with its directory (local_model, _adopt)
            return self.manifest, cast(Path, self.model_dir)
        for store in self._dirs(name, digest):
            if (store / MANIFEST_FILE).is_file():
                try:
                    m = Manifest.load(store)
                except ModelError as exc:
                    log.warning("stored_manifest_unreadable", dir=str(store), error=str(exc))
                    continue
                if fits(m):
                    return m, store
        errors = []
        for pid, base in self._urls(sources):
            try:
                m = await fetch_manifest(self._http(), base, self._secret, self.view.node_id, name)
            except (*KNOWN_ERRORS, OSError, aiohttp.ClientError) as exc:
                log.warning("manifest_fetch_failed", source=pid, error=str(exc))
                errors.append(f"{pid}: {exc}")
                continue
            if not fits(m):
                errors.append(f"{pid}: its manifest is {m.name} {m.digest[:12]}")
                continue
            store = self._new_dir(name, m.digest)
            store.mkdir(parents=True, exist_ok=True)
            tmp = store / f".{MANIFEST_FILE}.part"
            tmp.write_bytes(m.to_bytes())
            os.replace(tmp, store / MANIFEST_FILE)
            log.info("manifest_fetched", model=name, source=pid, dir=str(store))
            return m, store
        raise ShardMissing(f"model {name!r} is not here and no peer offered it (run `meshd model fetch {name}`)"
                           + (": " + "; ".join(errors) if errors else ""))

    def _dirs(self, name: str, digest: str | None) -> list[Path]:
        """Where model ``name`` (of ``digest``) may already be: its named directory, then its digest's."""
        models = self.config.state_dir / "models"
        return [models / name] + ([models / BY_DIGEST / digest] if digest else [])

    def _new_dir(self, name: str, digest: str) -> Path:
        """Where a fetched manifest goes: the named directory while nothing is there,
        else its digest's own (the named one is kept as it is)."""
        named = self.config.state_dir / "models" / name
        if not (named / MANIFEST_FILE).exists():
            return named
        return self.config.state_dir / "models" / BY_DIGEST / digest

    async def load(self, manifest: Manifest, model_dir: Path, span: Span | None, *, embed: bool, head: bool,
                   sources: Iterable[NodeId] = ()) -> StageEngine:
        """An engine for these parts: the one in use if it already is, else loaded
        (after fetching exactly the missing shard files) on a worker thread."""
        key = (manifest.digest, span, embed, head)
        if self.engine is not None and self._keys.get(self.engine) == key:
            return self.engine
        names = manifest.files_for(span, embed or head)
        if missing := missing_files(model_dir, manifest, names):
            await self._fetch(manifest, model_dir, missing, sources)
        engine = await asyncio.to_thread(
            StageEngine.load, model_dir, span, embed, head, self.config.device, self.config.dtype,
            threads=self.threads,
        )
        self._keys[engine] = key
        engine.kv_limit = stage_kv_limit(engine, self.view.caps.mem_budget)
        # Only a model whose files checked out and loaded becomes this peer's model: one a
        # plan named that does not load leaves the one this peer had in place.
        self._adopt(model_dir, manifest)
        return engine

    def use(self, engine: StageEngine | None) -> None:
        """Make ``engine`` the one in use (an active plan's part); the one it replaces is closed."""
        if engine is not self.engine:
            old, self.engine = self.engine, engine
            if old is not None:
                old.close()
        elif engine is not None:
            # Kept for a new plan: under a new term every session replays from position 0
            # (Pipeline.step), so what it holds is rebuilt or garbage (a former supernode's
            # sessions, cached prefixes of the old term).
            engine.drop_all()

    def discard(self, engine: StageEngine | None) -> None:
        """An engine loaded for a plan that never became active."""
        if engine is not None and engine is not self.engine:
            engine.close()

    def close(self) -> None:
        self.use(None)

    # -- files ---------------------------------------------------------------------------

    def serve_file(self, model: str, name: str) -> web.FileResponse:
        return serve_file(self.model_dir, self.manifest, model, name)

    def has_whole_model(self) -> bool:
        m = self.manifest
        return m is not None and self.model_dir is not None and not missing_files(self.model_dir, m, list(m.files))

    def sources(self) -> tuple[NodeId, ...]:
        """Peers that hold the whole model, this one first."""
        name = self.model_name
        out = [self.view.node_id] if self.has_whole_model() else []
        out += [pid for pid, link in self.view.live_links().items() if name in link.caps.models]
        return tuple(out)

    def _urls(self, peers: Iterable[NodeId]) -> list[tuple[NodeId, str]]:
        out = []
        for pid in peers:
            link = self.view.links.get(pid)
            if pid != self.view.node_id and link is not None and link.alive:
                out.append((pid, peer_url(self.config.scheme, link)))
        return out

    async def _fetch(self, manifest: Manifest, model_dir: Path, names: list[str], sources: Iterable[NodeId]) -> None:
        """Fetch ``names``: from the plan's sources first, then from any peer, each
        taking what the last could not give (after a loss, the files may be spread)."""
        errors = []
        sources = list(sources)
        others = [pid for pid in self.view.links if pid not in sources]
        for pid, base in self._urls(sources + others):
            names = missing_files(model_dir, manifest, names)
            if not names:
                return
            log.info("shard_fetch_started", source=pid, files=len(names),
                     bytes=sum(manifest.files[n].size for n in names))
            try:
                await fetch_files(self._http(), base, self._secret, self.view.node_id, manifest, names, model_dir)
                return
            except (*KNOWN_ERRORS, OSError, aiohttp.ClientError) as exc:
                errors.append(f"{pid}: {exc}")
                log.warning("shard_fetch_failed", source=pid, error=str(exc))
        if missing_files(model_dir, manifest, names):
            raise ShardMissing(f"could not fetch {len(names)} shard files: " + ("; ".join(errors) or "no peer has them"))

    async def replicate(self) -> None:
        """Fetch, in the background, the files of the model this peer lacks, so the
        mesh survives the loss of the only peer that held some of them."""
        m, model_dir = self.manifest, self.model_dir
        if not self.config.replicate or m is None or model_dir is None or self.replicating:
            return
        names = missing_files(model_dir, m, list(m.files))
        if not names:
            return
        self.replicating = True
        try:
            await self._fetch(m, model_dir, names, ())
            log.info("model_replicated", model=m.name, files=len(names))
        except (*KNOWN_ERRORS, OSError) as exc:
            log.warning("replicate_failed", error=str(exc))
        finally:
            self.replicating = False
