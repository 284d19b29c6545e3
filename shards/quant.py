"""Weight-only quantized linears: int8 per output channel, int4 in groups along the input.

What a shard file stores for a quantized linear ``<name>`` of shape [N, K] (out, in):

    int8  <name>.qweight  int8    [N, K]       w = qweight * scales[:, None]
          <name>.scales   float32 [N]
    int4  <name>.qweight  uint8   [N, K/2]     two codes per byte: low nibble column 2j, high 2j+1
          <name>.scales   float16 [N, K/g]     w = code * scales + zeros, code in 0..15, per group of g
          <name>.zeros    float16 [N, K/g]     (zeros is the group's minimum: llama.cpp's Q4_1 form)

That is the portable form; the device's packed layout (``_convert_weight_to_int4pack*``)
is built from it at load time by ``QuantLinear.prepare``, which checks the packed kernel
against a plain dequantized matmul on a probe and falls back to that when the kernel is
missing or disagrees. The CPU kernels are vectorised for bf16/fp16 inputs only (fp32
takes a scalar path 20-50x slower), so on CPU the matmul input is rounded to bf16 and the
output cast back: the residual stream, norms and attention keep the stage's own dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shards.errors import ModelError

log = structlog.get_logger()

KINDS = ("int8", "int4")
DEFAULT_GROUP = 32  # llama.cpp's Q4_1 block, so a Q4_1 tensor converts code for code
INT4_GROUPS = (32, 64, 128, 256)  # what the int4 packed kernels accept
SUFFIXES = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}
_CHUNK_ROWS = 4096  # the packers are row-local: pack big matrices (the head) in pieces


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How a model directory is quantized (``manifest.json`` "quant")."""

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

    def to_dict(self) -> dict:
        return {"kind": self.kind, "group_size": self.group_size, "head": self.head,
                "head_kind": self.head_as if self.head else None}

    @classmethod
    def from_dict(cls, d: Mapping) -> QuantSpec:
        return cls(kind=str(d["kind"]), group_size=d.get("group_size"), head=bool(d.get("head", False)),
                   head_kind=d.get("head_kind"))


# -- pack, quantize, dequantize -----------------------------------------------------------

