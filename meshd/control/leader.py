"""The supernode's side of negotiation: Plan -> load -> Accept/Reject -> re-plan
until every span is owned -> Commit, then the plan is active.

``lead`` runs as one task of the node; a change of view cancels it and starts
a new one under a higher term.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog

from meshd.control.follower import NOT_MY_SUPERNODE, STALE_TERM, LocalRunner, has_whole_model, load_engine, prepare_model, replicate
from meshd.control.placement import place, replan
from meshd.errors import KNOWN_ERRORS, NoCapacity, PeerLost
from meshd.serving.pipeline import ActivePlan
from protocol.messages import Accept, Commit, NodeId, Plan, Reject

if TYPE_CHECKING:
    from meshd.node import Node

log = structlog.get_logger()

# A peer whose view has not caught up rejects with NOT_MY_SUPERNODE; wait and ask again.
# (A peer at a higher term names it, and is asked again above it at once.)
# The waits double from VIEW_RETRY_FIRST_S up to settle_s: a closed socket reaches every
# peer within milliseconds, a heartbeat loss within a beat or two (5.5 s in all at 1 s).
VIEW_RETRIES = 8
VIEW_RETRY_FIRST_S = 0.1


async def lead(node: Node, reason: str = "") -> None:
    t0 = time.monotonic()
    try:
        manifest, model_dir = await prepare_model(node, node.model_name, sources=_sources(node))
    except KNOWN_ERRORS as exc:
        node.unavailable = f"the supernode has no model: {exc}"
        log.error("supernode_no_model", error=str(exc))
        await node.pipeline.set_plan(None, node.unavailable)
        return
    node.tokenizer_for(model_dir)
    excluded: dict[NodeId, str] = {}
    view_retries = 0
    while True:
        node.term += 1
        term = node.term
        candidates = [c for c in node.candidates()
                      if c.node_id not in excluded and c.node_id not in node.draining]
        alive = {c.node_id for c in candidates}
        # Decode is bound by bytes read, so the head costs what its bytes cost in layers.
        head_ms = node.caps.layer_ms * manifest.embed_bytes / max(1, manifest.layer_bytes(0))
        args = dict(supernode=node.node_id, n_layers=manifest.n_layers,
                    layer_bytes=[manifest.layer_bytes(i) for i in range(manifest.n_layers)],
                    head_bytes=manifest.embed_bytes, hop_ms=node.hop_ms(), head_ms=head_ms)
        try:
            if node.plan is not None:
                assignments = replan(node.plan.assignments, alive, candidates, **args)
            else:
                assignments = place(candidates, **args)
        except NoCapacity as exc:
            node.unavailable = str(exc)
            log.error("plan_impossible", term=term, reason=str(exc))
            await node.pipeline.set_plan(None, node.unavailable)
            return
        log.info("planning", term=term, reason=reason)
        plan = Plan(term, node.node_id, manifest.name, manifest.digest, assignments, sources=_sources(node))
        log.info("plan_proposed", term=term, plan=" ".join(f"{a.node}={a.span}" for a in assignments))
        node.pending_term = term  # replies are matched by it: a stale-term Reject moves node.term
        node.pending_replies = {a.node: asyncio.get_running_loop().create_future()
                                for a in assignments if a.node != node.node_id}
        for link in list(node.links.values()):
            with contextlib.suppress(PeerLost):
                await link.send(plan)
        mine = next((a.span for a in assignments if a.node == node.node_id), None)
        try:
            engine = await load_engine(node, manifest, model_dir, mine, embed=True, head=True,
                                       sources=plan.sources)
        except KNOWN_ERRORS as exc:
            node.unavailable = f"the supernode cannot load its part: {exc}"
            log.error("supernode_load_failed", error=str(exc))
            await node.pipeline.set_plan(None, node.unavailable)
            return
        replies = await _collect(node, node.config.accept_timeout_s)
        rejects = {n: r for n, r in replies.items() if not isinstance(r, Accept)}
        if rejects:
            for n, why in rejects.items():
                log.warning("plan_rejected", term=term, peer=n, reason=str(why))
            # A stale term (this supernode restarted, its term began again at 0) is
            # retried too, above the term the peer named: excluding the peer would
            # leave the restarted supernode planning alone.
            behind = [r for r in rejects.values() if NOT_MY_SUPERNODE in str(r)]
            stale = [r for r in rejects.values() if STALE_TERM.search(str(r))]
            if len(behind) + len(stale) == len(rejects) and view_retries < VIEW_RETRIES:
                view_retries += 1
                if behind:
                    await asyncio.sleep(min(node.config.settle_s, VIEW_RETRY_FIRST_S * 2 ** (view_retries - 1)))
            else:
                excluded.update({n: str(r) for n, r in rejects.items()})
            continue
        break

    if node.supernode != node.node_id:
        # While this plan loaded, this peer accepted the plan of the peer it now
        # elects (it led alone while cut off, and rejoined): activating this one
        # would put it on a term of its own, refusing the mesh's frames for good.
        log.info("plan_abandoned", term=term, supernode=node.supernode)
        if engine is not node.engine:
            engine.close()
        return
    for link in list(node.links.values()):
        with contextlib.suppress(PeerLost):
            await link.send(Commit(term))
    node.activate(plan, engine, reason)
    runners = {a.node: (LocalRunner(node, engine) if a.node == node.node_id else node.links[a.node])
               for a in assignments}
    await node.pipeline.set_plan(ActivePlan(term, assignments, runners))
    node.unavailable = ""
    node.spawn(replicate(node))
    log.info("plan_active", term=term, seconds=round(time.monotonic() - t0, 2),
             plan=" ".join(f"{a.node}={a.span}" for a in assignments))


def _sources(node: Node) -> tuple[NodeId, ...]:
    """Peers that hold the whole model, this one first."""
    name = node.model_name
    out = [node.node_id] if has_whole_model(node) else []
    out += [pid for pid, link in node.links.items() if link.alive and name in link.caps.models]
    return tuple(out)


async def _collect(node: Node, timeout: float) -> dict[NodeId, object]:
    """Each assigned peer's Accept or Reject; a peer that says nothing in time, or
    whose link drops, counts as a Reject."""
    futures = node.pending_replies
    if futures:
        await asyncio.wait(futures.values(), timeout=timeout)
    out: dict[NodeId, object] = {}
    for peer, future in futures.items():
        link = node.links.get(peer)
        if future.done():
            out[peer] = future.result()
        elif link is None or not link.alive:
            out[peer] = Reject(node.term, "link lost during negotiation")
        else:
            out[peer] = Reject(node.term, f"no answer in {timeout:.0f} s")
    node.pending_replies = {}
    return out


def on_reply(node: Node, sender: NodeId, msg: Accept | Reject) -> None:
    future = node.pending_replies.get(sender)
    if future is None or future.done() or msg.term != node.pending_term:
        log.debug("reply_ignored", peer=sender, term=msg.term)
        return
    future.set_result(msg)
