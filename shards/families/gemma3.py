"""Gemma 3 text models: embeddings scaled by sqrt(hidden), RMSNorms that multiply by
(1 + w) (llama.cpp stores w + 1, and so do our shards), a norm after attention and after
the MLP too (sandwich), per-head Q/K norms, GELU, a softmax scale of
query_pre_attn_scalar ** -0.5, and sliding-window layers between global ones, each kind
with its own rope base (only the global layers' rope is scaled).

llama.cpp writes no pattern for the layers: it takes every sixth as global, and the
softmax scale as 1/sqrt(head_dim) except for the 27B's 62 layers (hidden / heads).
"""

from __future__ import annotations

from shards.errors import ModelError
from shards.families.base import GGUF_LAYER, HF_LAYER, Family, GGUFMeta, HFConfig

_SANDWICH_HF = {
    "attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_SANDWICH_GGUF = {
    "post_attention_norm.weight": "blk.{i}.post_attention_norm.weight",
    "post_ffn_norm.weight": "blk.{i}.post_ffw_norm.weight",
}
GLOBAL_EVERY = 6  # llama.cpp's default pattern: layers 5, 11, 17, ... are global
LOCAL_THETA = 10000.0


class Gemma3(Family):
    name = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM",)
    gguf_architecture = "gemma3"
    hf_layer = HF_LAYER | _SANDWICH_HF | {
        f"attention.{p}_norm.weight": f"model.layers.{{i}}.self_attn.{p}_norm.weight" for p in "qk"}
    gguf_layer = GGUF_LAYER | _SANDWICH_GGUF | {
        f"attention.{p}_norm.weight": f"blk.{{i}}.attn_{p}_norm.weight" for p in "qk"}
    gguf_keys = frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                           "final_logit_softcapping"})
    hf_norm_offset = 1.0
    hf_activations = ("gelu_pytorch_tanh",)
    hf_allowed = frozenset({"final_logit_softcapping"})
    default_rope_theta = 1_000_000.0
    default_tied = True

    def hf_switches(self, hf: HFConfig, base: dict) -> dict:
        if hf.get("use_bidirectional_attention"):
            raise ModelError(f"{hf.where}: use_bidirectional_attention (an embedding model) is not supported")
        params = hf.get("rope_parameters") or {}
        if "full_attention" in params:  # transformers 5: one set of rope parameters per layer kind
            theta, scaling = self.hf_rope(hf, params["full_attention"])
            local = params.get("sliding_attention") or {}
            if (local.get("rope_type") or "default") != "default":
                raise ModelError(f"{hf.where}: scaled rope on sliding layers is not supported")
            local_theta = float(local.get("rope_theta", LOCAL_THETA))
        else:
            theta, scaling = self.hf_rope(hf, params)
            local_theta = float(hf.get("rope_local_base_freq", LOCAL_THETA))
        n = base["n_layers"]
        types = hf.get("layer_types")
        if types is None:
            every = int(hf.get("sliding_window_pattern", GLOBAL_EVERY))
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        cap = hf.get("final_logit_softcapping")
        return {
            "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
            "sliding_window": int(hf.get("sliding_window", 4096)),  # transformers' defaults
            "layer_types": tuple(t.removesuffix("_attention") for t in types),
            "qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
            "embed_scale": base["hidden_size"] ** 0.5,
            "query_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            "final_softcap": None if cap is None else float(cap),
        }

    def gguf_switches(self, meta: GGUFMeta, base: dict) -> dict:
        n = base["n_layers"]
        out = super().gguf_switches(meta, base) | {
            "qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
            "embed_scale": base["hidden_size"] ** 0.5,
            # gemma_pytorch's rule as llama.cpp has it: the 27B scales by hidden / heads.
            "query_scale": (base["hidden_size"] / base["n_heads"] if n == 62 else base["head_dim"]) ** -0.5,
        }
        if (cap := meta.get("final_logit_softcapping")):
            out["final_softcap"] = float(cap)
        window = int(meta.get("attention.sliding_window", 0))
        if window > 0:
            pattern = meta.get("attention.sliding_window_pattern", GLOBAL_EVERY)
            if isinstance(pattern, list):  # one flag per layer: true = sliding
                types = tuple("sliding" if p else "full" for p in pattern)
            else:
                every = int(pattern)
                types = tuple("sliding" if every == 0 or i % every < every - 1 else "full" for i in range(n))
            out |= {"sliding_window": window, "layer_types": types,
                    "rope_local_theta": float(meta.get("rope.freq_base_swa", LOCAL_THETA))}
        return out
