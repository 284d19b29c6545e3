"""Reading a llama.cpp GGUF file: config from its metadata, tensors (dequantized, or as shipped), its vocabulary."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, LlamaFileType
from gguf.quants import dequantize

from shards.chat_templates import MAX_TEMPLATE_BYTES
from shards.config import SIZE_BOUNDS
from shards.errors import ModelError
from shards.families import GGUFMeta, for_gguf
from shards.families.base import unpermute_rope  # noqa: F401  (where tests and users found it)
from shards.ggml_blocks import repack
from shards.quant import TensorQuant
from shards.source import TensorSource
from shards.tokenizer import gguf_special_tokens, tokenizer_from_gguf

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


class FastGGUFReader(GGUFReader):
    """llama.cpp's GGUFReader, reading metadata arrays in one piece: its own reader makes
    numpy views element by element, 10-25 s for a 262k-token vocabulary (Gemma 3); this
    takes well under a second. Fields read the same through ``contents()``."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs, n = orig_offs + 12, int(alen[0])
        sub = GGUFValueType(int(itype[0]))
        nptype = self.gguf_scalar_to_np.get(sub)
        if nptype is not None:  # one part holding every element
            arr = self._get(offs, nptype, n)
            return 12 + int(arr.nbytes), [itype, alen, arr], [2], [GGUFValueType.ARRAY, sub]
        if sub != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        raw = self.data.view(np.ndarray)  # plain views: slicing a memmap costs microseconds each
        view = memoryview(raw)  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        parts: list = [itype, alen]
        for _ in range(n):
            (slen,) = struct.unpack_from("<Q", view, offs)
            parts.append(raw[offs + 8: offs + 8 + slen])
            offs += 8 + slen
        return offs - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, sub]


