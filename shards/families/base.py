"""What every family module builds on: the Llama layout, and reading a config and weights
through a family's tables.

A family is a subclass of ``Family`` that says how it differs from a Llama: its names in
Hugging Face and GGUF files, the switches of the shared forward it sets, and the keys of
a config it refuses. Reading goes through four tables of *our* tensor name -> theirs
(``{i}`` is the layer number); an entry ``Rows(name, part, sizes)`` takes one block of
rows of a fused tensor (Phi-3's qkv_proj). ``read`` also applies the two transforms the
formats need: llama.cpp's Q/K row order undone, and norm weights stored with an offset.

A value read may be a float tensor or a dict of row-aligned tensors (a quantized matrix
as codes, scales, ...): row slicing and the Q/K row order apply to either.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Union, cast

import numpy as np
from torch import Tensor

from shards.errors import ModelError
from shards.config import ModelConfig, RopeScaling

Weight = Union[Tensor, dict[str, Tensor]]  # a tensor, or a quantized matrix's row-aligned parts
Getter = Callable[[str], Weight]


@dataclass(frozen=True, slots=True)
class Rows:
    """Block ``part`` of the rows of the fused tensor ``name``, cut in blocks of ``sizes(config)``."""

    name: str
    part: int
    sizes: Callable[[ModelConfig], tuple[int, ...]]


Table = Mapping[str, Union[str, Rows]]

# Llama's names, which most families share.
HF_EMBED = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
HF_LAYER = {
    "attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
}
GGUF_EMBED = {
    "tok_embeddings.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}
GGUF_LAYER = {
    "attention_norm.weight": "blk.{i}.attn_norm.weight",
    "attention.wq.weight": "blk.{i}.attn_q.weight",
    "attention.wk.weight": "blk.{i}.attn_k.weight",
    "attention.wv.weight": "blk.{i}.attn_v.weight",
    "attention.wo.weight": "blk.{i}.attn_output.weight",
    "ffn_norm.weight": "blk.{i}.ffn_norm.weight",
    "feed_forward.w1.weight": "blk.{i}.ffn_gate.weight",
    "feed_forward.w2.weight": "blk.{i}.ffn_down.weight",
    "feed_forward.w3.weight": "blk.{i}.ffn_up.weight",
}

# GGUF metadata every family reads (after "<arch>."); anything else under the
# architecture's prefix must be named by the family, or the file is refused.
GGUF_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned", "expert_count", "expert_used_count",
})

# Hugging Face config keys that change the computation in ways no family here does.
HF_REFUSED = {
    "num_local_experts": "mixture of experts", "num_experts": "mixture of experts",
    "n_routed_experts": "mixture of experts", "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping", "mlp_bias": "MLP biases",
    "attention_bias": "attention biases", "quantization_config": "pre-quantized weights",
}


def unpermute_rope(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's Q/K row order so the rotate-half rope applies.

    convert_hf_to_gguf interleaves each head's two rope halves:
    ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``;
    this is its inverse.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def map_rows(w: Weight, fn: Callable[[Tensor], Tensor]) -> Weight:
    """``fn`` on a tensor, or on each row-aligned part of a quantized one."""
    return {k: fn(v) for k, v in w.items()} if isinstance(w, dict) else fn(w)


def gguf_float(value: float) -> float:
    """GGUF stores floats as float32; the shortest decimal that rounds back to it."""
    return float(np.format_float_positional(np.float32(value), trim="-"))


class HFConfig:
    """A Hugging Face config.json (plus generation_config.json), read key by key."""

    def __init__(self, data: dict, path: Path | None = None, generation: dict | None = None):
        self.data, self.path, self.generation = data, path, generation or {}

    @classmethod
    def load(cls, model_dir: Path) -> HFConfig:
        data = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls(data, model_dir, gen)

    def get(self, key: str, default=None):
        value = self.data.get(key)
        return default if value is None else value

    def require(self, key: str):
        if self.data.get(key) is None:
            raise ModelError(f"{self.where}: config.json lacks {key}")
        return self.data[key]

    @property
    def where(self) -> str:
        return str(self.path) if self.path else "config"


class GGUFMeta:
    """A GGUF file's metadata under its architecture's prefix, and its tensors' names."""

    def __init__(self, fields: Mapping[str, object], arch: str, tensor: Callable[[str], Tensor],
                 tensor_names: set[str], name: str):
        self.fields, self.arch, self.tensor, self.tensor_names, self.name = fields, arch, tensor, tensor_names, name

    def get(self, key: str, default=None):
        """``<arch>.key``."""
        return self.fields.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelError(f"{self.name} lacks GGUF metadata {self.arch}.{key}")
        return value

    def arch_keys(self) -> set[str]:
        prefix = f"{self.arch}."
        return {k[len(prefix):] for k in self.fields if k.startswith(prefix)}


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Family:
    """The Llama layout; families override what differs."""

    name: ClassVar[str] = "llama"
    hf_architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "llama"
    hf_embed: ClassVar[Table] = HF_EMBED
    hf_layer: ClassVar[Table] = HF_LAYER
    gguf_embed: ClassVar[Table] = GGUF_EMBED
    gguf_layer: ClassVar[Table] = GGUF_LAYER
    gguf_keys: ClassVar[frozenset[str]] = frozenset()  # more metadata keys this family reads
    gguf_permuted: ClassVar[bool] = False  # llama.cpp reordered Q/K rows for its interleaved rope
    hf_norm_offset: ClassVar[float] = 0.0  # added to HF norm weights (Gemma computes x * (1 + w))
    hf_activations: ClassVar[tuple[str, ...]] = ("silu",)
    hf_allowed: ClassVar[frozenset[str]] = frozenset()  # keys of HF_REFUSED this family implements
    default_rope_theta: ClassVar[float] = 10000.0
    default_rms_eps: ClassVar[float] = 1e-6
    default_tied: ClassVar[bool] = False

    # -- configs ------------------------------------------------------------------------

    def config_from_hf(self, hf: HFConfig) -> ModelConfig:
        self.check_hf(hf)
        n_heads = int(hf.require("num_attention_heads"))
        hidden = int(hf.require("hidden_size"))
        eos = _eos_list(hf.get("eos_token_id")) + _eos_list(hf.generation.get("eos_token_id"))
        base = dict(
            n_layers=int(hf.require("num_hidden_layers")),
            hidden_size=hidden,
            intermediate_size=int(hf.require("intermediate_size")),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads", n_heads)),
            head_dim=int(hf.get("head_dim", hidden // n_heads)),
            rms_norm_eps=float(hf.get("rms_norm_eps", self.default_rms_eps)),
            vocab_size=int(hf.require("vocab_size")),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", self.default_tied)),
            bos_token_id=None if hf.get("bos_token_id") is None else int(hf.get("bos_token_id")),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )
        return ModelConfig(**(base | self.hf_switches(hf, base)))

    def check_hf(self, hf: HFConfig) -> None:
        """Refuse a config that asks for what the forward does not do, naming the key."""
        for key, what in HF_REFUSED.items():
            value = hf.data.get(key)
            if key not in self.hf_allowed and value not in (None, False, 0, {}):
                raise ModelError(f"{hf.where}: {key}={value!r} ({what}) is not supported for {self.name}")
        act = hf.get("hidden_act") or hf.get("hidden_activation") or self.hf_activations[0]
        if act not in self.hf_activations:
            raise ModelError(f"{hf.where}: hidden_act={act!r} is not supported for {self.name} "
                             f"(known: {', '.join(self.hf_activations)})")

    def hf_switches(self, hf: HFConfig, base: dict) -> dict:
        """The forward's switches this family sets, and its rope."""
        theta, scaling = self.hf_rope(hf, hf.get("rope_parameters") or {})
        out = {"rope_theta": theta, "rope_scaling": scaling}
        if scaling is not None and scaling.kind == "dynamic":  # the context it is scaled to reach
            # (dynamic scaling has original_max_position: RopeScaling checks)
            out["max_position"] = int(cast(int, scaling.original_max_position) * scaling.factor)
        return out

    def hf_rope(self, hf: HFConfig, params: Mapping) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) from transformers' ``rope_parameters`` (``params``) or the older
        ``rope_theta`` + ``rope_scaling`` pair."""
        scaling = hf.get("rope_scaling") or {}
        merged = {**scaling, **params}
        kind = merged.get("rope_type") or merged.get("type") or "default"
        theta = float(merged.get("rope_theta", hf.get("rope_theta", self.default_rope_theta)))
        partial = merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise ModelError(f"{hf.where}: partial_rotary_factor={partial} is not supported")
        if kind == "default":
            return theta, None
        factor = float(merged.get("factor", 1.0))
        if kind == "linear":
            return theta, RopeScaling("linear", factor)
        if kind == "dynamic":
            return theta, RopeScaling("dynamic", factor, original_max_position=int(hf.require("max_position_embeddings")))
        if kind == "llama3":
            return theta, RopeScaling(
                "llama3", factor, low_freq_factor=float(merged["low_freq_factor"]),
                high_freq_factor=float(merged["high_freq_factor"]),
                original_max_position=int(merged["original_max_position_embeddings"]))
        raise ModelError(f"{hf.where}: rope scaling rope_type={kind!r} is not supported "
                         f"(known: default, linear, dynamic, llama3)")

    def config_from_gguf(self, meta: GGUFMeta) -> ModelConfig:
        unknown = meta.arch_keys() - GGUF_KEYS - self.gguf_keys
        if unknown:
            raise ModelError(f"{meta.name}: GGUF metadata {', '.join(f'{meta.arch}.{k}' for k in sorted(unknown))} "
                             f"is not supported for {self.name}")
        if meta.get("expert_count", 0):
            raise ModelError(f"{meta.name}: {meta.arch}.expert_count={meta.get('expert_count')} "
                             "(mixture of experts) is not supported")
        hidden = int(meta.require("embedding_length"))
        n_heads = int(meta.require("attention.head_count"))
        head_dim = int(meta.get("attention.key_length", hidden // n_heads))
        for key in ("attention.value_length", "rope.dimension_count"):
            if int(meta.get(key, head_dim)) != head_dim:
                raise ModelError(f"{meta.name}: {meta.arch}.{key}={meta.get(key)} differs from the head size "
                                 f"{head_dim} (partial rope or unequal K/V heads are not supported)")
        n_kv = meta.get("attention.head_count_kv", n_heads)
        if not isinstance(n_kv, int) or not isinstance(meta.get("feed_forward_length"), int):
            raise ModelError(f"{meta.name}: per-layer head counts or feed-forward sizes are not supported")
        vocab = meta.get("vocab_size")
        if vocab is None:
            vocab = len(cast("Sequence[str]", meta.fields.get("tokenizer.ggml.tokens") or ()))
        eos = [cast("int | None", meta.fields.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")]
        bos = cast("int | None", meta.fields.get("tokenizer.ggml.bos_token_id"))
        base = dict(
            n_layers=int(meta.require("block_count")),
            hidden_size=hidden,
            intermediate_size=int(meta.require("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            rope_theta=float(meta.get("rope.freq_base", self.default_rope_theta)),
            rms_norm_eps=gguf_float(meta.require("attention.layer_norm_rms_epsilon")),
            vocab_size=int(vocab),
            max_position=int(meta.require("context_length")),
            tie_embeddings="output.weight" not in meta.tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
        return ModelConfig(**(base | self.gguf_switches(meta, base)))

    def gguf_switches(self, meta: GGUFMeta, base: dict) -> dict:
        return {"rope_scaling": self.gguf_rope(meta)}

    def gguf_rope(self, meta: GGUFMeta) -> RopeScaling | None:
        kind = meta.get("rope.scaling.type", "none")
        if kind not in ("none", "linear"):
            raise ModelError(f"{meta.name}: {meta.arch}.rope.scaling.type={kind!r} is not supported "
                             "(known: none, linear)")
        if "rope_freqs.weight" in meta.tensor_names:  # Llama 3.1: one divisor per frequency
            if kind != "none":
                raise ModelError(f"{meta.name}: rope_freqs together with rope scaling {kind} is not supported")
            factors = meta.tensor("rope_freqs.weight").flatten().tolist()
            return RopeScaling("factors", freq_factors=tuple(float(f) for f in factors))
        if kind == "linear":
            return RopeScaling("linear", float(meta.require("rope.scaling.factor")))
        return None

    # -- weights ------------------------------------------------------------------------

    def tables(self, fmt: str) -> tuple[Table, Table]:
        return (self.hf_embed, self.hf_layer) if fmt == "hf" else (self.gguf_embed, self.gguf_layer)

    def source_names(self, fmt: str, c: ModelConfig) -> set[str]:
        """Every tensor name the conversion reads from a source of format ``fmt``."""
        embed, layer = self.tables(fmt)
        names = {_name(spec) for ours, spec in embed.items() if not (c.tie_embeddings and ours == "output.weight")}
        return names | {_name(spec).format(i=i) for i in range(c.n_layers) for spec in layer.values()}

    def source_name(self, fmt: str, ours: str, layer: int | None) -> str:
        """The source tensor ``ours`` is read from (a fused tensor's, for a Rows entry)."""
        embed, table = self.tables(fmt)
        return _name((embed if layer is None else table)[ours]).format(i=layer)

    def read(self, fmt: str, get: Getter, c: ModelConfig, layer: int | None) -> dict[str, Weight]:
        """Our tensors of the embed file (``layer`` None) or of one layer, read with ``get``."""
        embed, table = self.tables(fmt)
        if layer is None:
            table = {k: v for k, v in embed.items() if not (c.tie_embeddings and k == "output.weight")}
        fused: dict[str, Weight] = {}
        out: dict[str, Weight] = {}
        for ours, spec in table.items():
            if isinstance(spec, Rows):
                name = spec.name.format(i=layer)
                if name not in fused:
                    fused[name] = get(name)
                sizes = spec.sizes(c)
                lo = sum(sizes[: spec.part])

                def cut(t: Tensor, a: int = lo, b: int = lo + sizes[spec.part]) -> Tensor:
                    return _rows(t, a, b, name, sum(sizes))
                w = map_rows(fused[name], cut)
            else:
                w = get(spec.format(i=layer))
            out[ours] = self.transform(fmt, ours, w, c)
        return out

    def transform(self, fmt: str, ours: str, w: Weight, c: ModelConfig) -> Weight:
        if fmt == "gguf" and self.gguf_permuted:
            heads = {"attention.wq": c.n_heads, "attention.wk": c.n_kv_heads}.get(ours.rsplit(".", 1)[0])
            if heads is not None:
                return map_rows(w, lambda t: unpermute_rope(t, heads))
        if fmt == "hf" and self.hf_norm_offset and _is_norm(ours):
            return cast(Tensor, w) + self.hf_norm_offset  # (a Hugging Face file's weights are plain tensors)
        return w


def _name(spec: str | Rows) -> str:
    return spec.name if isinstance(spec, Rows) else spec


def _is_norm(ours: str) -> bool:
    return ours.endswith(".weight") and "norm" in ours.split(".")[-2]


def _rows(t: Tensor, lo: int, hi: int, name: str, total: int) -> Tensor:
    if t.shape[0] != total:
        raise ModelError(f"fused tensor {name} has {t.shape[0]} rows, the config says {total}")
    return t[lo:hi].contiguous()
