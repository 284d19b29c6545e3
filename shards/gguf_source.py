"""Reading a llama.cpp GGUF file: config from its metadata, tensors (dequantized, or as shipped), its vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, LlamaFileType
from gguf.quants import dequantize

from meshd.errors import ModelError
from shards.config import ModelConfig
from shards.source import TensorSource
from shards.ggml_blocks import repack
from shards.quant import TensorQuant
from shards.tokenizer import tokenizer_from_gguf

GGUF_MAGIC = b"GGUF"

# Our tensor name -> the GGUF name (``{i}`` is the layer number).
EMBED_NAMES = {
    "tok_embeddings.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "output.weight": "output.weight",
}
LAYER_NAMES = {
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


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order so the rotate-half rope applies.

    convert_hf_to_gguf interleaves each head's two rope halves:
    ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``;
    this is its inverse.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


class GGUFSource(TensorSource):
    EMBED_NAMES = EMBED_NAMES
    LAYER_NAMES = LAYER_NAMES

    format = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self._tensors = {t.name: t for t in self.reader.tensors}
        arch = self._field("general.architecture")
        if arch != "llama":
            raise ModelError(f"{self.path.name}: architecture {arch!r} is not supported (only llama)")
        self.architecture = "llama"
        self.config = self._read_config()
        self.chat_template: str | None = self._field("tokenizer.chat_template", None)
        basename = self._field("general.basename", None) or self.path.stem
        size = self._field("general.size_label", None)
        self.name = f"{basename}-{size}".lower() if size else str(basename).lower()

    def _field(self, key: str, default: object = ModelError):
        f = self.reader.fields.get(key)
        if f is None:
            if default is ModelError:
                raise ModelError(f"{self.path.name} lacks GGUF metadata {key}")
            return default
        return f.contents()

    def _read_config(self) -> ModelConfig:
        a = "llama"
        hidden = int(self._field(f"{a}.embedding_length"))
        n_heads = int(self._field(f"{a}.attention.head_count"))
        vocab = self._field(f"{a}.vocab_size", None)
        if vocab is None:
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        eos = self._field("tokenizer.ggml.eos_token_id", None)
        bos = self._field("tokenizer.ggml.bos_token_id", None)
        return ModelConfig(
            n_layers=int(self._field(f"{a}.block_count")),
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(self._field(f"{a}.attention.head_count_kv", n_heads)),
            head_dim=int(self._field(f"{a}.rope.dimension_count", hidden // n_heads)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            # GGUF stores eps as float32; round back to the value it was written from.
            rms_norm_eps=float(np.format_float_positional(
                np.float32(self._field(f"{a}.attention.layer_norm_rms_epsilon")), trim="-")),
            vocab_size=int(vocab),
            max_position=int(self._field(f"{a}.context_length")),
            tie_embeddings="output.weight" not in self._tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def _get(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name} lacks tensor {name}")
        arr = dequantize(t.data, t.tensor_type)  # numpy, rows-major: [out, in]
        return torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # a writable copy

    def layer_tensors(self, i: int) -> dict[str, torch.Tensor]:
        out = super().layer_tensors(i)
        c = self.config
        out["attention.wq.weight"] = unpermute_rope(out["attention.wq.weight"], c.n_heads)
        out["attention.wk.weight"] = unpermute_rope(out["attention.wk.weight"], c.n_kv_heads)
        return out

    def _as_shipped(self, names: dict[str, str], prefix: str, i: int | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, TensorQuant]]:
        """Tensors under our names in the GGUF's own types: a matrix's blocks repacked
        code for code (shards/ggml_blocks.py: ``<base>.qweight/.scales[/.zeros]``, or
        ``<base>.weight`` as F32/F16/BF16), other tensors as float32; with the records."""
        c = self.config
        heads = {"attention.wq.weight": c.n_heads, "attention.wk.weight": c.n_kv_heads}
        out: dict[str, torch.Tensor] = {}
        records: dict[str, TensorQuant] = {}
        for ours, theirs in names.items():
            t = self._tensors.get(theirs.format(i=i))
            if t is None:
                raise ModelError(f"{self.path.name} lacks tensor {theirs.format(i=i)}")
            if len(t.shape) < 2:
                out[ours] = self._get(t.name)
                continue
            cols, rows = (int(n) for n in t.shape[:2])  # GGUF lists [in, out]
            q, rec = repack(t.name, t.tensor_type, t.data, rows, cols)
            if ours in heads:  # rows of codes, scales and zeros move together
                q = {k: unpermute_rope(v, heads[ours]) for k, v in q.items()}
            base = ours.removesuffix(".weight")
            out |= {f"{base}.{k}": v for k, v in q.items()}
            records[prefix + base] = rec
        return out, records

    def layer_as_shipped(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, TensorQuant]]:
        return self._as_shipped(self.LAYER_NAMES, f"layers.{i}.", i)

    def embed_as_shipped(self) -> tuple[dict[str, torch.Tensor], dict[str, TensorQuant]]:
        names = dict(self.EMBED_NAMES)
        if self.config.tie_embeddings:
            del names["output.weight"]
        return self._as_shipped(names, "")

    @property
    def file_type(self) -> str:
        """The file's quantization mix as llama.cpp names it (q4_k_m, q8_0, ...)."""
        ft = self._field("general.file_type", None)
        try:
            return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").lower() if ft is not None else "gguf"
        except ValueError:
            return "gguf"

    def tokenizer_bytes(self) -> bytes:
        f = lambda k: self.reader.fields[k].contents()  # noqa: E731
        tok = tokenizer_from_gguf(f("tokenizer.ggml.tokens"), f("tokenizer.ggml.merges"),
                                   f("tokenizer.ggml.token_type"), self._field("tokenizer.ggml.model"),
                                   self._field("tokenizer.ggml.pre", "default"))
        return tok.to_str(pretty=False).encode()