def _value(field) -> object:
    """A field's value as plain Python."""
    types = field.types
    if len(types) == 2 and types[0] == GGUFValueType.ARRAY and types[1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return field.contents()


class _Fields(Mapping):
    """A GGUF file's metadata as plain values, each decoded when first asked for (the
    vocabulary arrays are large)."""

    def __init__(self, reader: GGUFReader):
        self._fields = reader.fields
        self._values: dict[str, object] = {}

    def __getitem__(self, key: str):
        if key not in self._values:
            self._values[key] = _value(self._fields[key])
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


# The metadata that sizes the model, by the config field whose bound it has (shards/config.py).
_SIZED = {"context_length": "max_position", "block_count": "n_layers", "embedding_length": "hidden_size",
          "feed_forward_length": "intermediate_size", "attention.head_count": "n_heads",
          "attention.head_count_kv": "n_kv_heads", "attention.key_length": "head_dim",
          "attention.value_length": "head_dim", "vocab_size": "vocab_size"}


def check_sizes(meta: GGUFMeta) -> None:
    """Sizes in a GGUF's metadata are integers in sane ranges, its vocabulary and chat
    template of sane lengths: a ModelError naming the key otherwise, before anything is
    read or allocated by them (a 2^28 context claim converted, and serving took it at its word)."""
    for key, field in _SIZED.items():
        value = meta.get(key)
        if value is None:
            continue
        hi = SIZE_BOUNDS[field]
        if isinstance(value, list):  # per-layer counts: each one in range (the family decides if it can use them)
            bad = next((v for v in value if type(v) is not int or not 0 <= v <= hi), None)
        else:
            bad = value if type(value) is not int or not 1 <= value <= hi else None
        if bad is not None:
            raise ModelError(f"{meta.name}: GGUF metadata {meta.arch}.{key}={bad!r} is out of range "
                             f"(an integer in 1..{hi})")
    n_tokens = len(cast("Sequence[str]", meta.fields.get("tokenizer.ggml.tokens") or ()))
    if n_tokens > SIZE_BOUNDS["vocab_size"]:
        raise ModelError(f"{meta.name}: GGUF tokenizer.ggml.tokens has {n_tokens} tokens "
                         f"(at most {SIZE_BOUNDS['vocab_size']})")
    template = meta.fields.get("tokenizer.chat_template")
    if template is not None and (not isinstance(template, str) or len(template.encode()) > MAX_TEMPLATE_BYTES):
        raise ModelError(f"{meta.name}: GGUF tokenizer.chat_template is not a text of at most "
                         f"{MAX_TEMPLATE_BYTES} bytes")


class GGUFSource(TensorSource):
    format = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reader = FastGGUFReader(str(self.path))
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.fields = _Fields(self.reader)
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelError(f"{self.path.name} lacks GGUF metadata general.architecture")
        self.family = for_gguf(arch, self.path.name)
        self.architecture = self.family.name
        meta = GGUFMeta(self.fields, arch, self._get, set(self._tensors), self.path.name)
        check_sizes(meta)
        self.config = self.family.config_from_gguf(meta)
        self._check_all_used(set(self._tensors), {"rope_freqs.weight"}, self.path.name)
        self.chat_template: str | None = self.fields.get("tokenizer.chat_template")
        self.special_tokens = gguf_special_tokens(self.fields)
        basename = self.fields.get("general.basename") or self.path.stem
        size = self.fields.get("general.size_label")
        self.name = f"{basename}-{size}".lower() if size else str(basename).lower()

    def _get(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name} lacks tensor {name}")
        arr = dequantize(t.data, t.tensor_type)  # numpy, rows-major: [out, in]
        return torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # a writable copy

    def _read_as_shipped(self, layer: int | None) -> tuple[dict[str, torch.Tensor], dict[str, TensorQuant]]:
        """Our tensors of the embed file (``layer`` None) or of one layer in the GGUF's own
        types: a matrix's blocks repacked code for code (shards/ggml_blocks.py:
        ``<base>.qweight/.scales[/.zeros]``, or ``<base>.weight`` as F32/F16/BF16), other
        tensors (norms, biases) as float32; with a record per matrix.

        Read through the family's tables like ``layer_tensors``, so its row transforms apply
        to the blocks: a quantized row is self-contained (its blocks run along the input),
        so llama.cpp's Q/K row order is undone and fused tensors are cut by moving whole
        rows of codes, scales and zeros together."""
        shipped: dict[str, TensorQuant] = {}  # GGUF name -> record of what was repacked

        def get(name: str):
            t = self._tensors.get(name)
            if t is None:
                raise ModelError(f"{self.path.name} lacks tensor {name}")
            if len(t.shape) < 2:
                return self._get(name)
            cols, rows = (int(n) for n in t.shape[:2])  # GGUF lists [in, out]
            parts, shipped[name] = repack(name, t.tensor_type, t.data, rows, cols)
            return parts

        prefix = "" if layer is None else f"layers.{layer}."
        out: dict[str, torch.Tensor] = {}
        records: dict[str, TensorQuant] = {}
        for ours, w in self.family.read(self.format, get, self.config, layer).items():
            if not isinstance(w, dict):
                out[ours] = w
                continue
            base = ours.removesuffix(".weight")
            out |= {f"{base}.{k}": v for k, v in w.items()}
            records[prefix + base] = shipped[self.family.source_name(self.format, ours, layer)]
        return out, records

    def layer_as_shipped(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, TensorQuant]]:
        return self._read_as_shipped(i)

    def embed_as_shipped(self) -> tuple[dict[str, torch.Tensor], dict[str, TensorQuant]]:
        return self._read_as_shipped(None)

    @property
    def file_type(self) -> str:
        """The file's quantization mix as llama.cpp names it (q4_k_m, q8_0, ...)."""
        ft = self.fields.get("general.file_type")
        try:
            return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").lower() if ft is not None else "gguf"
        except ValueError:
            return "gguf"

    def tokenizer_bytes(self) -> bytes:
        return tokenizer_from_gguf(self.fields).to_str(pretty=False).encode()
