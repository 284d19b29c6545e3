"""Convert a GGUF file or a Hugging Face directory into a meshd model directory.

Every file is written to a temporary name and renamed; the manifest comes last, so a
directory with a manifest is complete, and an interrupted run leaves none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import cast

import structlog
import torch
from safetensors.torch import save
from tqdm import tqdm

from shards.errors import ModelError, ShardsError
from shards import quant
from shards.gguf_source import GGUFSource, is_gguf
from shards.hf_source import HFSource, is_hf_dir
from shards.config import ModelConfig
from shards.manifest import (EMBED_FILE, MANIFEST_FILE, TOKENIZER_FILE, FileEntry, Manifest,
                             layer_file)
from shards.layers import Block

log = structlog.get_logger()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def open_source(src: Path) -> GGUFSource | HFSource:
    src = Path(src)
    if is_gguf(src):
        return GGUFSource(src)
    if is_hf_dir(src):
        return HFSource(src)
    raise ModelError(f"{src} is neither a GGUF file nor a Hugging Face directory (config.json + *.safetensors)")


def _write_atomic(path: Path, data: bytes, resident: int | None = None) -> FileEntry:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return FileEntry(hashlib.sha256(data).hexdigest(), len(data), resident)


def _tensors_bytes(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> bytes:
    # Quantized codes and their scales/zeros are stored as made; floats in ``dtype`` (None: as they are).
    cast = lambda k, v: v if dtype is None or k.endswith((".qweight", ".scales", ".zeros")) else v.to(dtype)  # noqa: E731
    return save({k: cast(k, v).contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})


def up_to_date(out: Path, name: str, dtype: str | None, qspec: dict | None = None) -> bool:
    """A finished conversion of the same name, dtype (None: as shipped) and quantization
    whose every file checks out."""
    if not (out / MANIFEST_FILE).is_file():
        return False
    try:
        manifest = Manifest.load(out)
        have = manifest.quant or {}
        if manifest.name != name or (dtype is not None and manifest.dtype != dtype):
            return False
        if {k: have.get(k) for k in (qspec or {})} != (qspec or {}) or bool(have) != bool(qspec):
            return False
        manifest.verify(out)
    except ShardsError as e:
        log.info("convert_redo", out=str(out), reason=str(e))
        return False
    return True


AS_SHIPPED = {"kind": "gguf"}  # manifest "quant" of a GGUF converted with its own quantization


def convert(src: Path, out: Path, dtype: str | None = None, name: str | None = None,
            progress: bool = True, quantize: str | None = None, quantize_head: bool | str = False,
            group_size: int = quant.DEFAULT_GROUP) -> Path:
    """Write the model directory for ``src`` into ``out`` and return ``out``.

    A GGUF file keeps its own quantization unless ``dtype`` (float32|bfloat16|float16) asks
    for it expanded: each tensor's blocks become shard tensors code for code, recorded per
    tensor in the manifest (shards/ggml_blocks.py). A Hugging Face directory is stored in
    ``dtype`` (default float32). ``quantize`` int8|int4 requantizes the layers' linears
    weight-only (the manifest's dtype is then that kind; norms stay ``dtype``);
    ``quantize_head`` (True: the same kind, or a kind) the head too, and a tied embedding.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} not one of {sorted(DTYPES)}")
    spec = None
    if quantize:
        head_kind = quantize_head if isinstance(quantize_head, str) else None
        spec = quant.QuantSpec(quantize, group_size, head=bool(quantize_head), head_kind=head_kind)
    src, out = Path(src), Path(out)
    shipped = spec is None and dtype is None and is_gguf(src)
    dtype_name = dtype or "float32"
    qspec = spec.to_dict() if spec else (dict(AS_SHIPPED) if shipped else None)
    label = spec.kind if spec else (None if shipped else dtype_name)  # what the manifest says
    # With a name given, a finished directory is recognised without opening the source.
    if name is not None and up_to_date(out, name, label, qspec):
        log.info("convert_skipped", out=str(out), model=name)
        return out
    source = open_source(src)
    if name is None:
        name = source.name
        if up_to_date(out, name, label, qspec):
            log.info("convert_skipped", out=str(out), model=name)
            return out
    # Shipped as is only from a GGUF file (``is_gguf`` above), so then a GGUFSource.
    if shipped:
        label = cast(GGUFSource, source).file_type
    out.mkdir(parents=True, exist_ok=True)
    # Whatever manifest was there no longer describes the files about to be written.
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    log.info("convert_started", src=str(src), out=str(out), format=source.format, model=name, dtype=label)
    tdtype = None if shipped else DTYPES[dtype_name]
    cfg = source.config
    files: dict[str, FileEntry] = {}
    records: dict[str, quant.TensorQuant] = {}
    files[TOKENIZER_FILE] = _write_atomic(out / TOKENIZER_FILE, source.tokenizer_bytes())
    bar = tqdm(total=cfg.n_layers + 1, desc=f"convert {name}", unit="shard", disable=not progress)
    with bar:
        if shipped:
            embed, recs = cast(GGUFSource, source).embed_as_shipped()
        else:
            embed = source.embed_tensors()
            _check_shapes(embed, cfg, None)
            recs = {}
            if spec is not None:
                embed = quant.quantize_tensors(embed, spec, head=True)
                recs = quant.spec_records(embed, spec, "")
        records |= recs
        _check_shapes(embed, cfg, None, recs)
        lookup = "tok_embeddings" if "tok_embeddings" in recs else None
        files[EMBED_FILE] = _write_atomic(out / EMBED_FILE, _tensors_bytes(embed, tdtype),
                                          _resident(embed, recs, "", lookup))
        del embed
        bar.update(1)
        for i in range(cfg.n_layers):
            recs = {}
            if shipped:
                layer, recs = cast(GGUFSource, source).layer_as_shipped(i)
            elif spec is None:
                layer = source.layer_tensors(i)
            else:
                layer = quant.source_layer(source, i, spec)
                recs = quant.spec_records(layer, spec, f"layers.{i}.")
            records |= recs
            _check_shapes(layer, cfg, i, recs)
            files[layer_file(i)] = _write_atomic(out / layer_file(i), _tensors_bytes(layer, tdtype),
                                                 _resident(layer, recs, f"layers.{i}."))
            bar.update(1)
    if qspec is not None:
        qspec["tensors"] = {k: r.to_dict() for k, r in sorted(records.items())}
    # (label is None only until a shipped file's type is read, above)
    manifest = Manifest(name=name, architecture=source.architecture, config=cfg, dtype=cast(str, label),
                        files=files, chat_template=source.chat_template, quant=qspec,
                        special_tokens=source.special_tokens or None)
    manifest.write(out)
    log.info("convert_done", out=str(out), model=name, files=len(files),
             bytes=sum(e.size for e in files.values()), digest=manifest.digest[:12])
    return out


