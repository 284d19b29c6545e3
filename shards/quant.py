"""Weight-only quantized tensors: the portable layouts a shard file stores, one record per tensor.

What a shard file stores for a quantized linear ``<name>`` of shape [N, K] (out, in):

    int4  <name>.qweight  uint8 [N, K/2]   two codes per byte: low nibble column 2j, high 2j+1
          <name>.scales   [N, K/g]         w = code * scale + zero, code 0..15, per group of g
          <name>.zeros    [N, K/g]
    int8  <name>.qweight  int8  [N, K]     w = code * scale [+ zero]
          <name>.scales   [N] (one per output row) or [N, K/g] (per group of g)
          <name>.zeros    [N, K/g]         (only where the source had an offset)

Scales and zeros are float16 where the source's are (GGUF Q4_0/Q4_1/Q5_x/Q8_0, our own
int4), float32 where only float32 holds them exactly (the K-quants' d*sc and dmin*m, our
per-row int8). A GGUF tensor becomes one of these code for code (shards/ggml_blocks.py);
a float model is requantized into int8 per row or int4 groups (``quantize_weight``).

Each linear's layout is a ``TensorQuant`` record in the manifest ("quant" -> "tensors",
keyed by state-dict base name: ``layers.3.attention.wq``, ``output``, ``tok_embeddings``),
so that a loader builds the right modules before it reads a byte. The modules and the
device kernels that run these layouts are in shards/qlinear.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor

from shards.errors import ModelError

KINDS = ("int8", "int4")
LAYOUTS = ("int8", "int4", "float")
DEFAULT_GROUP = 32  # llama.cpp's block, so Q4_x/Q5_x/Q8_0 tensors convert code for code
INT4_GROUPS = (32, 64, 128, 256)  # what the int4 packed kernels accept
SUFFIXES = ("qweight", "scales", "zeros")
_KERNEL_SZ_BYTES = 4  # a bf16 (scale, zero) pair per group in the packed kernels' layout


@dataclass(frozen=True, slots=True)
class TensorQuant:
    """How one linear's weight is stored (a manifest record)."""

    layout: str  # int4 | int8 | float (kept as shipped: F32/F16/BF16)
    group: int | None  # input columns per scale; None: one scale per output row (int8)
    zeros: bool  # an offset per group
    source: str  # the GGUF type it came from (Q4_K, ...), or "requantized"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ModelError(f"tensor layout {self.layout!r} not one of {', '.join(LAYOUTS)}")
        if self.layout == "int4" and (not self.group or not self.zeros):
            raise ModelError("int4 tensors have a scale and a zero per group")

    def to_dict(self) -> dict:
        return {"layout": self.layout, "group": self.group, "zeros": self.zeros, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping) -> TensorQuant:
        try:
            group = d.get("group")
            return cls(str(d["layout"]), None if group is None else int(group), bool(d["zeros"]), str(d["source"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"malformed tensor quantization record {dict(d)!r}: {e!r}") from None

    def stored_shapes(self, N: int, K: int) -> dict[str, tuple[int, ...]]:
        if self.layout == "float":
            return {"weight": (N, K)}
        if self.group and K % self.group:
            raise ModelError(f"group {self.group} does not divide the input size {K}")
        shapes: dict[str, tuple[int, ...]] = {"qweight": (N, K // 2) if self.layout == "int4" else (N, K),
                                              "scales": (N, K // self.group) if self.group else (N,)}
        if self.zeros:
            if self.group is None:
                raise ModelError("a tensor with zeros has one per group, but no group")
            shapes["zeros"] = (N, K // self.group)
        return shapes


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """A requested requantization (``meshd model convert --quantize``; manifest "quant")."""

    kind: str  # int8 | int4: the layers' linears
    group_size: int | None = DEFAULT_GROUP  # int4 only; int8 is per output channel
    head: bool = False  # the head (the embedding too, when tied) is quantized
    head_kind: str | None = None  # defaults to ``kind``

    def __post_init__(self) -> None:
        for k in (self.kind, self.head_kind or self.kind):
            if k not in KINDS:
                raise ModelError(f"quantization {k!r} not one of {', '.join(KINDS)}")
        if self.kind == "int8" and self.head_kind in (None, "int8"):
            object.__setattr__(self, "group_size", None)
        elif self.group_size not in INT4_GROUPS:
            raise ModelError(f"int4 group size {self.group_size} not one of {INT4_GROUPS}")

    def group_for(self, kind: str) -> int | None:
        return None if kind == "int8" else (self.group_size or DEFAULT_GROUP)

    @property
    def head_as(self) -> str:
        return self.head_kind or self.kind

    def record(self, kind: str) -> TensorQuant:
        return TensorQuant(kind, self.group_for(kind), kind == "int4", "requantized")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "group_size": self.group_size, "head": self.head,
                "head_kind": self.head_as if self.head else None}

    @classmethod
    def from_dict(cls, d: Mapping) -> QuantSpec:
        return cls(kind=str(d["kind"]), group_size=d.get("group_size"), head=bool(d.get("head", False)),
                   head_kind=d.get("head_kind"))


# -- records of a whole model -------------------------------------------------------------

LINEAR_SUFFIX = ".weight"


def records_of(quant: Mapping | None, config) -> dict[str, TensorQuant]:
    """The per-tensor records of a manifest's "quant" (older manifests: derived from the spec)."""
    if not quant:
        return {}
    if "tensors" in quant:
        return {str(k): TensorQuant.from_dict(v) for k, v in quant["tensors"].items()}
    spec = QuantSpec.from_dict(quant)
    out: dict[str, TensorQuant] = {}
    for i in range(config.n_layers):
        for base in LINEAR_BASES:
            out[f"layers.{i}.{base}"] = spec.record(spec.kind)
    if spec.head:
        out["tok_embeddings" if config.tie_embeddings else "output"] = spec.record(spec.head_as)
    return out


# The linears of a layer (state-dict names under ``layers.N.``); the families issue owns
# the tables these come from, this is only the set a record may name.
LINEAR_BASES = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def stored_shapes(want: Mapping[str, tuple[int, ...]], records: Mapping[str, TensorQuant],
                  prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Expected tensor shapes of a shard file whose linears are stored per ``records``
    (keyed ``prefix + base``); names without a record keep their float shape."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in want.items():
        base = name.removesuffix(LINEAR_SUFFIX)
        rec = records.get(prefix + base) if name.endswith(LINEAR_SUFFIX) else None
        if rec is None:
            out[name] = shape
            continue
        N, K = shape
        out |= {f"{base}.{k}": s for k, s in rec.stored_shapes(N, K).items()}
    return out


# GGUF block types as llama.cpp stores them: (weights, bytes) a block. A CPU keeps those in
# BLOCK_RUNS in these bytes and runs them with the C kernel of shards/qblocks.py: the file's
# own scales exactly, and a row's output the same bits whatever rows run beside it (torch's
# int4 kernel rounds group scales to bf16, and its sums depend on how many rows it is given:
# a replay then continued differently from the stream it replaced, issue 34).
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q6_K": (256, 210),
               "Q5_K": (256, 176), "Q4_K": (256, 144), "Q4_0": (32, 18), "Q4_1": (32, 20)}
BLOCK_RUNS = ("Q8_0", "Q5_0", "Q5_1", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q4_1")
INT4_BLOCKS = ("Q4_0", "Q4_1", "Q4_K")  # stored as the int4 layout (packed codes)


def block_bytes(source: str, n: int, k: int) -> int:
    """Bytes of an [n, k] tensor of GGUF type ``source`` in its blocks."""
    per, size = GGUF_BLOCKS[source]
    return n * (k // per) * size


def resident_bytes(shapes: Mapping[str, tuple[int, ...]], records: Mapping[str, TensorQuant],
                   prefix: str = "", lookup: str | None = None) -> int:
    """Bytes a shard file's tensors take once loaded on a CPU with float32 activations:
    floats at 4 bytes, quantized linears in their kernel layout (shards/qlinear.py): int4
    codes plus a bf16 (scale, zero) per group, int8 groups as two 4-bit planes with one
    pair per group of 32 each, int8 rows with a bf16 scale each; GGUF types the C block
    kernel runs (shards/qblocks.py) at their own block size, as on a CPU where it builds.
    ``lookup`` names the base of an embedding that also keeps its own scales (and zeros) to
    gather rows (not with the block kernel: its rows are read from the head's blocks)."""
    total = 0
    for name, shape in shapes.items():
        base = name.rsplit(".", 1)[0]
        rec = records.get(prefix + base)
        n = int(np.prod(shape))
        if rec is None or rec.layout == "float":
            total += 4 * n
        elif name.endswith(".qweight"):
            N, K = shape[0], shape[1] * (2 if rec.layout == "int4" else 1)
            if rec.source in BLOCK_RUNS:
                total += block_bytes(rec.source, N, K)
            elif rec.layout == "int4":  # (always grouped: TensorQuant checks)
                total += N * K // 2 + N * (K // cast(int, rec.group)) * _KERNEL_SZ_BYTES
            elif rec.group is None:
                total += N * K + 2 * N
            else:
                total += N * K + 2 * N * (K // 32) * _KERNEL_SZ_BYTES
        elif base == lookup and rec.source not in BLOCK_RUNS:  # scales / zeros a gathered embedding row is dequantized with
            total += n * (2 if rec.source in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else 4)
    return total


# -- pack, quantize, dequantize -----------------------------------------------------------

def pack_int4(codes: Tensor) -> Tensor:  # [N, K] 0..15 -> uint8 [N, K/2]
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:  # uint8 [N, K/2] -> uint8 [N, K]
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize_weight(w: Tensor, kind: str, group: int | None = DEFAULT_GROUP) -> dict[str, Tensor]:
    """The tensors stored for a [N, K] float weight requantized: {"qweight", "scales"[, "zeros"]}."""
    if w.dim() != 2:
        raise ModelError(f"only 2-D weights quantize, got shape {tuple(w.shape)}")
    w = w.detach().float()
    N, K = w.shape
    if kind == "int8":  # symmetric, one scale per output channel
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return {"qweight": q.contiguous(), "scales": scales.contiguous()}
    if kind != "int4":
        raise ModelError(f"quantization {kind!r} not one of {', '.join(KINDS)}")
    if group not in INT4_GROUPS or K % group:
        raise ModelError(f"int4 group {group} does not divide the input size {K} (or is not one of {INT4_GROUPS})")
    wg = w.reshape(N, K // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, G]
    if max(lo.abs().max().item(), hi.abs().max().item()) > 6e4:
        raise ModelError("weights exceed the float16 range of int4 scales")
    scales = ((hi - lo) / 15.0).clamp(min=1e-8).half()
    zeros = lo.half()
    # Codes from the float16 scales actually stored, so rounding is to the stored grid.
    q = torch.round((wg - zeros.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return {"qweight": pack_int4(q.reshape(N, K)).contiguous(), "scales": scales.contiguous(),
            "zeros": zeros.contiguous()}


def dequantize_weight(t: Mapping[str, Tensor], kind: str, group: int | None = DEFAULT_GROUP,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """[N, K] in ``dtype`` from the stored tensors (rows of them work too: the embedding).

    float32 arithmetic in the order llama.cpp's reference dequantization uses
    (code * scale, then + zero), so a GGUF tensor comes back bit for bit."""
    codes = unpack_int4(t["qweight"]) if kind == "int4" else t["qweight"]
    s = t["scales"].float()
    if s.dim() == 1:  # int8, one scale per row
        return (codes.float() * s[:, None]).to(dtype)
    N, K = codes.shape
    g = K // s.shape[1]
    w = codes.reshape(N, K // g, g).float() * s[..., None]
    if t.get("zeros") is not None:
        w = w + t["zeros"].float()[..., None]
    return w.reshape(N, K).to(dtype)


def regroup_int8(t: Mapping[str, Tensor], group: int = 32) -> dict[str, Tensor]:
    """Requantize int8 codes to ``group``-wide symmetric groups with float32 scales (Q6_K's
    16-wide scales for kernels that take 32 and up): error at most half a new step."""
    w = dequantize_weight(t, "int8")
    N, K = w.shape
    wg = w.reshape(N, K // group, group)
    scales = (wg.abs().amax(-1) / 127.0).clamp(min=1e-30)
    q = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(N, K)
    return {"qweight": q, "scales": scales}


# -- conversion -----------------------------------------------------------------------------

def source_layer(source, i: int, spec: QuantSpec) -> dict[str, Tensor]:
    """Layer ``i`` of a conversion source requantized per ``spec``.

    A GGUF source's tensors that are already int4 in ``spec``'s group (Q4_0, Q4_1, Q4_K at
    group 32) are kept code for code; everything else is dequantized and quantized here.
    """
    shipped = getattr(source, "layer_as_shipped", None)
    if spec.kind != "int4" or shipped is None:
        return quantize_tensors(source.layer_tensors(i), spec, head=False)
    tensors, records = shipped(i)
    out: dict[str, Tensor] = {}
    for base_name, rec in records.items():
        base = base_name.removeprefix(f"layers.{i}.")
        part = {k: tensors.pop(f"{base}.{k}") for k in (*SUFFIXES, "weight") if f"{base}.{k}" in tensors}
        if rec.layout == "int4" and rec.group == spec.group_size:
            out |= {f"{base}.{k}": v for k, v in part.items()}
            continue
        w = part["weight"].float() if rec.layout == "float" else dequantize_weight(part, rec.layout)
        out |= {f"{base}.{k}": v for k, v in quantize_weight(w, "int4", spec.group_size).items()}
    return out | quantize_tensors(tensors, spec, head=False)


def quantize_tensors(tensors: dict[str, Tensor], spec: QuantSpec, head: bool) -> dict[str, Tensor]:
    """A shard's tensors with its linears (``head``: the embed file's matrices) quantized.

    Entries already quantized (a name ending in .qweight/.scales/.zeros) pass through;
    norms stay as they are.
    """
    out: dict[str, Tensor] = {}
    tied = not any(n.startswith("output.") for n in tensors)
    for name, t in tensors.items():
        kind = quantize_kind(name, spec, head, tied)
        if kind is None:
            out[name] = t
            continue
        base = name.removesuffix(".weight")
        out |= {f"{base}.{k}": v for k, v in quantize_weight(t, kind, spec.group_for(kind)).items()}
    return out


def spec_records(tensors: Mapping[str, Tensor], spec: QuantSpec, prefix: str) -> dict[str, TensorQuant]:
    """Records of the linears ``quantize_tensors`` / ``source_layer`` stored in a file."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            kind = "int4" if t.dtype == torch.uint8 else "int8"
            out[prefix + base] = spec.record(kind)
    return out


def quantize_kind(name: str, spec: QuantSpec, head: bool, tied: bool = False) -> str | None:
    """The kind a stored tensor of that name is quantized to, or None (kept as is).

    In the embed file only the head is: ``output.weight``, or the embedding when ``tied``
    (an untied embedding is only ever gathered from, so it stays in full precision).
    """
    if not name.endswith(".weight") or "norm" in name.split(".")[-2]:
        return None
    if head:
        wanted = "tok_embeddings.weight" if tied else "output.weight"
        return spec.head_as if spec.head and name == wanted else None
    return spec.kind

