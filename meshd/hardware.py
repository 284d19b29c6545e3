"""What this box offers: device, memory, and a short speed probe for placement."""

from __future__ import annotations

import math
import os
import resource
import time

import torch

from shards import engine


def pick_device(requested: str) -> str:
    """The device name this peer advertises: the same choice the engine makes."""
    return engine.pick_device(requested).type


def _meminfo(key: str) -> int | None:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def total_ram() -> int:
    return _meminfo("MemTotal") or 0


def available_ram() -> int:
    available = _meminfo("MemAvailable")
    return available if available is not None else total_ram() // 2


def process_rss() -> int:
    """Resident memory of this process (current, from /proc; peak where there is no /proc):
    the "used" of the RAM column, this peer's own and, sent in each Pong, its peers'."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def detect_vram(device: str) -> int:
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return 0


def memory_budget(device: str, configured: int | None) -> int:
    """Bytes this peer offers for layers: the configured figure, else most of what is free."""
    if configured is not None:
        return configured
    if device == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.9)
    return int(available_ram() * 0.7)


def speed_probe(device: str, hidden: int = 576, intermediate: int = 1536, repeats: int = 20, rounds: int = 5) -> float:
    """Milliseconds for the matmuls of one reference-sized Llama layer at batch 1.

    Placement needs only relative speed, so a fixed reference layer serves every
    model and a peer can report it before it has any weights.
    """
    dev = torch.device(device)
    dtype = torch.float32 if device == "cpu" else torch.float16
    x = torch.randn(1, hidden, device=dev, dtype=dtype)
    qkvo = torch.randn(hidden, hidden * 2, device=dev, dtype=dtype)
    up = torch.randn(hidden, intermediate * 2, device=dev, dtype=dtype)
    down = torch.randn(intermediate, hidden, device=dev, dtype=dtype)

    def layer() -> torch.Tensor:
        h = x @ qkvo
        g = x @ up
        return (g[:, :intermediate] @ down) + h[:, :hidden]

    # torch imports parts of itself the first time a module is built on the meta
    # device (~2 s): pay that here, not in the middle of a failover.
    torch.nn.Embedding(2, 2, device="meta")
    with torch.inference_mode():
        for _ in range(3):
            layer()
        best = math.inf
        # The best of a few rounds: another process on the same core only ever slows a
        # round down, and placement must not read a neighbour's burst as a slow box
        # (measured here: two equal pinned peers probed 1.3 and 2.2 ms under load).
        for _ in range(rounds):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                layer()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) * 1000.0 / repeats)
    return best
