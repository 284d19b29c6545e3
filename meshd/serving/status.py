"""GET /status: this peer's view of the mesh, in the JSON shape of DESIGN.md."""

from __future__ import annotations

import dataclasses
import time

from meshd import __version__
from meshd.control.mesh import PeerState, Role, plan_json
from meshd.serving.daemon import Daemon
from protocol.messages import Measured


def build_status(node: Daemon) -> dict:
    view, caps, scheduler = node.view, node.view.caps, node.scheduler
    serving = node.uplink.serves()
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
        "role": view.role(node.node_id),
        "layers": view.span_of(node.node_id),
        "serving": serving,
        "uptime_s": round(time.time() - node.started, 1),
        "sessions": node.store.engine.sessions if node.store.engine is not None else 0,
        "scheduler": {
            "active": len(scheduler.active),
            "steps": sum(lane.steps for lane in scheduler.lanes),
            "shared_steps": scheduler.shared_steps,
            "max_batch": scheduler.max_batch,
            "tokens_generated": scheduler.tokens_generated,
            "kv_reserved": scheduler.reserved_tokens,
            "kv_budget": scheduler.kv_budget_tokens,
            "batch_sessions": len(scheduler.active) - scheduler.interactive,
            "replays": node.pipeline.replays,
            "prefix_cache": scheduler.prefix.stats(),
            "speculation": scheduler.speculation(),
        },
        **node.metrics.status_fields(),  # memory in use, tokens/s
    }
    peers = [{
        "id": node.node_id, "name": node.config.name, "addr": me["addr"], "role": me["role"],
        "device": node.device, "vram": caps.vram, "ram": caps.ram, "ram_used": me["memory"]["rss"],
        "layers": me["layers"], "state": view.state(node.node_id), "rtt_ms": 0.0, "self": True,
        "measured": _measured(caps.measured),
    }]
    for pid, link in sorted(view.links.items()):
        peers.append({
            "id": pid, "name": link.hello.name, "addr": f"{link.addr}:{link.caps.api_port}",
            "role": view.role(pid), "device": link.caps.device, "vram": link.caps.vram, "ram": link.caps.ram,
            "ram_used": link.ram_used,  # its resident memory, from its last Pong (None: not heard yet)
            "layers": view.span_of(pid), "state": view.state(pid),
            "rtt_ms": round(link.rtt_ms, 3) if link.rtt_ms is not None else None,
            # the least of its last few round trips: the hop placement weighs a span there by
            "rtt_floor_ms": round(f, 3) if (f := link.rtt_floor_ms) is not None else None,
            "measured": _measured(view.measured.get(pid, link.caps.measured)),
        })
    for pid, lost in sorted(view.lost.items()):
        caps_lost = lost.hello.caps
        peers.append({
            "id": pid, "name": lost.hello.name, "addr": f"{lost.addr}:{caps_lost.api_port}", "role": Role.IDLE,
            "device": caps_lost.device, "vram": caps_lost.vram, "ram": caps_lost.ram, "ram_used": None, "layers": None,
            "state": PeerState.LOST, "rtt_ms": None, "lost_reason": lost.reason,
            "lost_s": round(time.time() - lost.since, 1),
        })
    return {
        "node": me,
        "supernode": view.supernode,
        "term": view.shown_term(),
        "model": node.model_name,
        "serving": serving,
        "reason": None if serving else node.uplink.unavailable_reason(),
        "plan": plan_json(view.plan.assignments) if view.plan is not None else [],
        "peers": peers,
        "terms": [t.to_json() for t in view.history[-10:]],
        "batches": node.batches.status(),  # batch jobs running on this peer
    }


def _measured(m: Measured) -> dict | None:
    """A peer's timing of the model's real parts, as placement weighs it (None: not timed)."""
    return dataclasses.asdict(m) if m.model else None
