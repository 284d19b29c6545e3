"""A peer's side of the mesh: follow the supernode's plans, load (and if need be
fetch) the span it is given, and run Forward frames through it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import structlog
import torch

from meshd.control.election import accepts_plan, elect
from meshd.control.placement import validate
from meshd.control.transfer import fetch_files, fetch_manifest, missing_files
from meshd.errors import KNOWN_ERRORS, ModelError, PeerLost, ProtocolError, ShardMissing
from protocol.messages import (
    Accept,
    Auth,
    Commit,
    Drop,
    Fail,
    Forward,
    ForwardBatch,
    Hello,
    Message,
    NodeId,
    Plan,
    Reject,
    Result,
    ResultBatch,
    Segment,
)
from shards.engine import StageEngine
from shards.manifest import MANIFEST_FILE, Manifest
from shards.span import Span

if TYPE_CHECKING:
    from meshd.node import Node
    from meshd.control.peers import Link

log = structlog.get_logger()

NOT_MY_SUPERNODE = "not my supernode"
STALE_TERM = re.compile(r"stale term: this peer is at term (\d+)")


async def run_span(node: Node, engine: StageEngine, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
    if node.config.debug_layer_delay_ms and engine.span is not None:
        await asyncio.sleep(node.config.debug_layer_delay_ms * len(engine.span) / 1000.0)
    began = time.monotonic()
    out = await engine.forward_batch([(g.session, g.start, g.rows) for g in segments],
                                     hidden.to(engine.device, engine.dtype))
    node.metrics.forwarded(hidden.shape[0], time.monotonic() - began)
    return out


class LocalRunner:
    """The supernode's own span, behind the same interface as a peer link."""

    def __init__(self, node: Node, engine: StageEngine):
        self.node = node
        self.engine = engine

    async def forward_batch(self, term: int, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
        try:
            return await run_span(self.node, self.engine, segments, hidden)
        except ModelError:
            if self.engine.closed:  # a new plan replaced our span mid-step: retry under it
                raise PeerLost(f"the supernode's span of term {term} was replaced by a newer plan") from None
            raise

    async def drop(self, term: int, session: str) -> None:
        self.engine.drop(session)


async def handle(node: Node, link: Link, msg: Message) -> None:
    match msg:
        case Plan():
            node.spawn(on_plan(node, link, msg))
        case Accept() | Reject():
            from meshd.control import leader

            if isinstance(msg, Reject) and (m := STALE_TERM.search(msg.reason)):
                node.term = max(node.term, int(m.group(1)))
            leader.on_reply(node, link.peer_id, msg)
        case Commit():
            on_commit(node, link, msg)
        case Forward():
            segments = [Segment(msg.session, msg.start, msg.hidden.shape[0] if msg.hidden.dim() == 2 else 0)]
            node.spawn(serve_forward(node, link, msg.term, msg.req, segments, msg.hidden, single=msg.session))
        case ForwardBatch():
            node.spawn(serve_forward(node, link, msg.term, msg.req, list(msg.segments), msg.hidden))
        case Drop(session=session):
            if node.engine is not None:
                node.engine.drop(session)
        case Hello() | Auth():
            raise ProtocolError(f"{type(msg).__name__} after the handshake")
        case _:
            raise ProtocolError(f"unexpected {type(msg).__name__}")


async def _reply(link: Link, msg: Message) -> None:
    with contextlib.suppress(PeerLost):
        await link.send(msg)


async def on_plan(node: Node, link: Link, plan: Plan) -> None:
    sender = link.peer_id
    expected = elect(node.candidates())
    if plan.supernode != sender or not accepts_plan(expected, plan.term, sender, plan.term):
        await _reply(link, Reject(plan.term, f"{NOT_MY_SUPERNODE} (this peer holds {expected})"))
        return
    if not accepts_plan(expected, node.term, sender, plan.term):
        await _reply(link, Reject(plan.term, f"stale term: this peer is at term {node.term}"))
        return
    node.term = plan.term
    node.supernode = sender
    node.pending_plan = plan
    mine = next((a.span for a in plan.assignments if a.node == node.node_id), None)
    log.info("plan_received", term=plan.term, supernode=sender, span=str(mine) if mine else None)
    engine = None
    if mine is not None:
        try:
            manifest, model_dir = await prepare_model(node, plan.model, plan.sources, plan.manifest_digest)
            validate(plan.assignments, manifest.n_layers)
            engine = await load_engine(node, manifest, model_dir, mine, embed=False, head=False, sources=plan.sources)
        except (*KNOWN_ERRORS, OSError, aiohttp.ClientError) as exc:
            log.warning("plan_load_failed", term=plan.term, error=str(exc))
            await _reply(link, Reject(plan.term, f"cannot load {mine}: {exc}", node.caps.mem_budget))
            return
    if node.pending_plan is not plan:
        return  # a newer plan came while this one loaded
    node.prepared = (plan, engine)
    if mine is not None:
        await _reply(link, Accept(plan.term, mine))


def on_commit(node: Node, link: Link, commit: Commit) -> None:
    prepared = node.prepared
    if prepared is None or prepared[0].term != commit.term or prepared[0].supernode != link.peer_id:
        log.warning("commit_ignored", term=commit.term, peer=link.peer_id)
        return
    node.prepared = None
    node.activate(*prepared, reason=f"plan of supernode {link.peer_id}")
    log.info("plan_active", term=commit.term, supernode=link.peer_id)
    node.spawn(replicate(node))


async def serve_forward(node: Node, link: Link, term: int, req: int, segments: list[Segment],
                        hidden: torch.Tensor, single: str | None = None) -> None:
    """Run a Forward (``single`` session) or ForwardBatch frame through this
    peer's span and answer with Result / ResultBatch, or Fail."""
    plan, engine = node.plan, node.engine
    if plan is None or term != plan.term or link.peer_id != plan.supernode or engine is None:
        log.warning("stale_frame_dropped", peer=link.peer_id, term=term, mine=plan.term if plan else None)
        await _reply(link, Fail(term, req, f"stale or unknown term {term}"))
        return
    try:
        out = await run_span(node, engine, segments, hidden)
    except KNOWN_ERRORS as exc:
        log.warning("forward_failed", sessions=len(segments), error=str(exc))
        await _reply(link, Fail(term, req, str(exc)))
        return
    if single is not None:
        await _reply(link, Result(term, single, req, out))
    else:
        await _reply(link, ResultBatch(term, req, out))


# -- model files -------------------------------------------------------------------


def _source_urls(node: Node, sources) -> list[tuple[NodeId, str]]:
    out = []
    for pid in sources:
        link = node.links.get(pid)
        if pid != node.node_id and link is not None and link.alive:
            out.append((pid, node.peer_url(link)))
    return out


async def prepare_model(node: Node, name: str, sources, digest: str | None = None) -> tuple[Manifest, Path]:
    """The manifest and directory of model ``name`` (with ``digest`` if given):
    this peer's own copy, else one fetched earlier, else the manifest fetched
    from a source peer (the shard files follow per span in ``load_engine``)."""
    def fits(m: Manifest | None) -> bool:
        return m is not None and m.name == name and (digest is None or m.digest == digest)

    if fits(node.manifest):
        return node.manifest, node.model_dir
    store = node.config.state_dir / "models" / name
    if (store / MANIFEST_FILE).is_file():
        m = Manifest.load(store)
        if fits(m):
            node.adopt_model(store, m)
            return m, store
    for pid, base in _source_urls(node, sources):
        try:
            m = await fetch_manifest(node.http, base, node.secret, node.node_id, name)
        except (*KNOWN_ERRORS, OSError, aiohttp.ClientError) as exc:
            log.warning("manifest_fetch_failed", source=pid, error=str(exc))
            continue
        if not fits(m):
            continue
        store.mkdir(parents=True, exist_ok=True)
        (store / MANIFEST_FILE).write_bytes(m.to_bytes())
        node.adopt_model(store, m)
        log.info("manifest_fetched", model=name, source=pid)
        return m, store
    raise ShardMissing(f"model {name!r} is not here and no peer offered it (run `meshd model fetch {name}`)")


async def load_engine(node: Node, manifest: Manifest, model_dir: Path, span: Span | None, *, embed: bool,
                      head: bool, sources=()) -> StageEngine:
    """An engine for these parts: the current one if it already is, else loaded
    (after fetching exactly the missing shard files) on a worker thread."""
    key = (manifest.digest, span, embed, head)
    if node.engine is not None and getattr(node.engine, "meshd_key", None) == key:
        return node.engine
    names = manifest.files_for(span, embed or head)
    missing = missing_files(model_dir, manifest, names)
    if missing:
        await _fetch(node, manifest, model_dir, missing, sources)
    engine = await asyncio.to_thread(
        StageEngine.load, model_dir, span, embed, head, node.config.device, node.config.dtype
    )
    engine.meshd_key = key
    return engine


async def _fetch(node: Node, manifest: Manifest, model_dir: Path, names: list[str], sources) -> None:
    """Fetch ``names``: from the plan's sources first, then from any peer, each
    taking what the last could not give (after a loss, the files may be spread)."""
    errors = []
    others = [pid for pid in node.links if pid not in sources]
    for pid, base in _source_urls(node, list(sources) + others):
        names = missing_files(model_dir, manifest, names)
        if not names:
            return
        log.info("shard_fetch_started", source=pid, files=len(names),
                 bytes=sum(manifest.files[n].size for n in names))
        try:
            await fetch_files(node.http, base, node.secret, node.node_id, manifest, names, model_dir)
            return
        except (*KNOWN_ERRORS, OSError, aiohttp.ClientError) as exc:
            errors.append(f"{pid}: {exc}")
            log.warning("shard_fetch_failed", source=pid, error=str(exc))
    if missing_files(model_dir, manifest, names):
        raise ShardMissing(f"could not fetch {len(names)} shard files: " + ("; ".join(errors) or "no peer has them"))


def has_whole_model(node: Node) -> bool:
    m = node.manifest
    return m is not None and node.model_dir is not None and not missing_files(node.model_dir, m, list(m.files))


async def replicate(node: Node) -> None:
    """Fetch, in the background, the files of the model this peer lacks, so the
    mesh survives the loss of the only peer that held some of them."""
    m, model_dir = node.manifest, node.model_dir
    if not node.config.replicate or m is None or model_dir is None or node.replicating:
        return
    names = missing_files(model_dir, m, list(m.files))
    if not names:
        return
    node.replicating = True
    try:
        await _fetch(node, m, model_dir, names, ())
        log.info("model_replicated", model=m.name, files=len(names))
    except (*KNOWN_ERRORS, OSError) as exc:
        log.warning("replicate_failed", error=str(exc))
    finally:
        node.replicating = False