def pack_int4(codes: Tensor) -> Tensor:  # [N, K] 0..15 -> uint8 [N, K/2]
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:  # uint8 [N, K/2] -> uint8 [N, K]
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize_weight(w: Tensor, kind: str, group: int | None = DEFAULT_GROUP) -> dict[str, Tensor]:
    """The tensors stored for a [N, K] weight: {"qweight", "scales"[, "zeros"]} (see module doc)."""
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
    """[N, K] in ``dtype`` from the stored tensors (rows of them work too: the embedding)."""
    if kind == "int8":
        return (t["qweight"].to(dtype) * t["scales"].to(dtype)[:, None])
    codes = unpack_int4(t["qweight"])
    N, K = codes.shape
    s = t["scales"].float()[..., None]
    z = t["zeros"].float()[..., None]
    return (codes.reshape(N, K // group, group).float() * s + z).reshape(N, K).to(dtype)


def from_q4_1(raw: np.ndarray, n_rows: int, n_cols: int) -> dict[str, Tensor]:
    """llama.cpp Q4_1 blocks [N, K/32 * 20 bytes] -> our int4 tensors, code for code.

    block_q4_1 = {half d; half m; uint8 qs[16]}: x[j] = (qs[j] & 15) * d + m and
    x[j + 16] = (qs[j] >> 4) * d + m. Our scales/zeros are its d/m as they are.
    """
    nb = n_cols // 32
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n_rows, nb, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, nb]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = torch.from_numpy(blocks[..., 4:].copy())  # [N, nb, 16]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(n_rows, n_cols)  # [N, K]
    return {"qweight": pack_int4(codes).contiguous(), "scales": torch.from_numpy(d.copy()),
            "zeros": torch.from_numpy(m.copy())}


def quantized_shapes(want: Mapping[str, tuple[int, ...]], spec: QuantSpec, head: bool) -> dict[str, tuple[int, ...]]:
    """Expected tensor shapes of a shard once its linears are stored quantized per ``spec``."""
    out: dict[str, tuple[int, ...]] = {}
    tied = "output.weight" not in want
    for name, shape in want.items():
        kind = quantize_kind(name, spec, head, tied)
        if kind is None:
            out[name] = shape
            continue
        base, (N, K), g = name.removesuffix(".weight"), shape, spec.group_for(kind)
        if kind == "int8":
            out |= {f"{base}.qweight": (N, K), f"{base}.scales": (N,)}
        else:
            out |= {f"{base}.qweight": (N, K // 2), f"{base}.scales": (N, K // g), f"{base}.zeros": (N, K // g)}
    return out


def source_layer(source, i: int, spec: QuantSpec) -> dict[str, Tensor]:
    """Layer ``i`` of a conversion source, quantized per ``spec``.

    A GGUF source's Q4_1 tensors become int4 group-32 tensors code for code (no detour
    through full precision); everything else is read dequantized and quantized here.
    """
    direct = getattr(source, "layer_tensors_q4_1", None)
    if spec.kind == "int4" and spec.group_size == 32 and direct is not None:
        tensors = direct(i)
    else:
        tensors = source.layer_tensors(i)
    return quantize_tensors(tensors, spec, head=False)


def quantize_tensors(tensors: dict[str, Tensor], spec: QuantSpec, head: bool) -> dict[str, Tensor]:
    """A shard's tensors with its linears (``head``: the embed file's matrices) quantized.

    Entries already quantized (a name ending in .qweight/.scales/.zeros, from a GGUF
    Q4_1 tensor) pass through; norms stay as they are.
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


# -- the modules ------------------------------------------------------------------------

def _aligned(t: Tensor) -> Tensor:
    """A 64-byte aligned ``t``. Found when checked (torch 2.13 CPU, AVX-512): the int8
    kernel segfaults on a weight or input that is not, as tensors read from a
    safetensors file or sliced from a larger one can be."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The matmul input dtype the packed kernels are fast (or only defined) for."""
    if dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.bfloat16  # CPU: the fp32 path is scalar; CUDA int4 takes bf16 only


class QuantLinear(nn.Module):
    """y = x W^T with W stored as int8 [N, K] or int4 [N, K/2]; forward takes [..., K]."""

    def __init__(self, in_features: int, out_features: int, kind: str, group_size: int | None = DEFAULT_GROUP,
                 device: torch.device | str | None = None, bias: bool = False):
        super().__init__()
        if kind not in KINDS:
            raise ModelError(f"quantization {kind!r} not one of {', '.join(KINDS)}")
        if kind == "int4" and (group_size not in INT4_GROUPS or in_features % group_size):
            raise ModelError(f"int4 group {group_size} does not divide input size {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.group_size = kind, (group_size if kind == "int4" else None)
        N, K = out_features, in_features
        if kind == "int8":
            self.register_buffer("qweight", torch.empty(N, K, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(N, dtype=torch.float32, device=device))
        else:
            G = K // group_size
            self.register_buffer("qweight", torch.empty(N, K // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty(N, G, dtype=torch.float16, device=device))
            self.register_buffer("zeros", torch.empty(N, G, dtype=torch.float16, device=device))
        # A float bias stays as it is (Qwen2's q, k, v projections), under the Linear's own name.
        self.bias = nn.Parameter(torch.empty(N, device=device)) if bias else None
        self.path = "unprepared"
        self._packed: Tensor | None = None  # the device's packed weight (int4) / int8 as is
        self._aux: Tensor | None = None  # int8 scales, or int4 scales_and_zeros [G, N, 2]
        self._kdtype = torch.bfloat16

    @classmethod
    def from_weight(cls, w: Tensor, kind: str, group_size: int | None = DEFAULT_GROUP,
                    bias: Tensor | None = None) -> QuantLinear:
        m = cls(w.shape[1], w.shape[0], kind, group_size, device=w.device, bias=bias is not None)
        for k, v in quantize_weight(w, kind, group_size).items():
            setattr(m, k, v.to(w.device))
        if bias is not None:
            m.bias = nn.Parameter(bias.detach().clone())
        return m

    def stored(self) -> dict[str, Tensor]:
        return {k: getattr(self, k) for k in SUFFIXES[self.kind]}

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        return dequantize_weight(self.stored(), self.kind, self.group_size, dtype)

    def extra_repr(self) -> str:
        g = f", group={self.group_size}" if self.group_size else ""
        return f"in={self.in_features}, out={self.out_features}, {self.kind}{g}, path={self.path}"

    # -- building the device layout ---------------------------------------------------

    def prepare(self, act_dtype: torch.dtype = torch.float32, keep_stored: bool = False) -> str:
        """Build the packed layout for this device, check it, and say which path runs."""
        dev = self.qweight.device
        self._kdtype = _kernel_dtype(dev, act_dtype)
        try:
            if self.kind == "int8":
                self.qweight = self._packed = _aligned(self.qweight)
                self._aux = self.scales.to(self._kdtype)
                path = "int8pack"
            else:
                self._packed, self._aux, path = self._pack_int4(dev)
            self.path = path
            if not self._kernel_agrees():
                raise ModelError("packed kernel disagrees with the dequantized matmul")
        except (RuntimeError, NotImplementedError, ModelError) as e:
            log.warning("quant_kernel_fallback", kind=self.kind, device=str(dev), reason=str(e)[:200])
            self._packed = self._aux = None
            self.path = "dense"
            return self.path
        if self.kind == "int4" and not keep_stored:
            # The packed copy is all the forward reads; drop the portable one.
            for k in SUFFIXES["int4"]:
                setattr(self, k, None)
        return self.path

    def _pack_int4(self, dev: torch.device) -> tuple[Tensor, Tensor, str]:
        scales, zeros = self.scales.float(), self.zeros.float()  # [N, G]
        # The kernels compute (code - 8) * scale + zero'; ours is code * scale + zero.
        sz = torch.stack((scales.t(), (zeros + 8 * scales).t()), dim=-1).to(self._kdtype).contiguous()  # [G, N, 2]
        rows = range(0, self.out_features, _CHUNK_ROWS)
        if dev.type == "cpu":
            pack = lambda r: torch._convert_weight_to_int4pack_for_cpu(  # noqa: E731
                unpack_int4(self.qweight[r:r + _CHUNK_ROWS]).to(torch.int32).contiguous(), 2)
            return torch.cat([pack(r) for r in rows]), sz, "int4pack_cpu"
        # CUDA / MPS: uint8 [N, K/2], high nibble first (torchao's tinygemm order).
        codes = unpack_int4(self.qweight)
        hi_first = (codes[:, 0::2] << 4 | codes[:, 1::2]).contiguous()
        return torch._convert_weight_to_int4pack(hi_first, 8), sz, "int4pack"

    def _kernel_agrees(self, rows: int = 64) -> bool:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(3, self.in_features, generator=gen).to(self.qweight.device, self._kdtype)
        got = self._kernel(x)[:, :rows].float()
        sub = {k: v[:rows] for k, v in self.stored().items()}
        want = F.linear(x.float(), dequantize_weight(sub, self.kind, self.group_size))
        return bool((got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-3)

    # -- the forward ------------------------------------------------------------------

    def _kernel(self, x: Tensor) -> Tensor:  # [M, K] in the kernel dtype
        if self.path == "int8pack":
            return torch._weight_int8pack_mm(x, self._packed, self._aux)
        if self.path == "int4pack_cpu":
            return torch._weight_int4pack_mm_for_cpu(x, self._packed, self.group_size, self._aux)
        return torch._weight_int4pack_mm(x, self._packed, self.group_size, self._aux)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._packed is None:  # no kernel here: dequantize on the fly (memory stays quantized)
            y = F.linear(x2, self.dense_weight(x.dtype))
        else:
            y = self._kernel(_aligned(x2.to(self._kdtype))).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class QuantEmbedding(nn.Module):
    """Rows of a quantized (tied) embedding matrix [V, H], dequantized on lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, kind: str, group_size: int | None = DEFAULT_GROUP,
                 device: torch.device | str | None = None):
        super().__init__()
        like = QuantLinear(embedding_dim, num_embeddings, kind, group_size, device=device)
        self.kind, self.group_size = like.kind, like.group_size
        for k, v in like.stored().items():
            self.register_buffer(k, v)
        self.out_dtype = torch.float32

    def stored(self) -> dict[str, Tensor]:
        return {k: getattr(self, k) for k in SUFFIXES[self.kind]}

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, H]
        rows = {k: v[ids] for k, v in self.stored().items()}
        return dequantize_weight(rows, self.kind, self.group_size, self.out_dtype)


# -- whole stages ---------------------------------------------------------------------------

def _swap_linears(stage: nn.Module, make) -> None:
    for block in stage.layers.values():
        for parent in block.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child))


def swap_in(stage: nn.Module, spec: QuantSpec) -> None:
    """Replace a (meta-device) Stage's linears by QuantLinears per ``spec``, before loading.

    State-dict names stay those of the shard files: ``layers.3.attention.wq.qweight``,
    ``output.qweight``, ``tok_embeddings.qweight`` (a tied, quantized head's embedding).
    """
    g = spec.group_for(spec.kind)
    _swap_linears(stage, lambda m: QuantLinear(m.in_features, m.out_features, spec.kind, g, device=m.weight.device,
                                               bias=m.bias is not None))
    if not spec.head:
        return
    kind, g, c = spec.head_as, spec.group_for(spec.head_as), stage.config
    if stage.output is not None:
        stage.output = QuantLinear(c.hidden_size, c.vocab_size, kind, g, device=stage.output.weight.device)
    if c.tie_embeddings and stage.tok_embeddings is not None:
        stage.tok_embeddings = QuantEmbedding(c.vocab_size, c.hidden_size, kind, g,
                                              device=stage.tok_embeddings.weight.device)


def prepare(stage: nn.Module, act_dtype: torch.dtype) -> dict[str, int]:
    """After loading: tie a quantized head to its embedding, build device layouts; count paths."""
    emb, out = stage.tok_embeddings, stage.output
    if isinstance(emb, QuantEmbedding):
        emb.out_dtype = act_dtype
        for k, v in emb.stored().items():
            setattr(emb, k, _aligned(v))  # (so that an int8 head can share it as is)
        if isinstance(out, QuantLinear) and stage.config.tie_embeddings:
            for k, v in emb.stored().items():  # one matrix for both (same tensors when loaded)
                setattr(out, k, v)
    paths: dict[str, int] = {}
    for m in stage.modules():
        if isinstance(m, QuantLinear) and m.path == "unprepared":
            p = m.prepare(act_dtype)
            paths[p] = paths.get(p, 0) + 1
    return paths


def quantize_stage(stage: nn.Module, spec: QuantSpec) -> dict[str, int]:
    """Quantize a loaded full-precision Stage in place (tests, bench); shards come from convert."""
    act = next(p for p in stage.parameters() if p.is_floating_point()).dtype
    g = spec.group_for(spec.kind)
    _swap_linears(stage, lambda m: QuantLinear.from_weight(m.weight, spec.kind, g, m.bias))
    if spec.head:
        kind, g, c = spec.head_as, spec.group_for(spec.head_as), stage.config
        if stage.output is not None:
            stage.output = QuantLinear.from_weight(stage.output.weight, kind, g)
        if c.tie_embeddings and stage.tok_embeddings is not None:
            w = stage.tok_embeddings.weight
            emb = QuantEmbedding(c.vocab_size, c.hidden_size, kind, g, device=w.device)
            src = stage.output.stored() if stage.output is not None else quantize_weight(w, kind, g)
            for k, v in src.items():
                setattr(emb, k, v)
            stage.tok_embeddings = emb
    return prepare(stage, act)
