"""The model families meshd runs, by the names their files use.

``family(name)`` is the one a manifest's ``architecture`` names; ``for_hf`` and
``for_gguf`` pick one from a Hugging Face config's ``architectures`` or a GGUF file's
``general.architecture``. Adding a family: a module here with a ``Family`` subclass,
listed in FAMILIES, and its parity test.
"""

from __future__ import annotations

from shards.errors import ModelError
from shards.families.base import Family, GGUFMeta, HFConfig, Rows
from shards.families.gemma3 import Gemma3
from shards.families.llama import Llama, Mistral
from shards.families.phi3 import Phi3
from shards.families.qwen import Qwen2, Qwen3

FAMILIES: dict[str, Family] = {f.name: f for f in (Llama(), Mistral(), Qwen2(), Qwen3(), Gemma3(), Phi3())}

__all__ = ["FAMILIES", "Family", "GGUFMeta", "HFConfig", "Rows", "family", "for_gguf", "for_hf"]


def family(name: str) -> Family:
    found = FAMILIES.get(name)
    if found is None:
        raise ModelError(f"architecture {name!r} is not supported (known: {', '.join(FAMILIES)})")
    return found


def for_hf(architectures: list[str], where: str) -> Family:
    for arch in architectures:
        for f in FAMILIES.values():
            if arch in f.hf_architectures:
                return f
    known = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise ModelError(f"{where}: architectures {architectures} not supported (known: {', '.join(known)})")


def for_gguf(arch: str, where: str) -> Family:
    for f in FAMILIES.values():
        if f.gguf_architecture == arch:
            return f
    known = sorted(f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture)
    raise ModelError(f"{where}: architecture {arch!r} is not supported (known: {', '.join(known)})")
