"""GET /status: this peer's view of the mesh, in the JSON shape of DESIGN.md."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from meshd import __version__

if TYPE_CHECKING:
    from meshd.node import Node


def _span_of(node: Node, peer_id: str) -> list[int] | None:
    plan = node.plan
    if plan is None:
        return None
    for a in plan.assignments:
        if a.node == peer_id:
            return a.span.to_list()
    return None


def _role(node: Node, peer_id: str) -> str:
    if peer_id == node.supernode:
        return "supernode"
    return "stage" if _span_of(node, peer_id) is not None else "idle"


def _state(node: Node, peer_id: str) -> str:
    if peer_id in node.draining:
        return "draining" if _span_of(node, peer_id) is not None else "drained"
    return "joining" if node.plan is None else "ready"


def build_status(node: Node) -> dict:
    caps = node.caps
    me = {
        "id": node.node_id,
        "name": node.config.name,
        "addr": f"{node.config.host}:{node.config.port}",
        "mesh": node.config.mesh,
        "version": __version__,
        "device": node.device,
        "vram": caps.vram,
        "ram": caps.ram,
        "mem_budget": caps.mem_budget,
        "layer_ms": caps.layer_ms,
        "role": _role(node, node.node_id),
        "layers": _span_of(node, node.node_id),
        "serving": node.serves(),
        "uptime_s": round(time.time() - node.started, 1),
        "sessions": node.engine.sessions if node.engine is not None else 0,
        "scheduler": {
            "active": len(node.scheduler.active),
            "steps": sum(lane.steps for lane in node.scheduler.lanes),
            "shared_steps": node.scheduler.shared_steps,
            "max_batch": node.scheduler.max_batch,
            "tokens_generated": node.scheduler.tokens_generated,
            "kv_reserved": node.scheduler.reserved_tokens,
            "kv_budget": node.scheduler.kv_budget_tokens,
            "batch_sessions": len(node.scheduler.active) - node.scheduler.interactive,
            "replays": node.pipeline.replays,
        },
        **node.metrics.status_fields(),  # memory in use, tokens/s
    }
    peers = [{
        "id": node.node_id, "name": node.config.name, "addr": me["addr"], "role": me["role"],
        "device": node.device, "vram": caps.vram, "ram": caps.ram, "layers": me["layers"],
        "state": _state(node, node.node_id) if node.plan else "joining", "rtt_ms": 0.0, "self": True,
    }]
    for pid, link in sorted(node.links.items()):
        peers.append({
            "id": pid, "name": link.hello.name, "addr": f"{link.addr}:{link.caps.api_port}",
            "role": _role(node, pid), "device": link.caps.device, "vram": link.caps.vram, "ram": link.caps.ram,
            "layers": _span_of(node, pid), "state": _state(node, pid),
            "rtt_ms": round(link.rtt_ms, 3) if link.rtt_ms is not None else None,
        })
    for pid, lost in sorted(node.lost.items()):
        caps_lost = lost.hello.caps
        peers.append({
            "id": pid, "name": lost.hello.name, "addr": f"{lost.addr}:{caps_lost.api_port}", "role": "idle",
            "device": caps_lost.device, "vram": caps_lost.vram, "ram": caps_lost.ram, "layers": None,
            "state": "lost", "rtt_ms": None, "lost_reason": lost.reason,
            "lost_s": round(time.time() - lost.since, 1),
        })
    plan = node.plan
    return {
        "node": me,
        "supernode": node.supernode,
        "term": plan.term if plan is not None else node.term,
        "model": node.model_name,
        "serving": node.serves(),
        "reason": None if node.serves() else node.unavailable_reason(),
        "plan": [{"node": a.node, "start": a.span.start, "stop": a.span.stop} for a in plan.assignments]
        if plan is not None else [],
        "peers": peers,
        "terms": node.history[-10:],
        "batches": node.batches.status(),  # batch jobs running on this peer
    }
