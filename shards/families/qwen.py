"""Qwen2 / 2.5 (biases on the Q, K and V projections) and Qwen3 (an RMSNorm on each
head's Q and K, no biases). Neither has llama.cpp's Q/K row order (NEOX rope)."""

from __future__ import annotations

from typing import ClassVar

from shards.families.base import GGUF_LAYER, HF_LAYER, Family, HFConfig


def hf_layer_types(hf: HFConfig, n_layers: int) -> dict:
    """Sliding-window layers where the config turns them on (off in released Qwen models)."""
    if not hf.get("use_sliding_window", False):
        return {}
    window = int(hf.require("sliding_window"))
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return {"sliding_window": window, "layer_types": tuple(t.removesuffix("_attention") for t in types)}


class _Qwen(Family):
    switches: ClassVar[dict] = {}  # what this generation turns on, from either format

    def hf_switches(self, hf: HFConfig, base: dict) -> dict:
        return super().hf_switches(hf, base) | self.switches | hf_layer_types(hf, base["n_layers"])

    def gguf_switches(self, meta, base: dict) -> dict:
        return super().gguf_switches(meta, base) | self.switches


class Qwen2(_Qwen):
    name = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_architecture = "qwen2"
    hf_layer = HF_LAYER | {f"attention.w{p}.bias": f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"}
    gguf_layer = GGUF_LAYER | {f"attention.w{p}.bias": f"blk.{{i}}.attn_{p}.bias" for p in "qkv"}
    switches = {"attn_bias": True}


class Qwen3(_Qwen):
    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_architecture = "qwen3"
    hf_layer = HF_LAYER | {f"attention.{p}_norm.weight": f"model.layers.{{i}}.self_attn.{p}_norm.weight" for p in "qk"}
    gguf_layer = GGUF_LAYER | {f"attention.{p}_norm.weight": f"blk.{{i}}.attn_{p}_norm.weight" for p in "qk"}
    switches = {"qk_norm": True}
