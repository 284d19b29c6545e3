"""Reading a Hugging Face model directory: config.json, *.safetensors (maybe sharded), tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from shards.errors import ModelError
from shards.config import ModelConfig
from shards.source import TensorSource

# Our tensor name -> the Hugging Face Llama name (``{i}`` is the layer number).
EMBED_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
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
ARCHITECTURES = {"LlamaForCausalLM": "llama"}


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ModelError(f"rope scaling {kind!r} is not supported")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class HFSource(TensorSource):
    EMBED_NAMES = EMBED_NAMES
    LAYER_NAMES = LAYER_NAMES

    format = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        cfg = json.loads((self.path / "config.json").read_text())
        archs = cfg.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ModelError(f"{self.path}: architectures {archs} not supported (known: {sorted(ARCHITECTURES)})")
        self.architecture = ARCHITECTURES[known[0]]
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        n_heads = int(cfg["num_attention_heads"])
        self.config = ModelConfig(
            n_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            rope_theta=_rope_theta(cfg),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=int(cfg["vocab_size"]),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
        self.name = self.path.name.lower()
        self.chat_template = self._chat_template()
        self._where = self._index()

    def _index(self) -> dict[str, Path]:
        """Tensor name -> the safetensors file holding it, over every shard."""
        where: dict[str, Path] = {}
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key in where:
                        raise ModelError(f"tensor {key} is in both {where[key].name} and {f.name}")
                    where[key] = f
        return where

    def _chat_template(self) -> str | None:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tc = self.path / "tokenizer_config.json"
        if tc.is_file():
            template = json.loads(tc.read_text()).get("chat_template")
            if isinstance(template, str):
                return template
        return None

    def _get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ModelError(f"{self.path} lacks tensor {name}")
        with safe_open(str(f), framework="pt") as st:
            return st.get_tensor(name).to(torch.float32)

    def tokenizer_bytes(self) -> bytes:
        """Their tokenizer.json as is, after checking that it loads."""
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{self.path} has no tokenizer.json")
        raw = path.read_bytes()
        Tokenizer.from_str(raw.decode())
        return raw
