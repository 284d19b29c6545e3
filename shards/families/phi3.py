"""Phi-3: the Llama forward with Q, K and V in one fused projection and the MLP's gate and
up in another, split here into our separate matrices (rows: q | k | v, gate | up). Its
configs carry a sliding window that transformers applies to every layer; llama.cpp reads
it and switches it off, so prompts longer than the window differ between the two."""

from __future__ import annotations

from shards.families.base import GGUF_LAYER, HF_LAYER, Family, HFConfig, Rows
from shards.config import ModelConfig


def _qkv(c: ModelConfig) -> tuple[int, ...]:
    return c.q_size, c.kv_size, c.kv_size


def _gate_up(c: ModelConfig) -> tuple[int, ...]:
    return c.intermediate_size, c.intermediate_size


def _fused(table: dict, qkv: str, gate_up: str) -> dict:
    return table | {
        "attention.wq.weight": Rows(qkv, 0, _qkv), "attention.wk.weight": Rows(qkv, 1, _qkv),
        "attention.wv.weight": Rows(qkv, 2, _qkv),
        "feed_forward.w1.weight": Rows(gate_up, 0, _gate_up), "feed_forward.w3.weight": Rows(gate_up, 1, _gate_up),
    }


class Phi3(Family):
    name = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)
    gguf_architecture = "phi3"
    hf_layer = _fused(HF_LAYER, "model.layers.{i}.self_attn.qkv_proj.weight", "model.layers.{i}.mlp.gate_up_proj.weight")
    gguf_layer = _fused(GGUF_LAYER, "blk.{i}.attn_qkv.weight", "blk.{i}.ffn_up.weight")
    gguf_keys = frozenset({"attention.sliding_window", "rope.scaling.attn_factor"})

    def hf_switches(self, hf: HFConfig, base: dict) -> dict:
        out = super().hf_switches(hf, base)
        if (window := hf.get("sliding_window")) is not None and int(window) < base["max_position"]:
            out |= {"sliding_window": int(window), "layer_types": ("sliding",) * base["n_layers"]}
        return out

    def gguf_switches(self, meta, base: dict) -> dict:
        if float(meta.get("rope.scaling.attn_factor", 1.0)) != 1.0 or "rope_factors_long.weight" in meta.tensor_names:
            from shards.errors import ModelError

            raise ModelError(f"{meta.name}: long-context rope (rope_factors_long, attn_factor) is not supported")
        out = super().gguf_switches(meta, base)
        window = int(meta.get("attention.sliding_window", 0))
        if 0 < window < base["max_position"]:
            out |= {"sliding_window": window, "layer_types": ("sliding",) * base["n_layers"]}
        return out
