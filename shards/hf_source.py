"""Reading a Hugging Face model directory: config.json, *.safetensors (maybe sharded), tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from shards.errors import ModelError
from shards.families import HFConfig, for_hf
from shards.families.base import HF_EMBED, HF_LAYER
from shards.source import TensorSource

# Llama's names (the tiny test model writes them).
EMBED_NAMES, LAYER_NAMES = HF_EMBED, HF_LAYER


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


class HFSource(TensorSource):
    format = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        hf = HFConfig.load(self.path)
        self.family = for_hf(hf.get("architectures") or [], str(self.path))
        self.architecture = self.family.name
        self.config = self.family.config_from_hf(hf)
        self.name = self.path.name.lower()
        self.chat_template = self._chat_template()
        self.special_tokens = self._special_tokens()
        self._where = self._index()
        # Old checkpoints carry rope buffers; tied ones sometimes the head's copy of the embedding.
        extra = {n for n in self._where if n.endswith("rotary_emb.inv_freq")}
        if self.config.tie_embeddings:
            extra.add("lm_head.weight")
        self._check_all_used(set(self._where), extra, str(self.path))

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
            if isinstance(template, list):  # named templates: the default one
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                if isinstance(named.get("default"), str):
                    return named["default"]
        return None

    def _special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad texts from tokenizer_config.json (a string or {"content": ...})."""
        tc = self.path / "tokenizer_config.json"
        data = json.loads(tc.read_text()) if tc.is_file() else {}
        out = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = data.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[name] = value
        return out

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