def _resident(tensors: dict[str, torch.Tensor], records: dict, prefix: str, lookup: str | None = None) -> int | None:
    """Bytes in memory once loaded, where that differs from the file's (quantized files)."""
    if not records:
        return None
    return quant.resident_bytes({k: tuple(v.shape) for k, v in tensors.items()}, records, prefix, lookup)


def expected_shapes(cfg: ModelConfig, layer: int | None) -> dict[str, tuple[int, ...]]:
    """Our tensors of the embed file (``layer`` None) or of a layer, with their shapes:
    those of the forward the config builds (so every family switch is covered)."""
    h = cfg.hidden_size
    if layer is None:
        shapes = {"tok_embeddings.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
        if not cfg.tie_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, h)
        return shapes
    with torch.device("meta"):
        block = Block(cfg, layer)
    return {k: tuple(v.shape) for k, v in block.state_dict().items()}


def _check_shapes(tensors: dict[str, torch.Tensor], cfg, layer: int | None,
                  records: dict[str, quant.TensorQuant] | None = None) -> None:
    want = expected_shapes(cfg, layer)
    if records:
        want = quant.stored_shapes(want, records, "" if layer is None else f"layers.{layer}.")
    if set(tensors) != set(want):
        raise ModelError(f"layer {layer}: tensors {sorted(tensors)} != expected {sorted(want)}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            where = "embed" if layer is None else f"layer {layer}"
            raise ModelError(f"{where}: {k} has shape {tuple(tensors[k].shape)}, config says {shape}")
