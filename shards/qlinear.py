"""Quantized linears and embeddings, and the device kernels that run their layouts.

``QuantLinear`` holds one layout of shards/quant.py as loaded from a shard and, in
``prepare``, builds the device's packed form, checks it against a plain dequantized matmul
on a probe, and falls back to that matmul when the kernel is missing or disagrees:

    layout              path           kernel (CPU / CUDA)
    int4, group >= 32   int4pack[_cpu] torch._weight_int4pack_mm[_for_cpu]: one 4-bit plane
    int8 per row        int8pack       torch._weight_int8pack_mm
    int8, group 32      planes[_cpu]   the int4 kernel over two 4-bit planes: code + 128 =
                                       16 * hi + lo, K doubled ([hi | lo]) and the input
                                       fed twice ([x | x]); one call, no float copy
    int8, group 16      planes[_cpu]   the same after requantizing to groups of 32 (Q6_K)
    GGUF Q8_0, Q5_x,    blocks_cpu     shards/qblocks.c (CPU, tried first): the file's own
    Q6_K, Q5_K                         blocks, int8 dot products; none on CUDA yet
    any                 dense          dequantize this one matrix, F.linear (the fallback)

torch's int8 kernel takes one scale per row and its int4 kernels groups of 32 and up, so
llama.cpp's 8-bit and 5-bit groups (Q8_0, Q5_x) run as two 4-bit planes: 1 byte a weight
plus a bf16 (scale, zero) pair per group and plane, 10 bits a weight. On a CPU where the C
kernel builds they keep the file's own size instead (blocks_cpu, shards/qblocks.py). torchao was evaluated for this (0.18,
CPU): its int4 CPU layout calls the same aten kernel, its int8/intx weight-only paths
dequantize and matmul on CPU, and its low-bit CPU kernels are built for ARM only; it adds
nothing here. The CPU kernels are vectorised for bf16 inputs only (fp32 takes a scalar
path 20-50x slower), so the matmul input is rounded to bf16 and the output cast back: the
residual stream, norms and attention keep the stage's own dtype.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, cast

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shards import qblocks
from shards.config import ModelConfig
from shards.errors import ModelError
from shards.quant import (BLOCK_RUNS, DEFAULT_GROUP, INT4_GROUPS, SUFFIXES, QuantSpec, TensorQuant, block_bytes,
                          dequantize_weight, quantize_weight, records_of, regroup_int8, unpack_int4)

log = structlog.get_logger()

_CHUNK_ROWS = 4096  # the packers are row-local: pack big matrices (the head) in pieces
_CPU_BLOCK_N = 64  # rows per block of torch's CPU int4 layout ([N/64, K, 32] bytes)
PLANE_GROUP = 32
RESCORE = 32  # head logits recomputed exactly per row: greedy picks what float32 would


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


# Builds a packed layout on a device: (packed weight, its scales, the path it runs).
_Builder = Callable[[torch.device], tuple[Tensor | None, Tensor | None, str]]


def _record(kind: str, group: int | None, zeros: bool | None) -> TensorQuant:
    if kind == "int4":
        return TensorQuant("int4", group, True, "requantized")
    return TensorQuant(kind, group, bool(zeros), "requantized")


class QuantLinear(nn.Module):
    """y = x W^T with W in one of the stored layouts; forward takes [..., K]."""

    # The stored layout's buffers (``zeros`` where it has them), registered in __init__ and
    # read while ``prepare`` builds the packed one; it may set them None after (``stored``
    # skips those).
    qweight: Tensor
    scales: Tensor
    zeros: Tensor

    def __init__(self, in_features: int, out_features: int, kind: str | TensorQuant,
                 group_size: int | None = DEFAULT_GROUP, device: torch.device | str | None = None,
                 zeros: bool | None = None, bias: bool = False):
        super().__init__()
        rec = kind if isinstance(kind, TensorQuant) else _record(kind, group_size if kind == "int4" else None, zeros)
        if rec.layout not in ("int8", "int4"):
            raise ModelError(f"quantization {rec.layout!r} not one of int8, int4")
        if rec.group and in_features % rec.group:
            raise ModelError(f"{rec.layout} group {rec.group} does not divide input size {in_features}")
        if rec.layout == "int4" and rec.group not in INT4_GROUPS:
            raise ModelError(f"int4 group {rec.group} not one of {INT4_GROUPS}")
        self.in_features, self.out_features, self.record = in_features, out_features, rec
        self.kind, self.group_size = rec.layout, rec.group
        for k, shape in rec.stored_shapes(out_features, in_features).items():
            dt = {"qweight": torch.uint8 if rec.layout == "int4" else torch.int8}.get(k, torch.float32)
            self.register_buffer(k, torch.empty(shape, dtype=dt, device=device))
        # A float bias stays as it is (Qwen2's q, k, v projections), under the Linear's own name.
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.path = "unprepared"
        self._packed: Tensor | None = None  # the device's packed weight
        self._aux: Tensor | None = None  # int8 row scales, or scales_and_zeros [G, N, 2]
        self._kdtype = torch.bfloat16
        self._kscales: dict[str, Tensor] = {}  # scales (zeros) of the packed codes: rows read back
        self.rescore = 0  # the head: recompute its top-k logits exactly (see forward)
        self._lib: ctypes.CDLL | None = None  # blocks_cpu: the loaded C kernel library
        self._segments: list[tuple[int, int, str, Tensor]] = []  # blocks_cpu: (r0, r1, type, blocks)
        self._bound: qblocks.Bound | None = None  # blocks_cpu: the segments bound to the kernel

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
        return {k: getattr(self, k) for k in SUFFIXES if getattr(self, k, None) is not None}

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        return dequantize_weight(self.stored(), self.kind, self.group_size, dtype)

    def extra_repr(self) -> str:
        g = f", group={self.group_size}" if self.group_size else ""
        return f"in={self.in_features}, out={self.out_features}, {self.kind}{g} ({self.record.source}), path={self.path}"

    # -- building the device layout ---------------------------------------------------

    def prepare(self, act_dtype: torch.dtype = torch.float32, keep_stored: bool = False, rescore: int = 0) -> str:
        """Build the packed layout for this device, check it, and say which path runs.
        ``rescore`` (the head): keep what reading rows back from the packed layout needs."""
        dev = self.qweight.device
        for build in self._builders(dev):
            self._kdtype = _kernel_dtype(dev, act_dtype)
            try:
                self._packed, self._aux, self.path = build(dev)
                if self._kernel_agrees():
                    break
                reason = "packed kernel disagrees with the dequantized matmul"
            except (RuntimeError, NotImplementedError, ModelError) as e:
                reason = str(e)[:200]
            log.warning("quant_kernel_fallback", path=self.path, kind=self.kind, group=self.group_size,
                        source=self.record.source, device=str(dev), reason=reason)
            self._packed = self._aux = None
            self._kscales, self._segments, self._bound = {}, [], None
        else:
            self.path = "dense"
            return self.path
        self.rescore = rescore
        if not rescore:
            self._kscales = {}
        # Rows are read back from a CPU layout; elsewhere the head keeps its portable copy.
        keep_stored = keep_stored or bool(rescore and not self.path.endswith("_cpu"))
        if self.path != "int8pack" and not keep_stored:
            # The packed copy is all the forward reads; drop the portable one.
            for k in self.stored():
                setattr(self, k, None)
        return self.path

    def _builders(self, dev: torch.device) -> list[_Builder]:
        """The packed layouts to try, best first (each checked on a probe)."""
        out: list[_Builder] = []
        if dev.type == "cpu" and self.record.source in BLOCK_RUNS and qblocks.library() is not None:
            out.append(self._pack_blocks)
        out.append(self._pack_int8 if self.kind == "int8" and self.group_size is None else self._pack_planes)
        return out

    def _pack_int8(self, dev: torch.device) -> tuple[Tensor, Tensor, str]:
        self.qweight = _aligned(self.qweight)
        return self.qweight, self.scales.to(self._kdtype), "int8pack"

    def _pack_blocks(self, dev: torch.device) -> tuple[Tensor, None, str]:
        """The GGUF file's own blocks, run by shards/qblocks.c on float32 inputs."""
        self.path = "blocks_cpu"
        self._lib = qblocks.library()
        self._kdtype = torch.float32  # the kernel quantizes its input rows itself
        t, K = self.stored(), self.in_features
        # (the block layouts all have groups)
        segs = qblocks.segments(t, self.record.source, cast(int, self.group_size), _CHUNK_ROWS)
        flat = torch.empty(sum(block_bytes(typ, r1 - r0, K) for r0, r1, typ in segs), dtype=torch.uint8)
        self._segments, self._bound, off = [], None, 0
        for r0, r1, typ in segs:  # views of the one buffer, packed a chunk of rows at a time
            size = block_bytes(typ, r1 - r0, K)
            view = flat[off:off + size].view(r1 - r0, -1)
            for c0 in range(r0, r1, _CHUNK_ROWS):
                c1 = min(c0 + _CHUNK_ROWS, r1)
                view[c0 - r0:c1 - r0] = qblocks.pack({k: v[c0:c1] for k, v in t.items()}, typ)
            self._segments.append((r0, r1, typ, view))
            off += size
        return flat, None, "blocks_cpu"

    def _plane_codes(self) -> tuple[Tensor, int, Callable[[int, int], Tensor]]:
        """The kernel's scales_and_zeros [K'/g, N, 2] for ``(code - 8) * scale + zero``, its
        group g, and ``codes(r0, r1)``: 4-bit codes of rows r0..r1 [r, K'] (int32), made a
        slice at a time (the head's full int32 codes would be 4 bytes a weight, twice)."""
        group = cast(int, self.group_size)  # (the plane layouts are grouped: _builders picks them so)
        if self.kind == "int4":  # ours: code * s + z  ->  zero' = z + 8 s
            self._kscales = {"scales": self.scales, "zeros": self.zeros}
            s, z = self.scales.float(), self.zeros.float()
            sz = torch.stack((s.t(), (z + 8 * s).t()), dim=-1)
            return sz, group, lambda r0, r1: unpack_int4(self.qweight[r0:r1]).to(torch.int32)
        t = self.stored()
        if group % PLANE_GROUP:
            t = regroup_int8(t, PLANE_GROUP)  # Q6_K: 16-wide scales -> 32 (half a new step)
        self._kscales = {k: v for k, v in t.items() if k != "qweight"}
        s = t["scales"].float()
        z = t["zeros"].float() if "zeros" in t else torch.zeros_like(s)
        g = group if group % PLANE_GROUP == 0 else PLANE_GROUP
        # hi plane: (hi - 8) * 16 s + z = 16 s hi - 128 s + z; lo plane: (lo - 8) s + 8 s = s lo.
        sz = torch.cat((torch.stack((16 * s, z), -1), torch.stack((s, 8 * s), -1)), dim=1).transpose(0, 1)

        def codes(r0: int, r1: int) -> Tensor:
            u = t["qweight"][r0:r1].to(torch.int32) + 128  # 16 hi + lo
            return torch.cat((u >> 4, u & 15), dim=1)
        return sz, g, codes

    def _pack_planes(self, dev: torch.device) -> tuple[Tensor | None, Tensor, str]:
        sz, g, codes = self._plane_codes()
        self._kgroup = g
        sz = sz.to(self._kdtype).contiguous()
        name = "int4pack" if self.kind == "int4" else "planes"
        rows = [(r, min(r + _CHUNK_ROWS, self.out_features)) for r in range(0, self.out_features, _CHUNK_ROWS)]
        if dev.type == "cpu":  # rows pack independently: each chunk straight into its place
            packed = None
            for r0, r1 in rows:
                chunk = torch._convert_weight_to_int4pack_for_cpu(codes(r0, r1).contiguous(), 2)  # [r, K'/2]
                if packed is None:
                    packed = chunk.new_empty((self.out_features, *chunk.shape[1:]))
                packed[r0:r1] = chunk
                del chunk
            return packed, sz, name + "_cpu"
        # CUDA / MPS: uint8 [N, K'/2], high nibble first (torchao's tinygemm order).
        c = torch.cat([codes(*r).to(torch.uint8) for r in rows])
        hi_first = (c[:, 0::2] << 4 | c[:, 1::2]).contiguous()
        return torch._convert_weight_to_int4pack(hi_first, 8), sz, name

    def _kernel_agrees(self, rows: int = 64) -> bool:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(3, self.in_features, generator=gen).to(self.qweight.device, self._kdtype)
        # rows spread over the whole output: a fused linear's parts each get probed
        idx = torch.unique(torch.linspace(0, self.out_features - 1, rows).long()).to(self.qweight.device)
        got = self._kernel(x)[:, idx].float()
        sub = {k: v[idx] for k, v in self.stored().items()}
        want = F.linear(x.float(), dequantize_weight(sub, self.kind, self.group_size))
        # blocks_cpu rounds its input to int8 blocks (about 1e-2 of the largest output on
        # random rows, as llama.cpp); a broken kernel is off by the whole output.
        tol = 5e-2 if self.path == "blocks_cpu" else 2e-2
        return bool((got - want).abs().max() <= tol * want.abs().max() + 1e-3)

    # -- the forward ------------------------------------------------------------------

    def _kernel(self, x: Tensor) -> Tensor:  # [M, K] in the kernel dtype
        if self.path == "blocks_cpu":
            # The head rounds its input once, as llama.cpp does: its top logits are recomputed
            # exactly anyway (``rescore``), and a second rounding was a fifth of its time.
            two = qblocks.TWO_PASS and not self.rescore
            if self._bound is None or self._bound.two != two:
                self._bound = qblocks.Bound(cast(ctypes.CDLL, self._lib), self._segments, self.in_features, two)
            return self._bound(x)
        # The packed weight and its scales: a packed path has both (``forward`` checked _packed).
        packed, aux = cast(Tensor, self._packed), cast(Tensor, self._aux)
        if self.path == "int8pack":
            return torch._weight_int8pack_mm(x, packed, aux)
        if self.path.startswith("planes"):
            x = torch.cat((x, x), dim=-1)
        if self.path.endswith("_cpu"):
            return torch._weight_int4pack_mm_for_cpu(x, packed, self._kgroup, aux)
        return torch._weight_int4pack_mm(x, packed, self._kgroup, aux)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._packed is None:  # no kernel here: dequantize on the fly (memory stays quantized)
            y = F.linear(x2, self.dense_weight(x.dtype))
        else:
            y = self._kernel(_aligned(x2.to(self._kdtype))).to(x.dtype)
            if self.rescore:
                y = self._rescored(x2, y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    @property
    def in_dtype(self) -> torch.dtype:
        """The dtype ``raw`` takes: the kernel's (bf16 for torch's packed CPU kernels)."""
        return torch.float32 if self._packed is None else self._kdtype

    def raw(self, x: Tensor) -> Tensor:  # [M, K] in ``in_dtype`` -> [M, N], bf16 or float32
        """The matmul with no cast either side: the kernel's own output dtype (float32 with a
        bias). shards/rowops.py writes the input in this dtype and reads the output as is."""
        if self._packed is None:
            y = F.linear(x, self.dense_weight(x.dtype))
        else:  # (the block kernel needs no alignment: it reads its input into its own rows)
            y = self._kernel(x if self.path == "blocks_cpu" else _aligned(x))
        return y if self.bias is None else y.float() + self.bias

    def _rescored(self, x: Tensor, y: Tensor) -> Tensor:
        """The kernels round their input and output to bf16 (2^-9 of each logit), which
        flips near-tied top tokens; the head's top ``rescore`` logits of each row are
        recomputed exactly in float32 from the rows of the packed weight (a few rows)."""
        k = min(self.rescore, self.out_features)
        top = y.float().topk(k, dim=-1).indices  # [M, k]
        rows = self.rows(top.reshape(-1)).view(*top.shape, self.in_features)  # [M, k, K]
        exact = torch.einsum("mk,mjk->mj", x.float(), rows)
        return y.float().scatter(1, top, exact).to(y.dtype)

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` of the weight as the kernel holds it, float32 [T, K]."""
        if self.path == "blocks_cpu":
            ids = ids.reshape(-1)
            out = torch.empty(ids.numel(), self.in_features)
            for r0, r1, typ, b in self._segments:
                sel = (ids >= r0) & (ids < r1)
                if len(self._segments) == 1 or bool(sel.any()):
                    out[sel] = qblocks.rows(cast(ctypes.CDLL, self._lib), b, typ, ids[sel] - r0, self.in_features)
            return out
        codes = self.rows_from_packed(ids)
        if codes is None or not self._kscales:
            return dequantize_weight({k: v[ids] for k, v in self.stored().items()}, self.kind, self.group_size)
        t = {k: v[ids] for k, v in self._kscales.items()} | {"qweight": codes}
        return dequantize_weight(t, self.kind)

    def rows_from_packed(self, ids: Tensor) -> Tensor | None:
        """Codes of rows ``ids`` read back from the CPU packed layout ([N/64, K', 32] bytes:
        row 64b + j sits in byte j % 32 of block b, low nibble for j < 32), as the stored
        ``qweight`` would give them; None where there is no such layout."""
        if self.path not in ("int4pack_cpu", "planes_cpu") or self.out_features % _CPU_BLOCK_N:
            return None
        packed = cast(Tensor, self._packed)  # (these paths have it)
        kp = packed.numel() * 2 // self.out_features
        blocks = packed.view(self.out_features // _CPU_BLOCK_N, kp, _CPU_BLOCK_N // 2)
        j = ids % _CPU_BLOCK_N
        byte = blocks[ids // _CPU_BLOCK_N, :, j % 32]  # [T, K']
        codes = torch.where((j >= 32)[:, None], byte >> 4, byte & 15)
        if self.kind == "int4":
            return codes[:, 0::2] | (codes[:, 1::2] << 4)
        K = self.in_features
        return ((codes[:, :K].to(torch.int16) << 4 | codes[:, K:]) - 128).to(torch.int8)


class QuantEmbedding(nn.Module):
    """Rows of a quantized embedding matrix [V, H], dequantized on lookup. Tied to a head
    that runs a CPU packed layout, it reads its codes from that layout (one copy)."""

    qweight: Tensor | None  # a buffer (registered in __init__); None once read from the head's layout

    def __init__(self, num_embeddings: int, embedding_dim: int, kind: str | TensorQuant,
                 group_size: int | None = DEFAULT_GROUP, device: torch.device | str | None = None):
        super().__init__()
        like = QuantLinear(embedding_dim, num_embeddings, kind, group_size, device=device)
        self.record, self.kind, self.group_size = like.record, like.kind, like.group_size
        for k, v in like.stored().items():
            self.register_buffer(k, v)
        self.out_dtype = torch.float32
        self._head: QuantLinear | None = None

    def stored(self) -> dict[str, Tensor]:
        return {k: getattr(self, k) for k in SUFFIXES if getattr(self, k, None) is not None}

    def share_packed(self, head: QuantLinear) -> bool:
        """Read codes from ``head``'s packed layout and drop our own, if that gives back
        exactly our codes (checked on a probe of rows)."""
        blocks = head.path == "blocks_cpu"
        if self.qweight is None or (not blocks and head.rows_from_packed(torch.tensor([0])) is None):
            return False
        probe = torch.unique(torch.cat((torch.arange(min(130, self.qweight.shape[0])),
                                        torch.randint(0, self.qweight.shape[0], (64,),
                                                      generator=torch.Generator().manual_seed(0)))))
        if blocks:  # the head's blocks give our rows' values bit for bit: keep nothing of our own
            own = dequantize_weight({k: v[probe] for k, v in self.stored().items()}, self.kind, self.group_size)
            if not torch.equal(head.rows(probe), own):
                return False
            self._head = head
            for k in SUFFIXES:
                setattr(self, k, None)
            return True
        if not torch.equal(cast(Tensor, head.rows_from_packed(probe)), self.qweight[probe]):  # (not None: above)
            return False
        self._head, self.qweight = head, None
        return True

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, H]
        if self._head is not None and self._head.path == "blocks_cpu":
            return self._head.rows(ids).view(*ids.shape, -1).to(self.out_dtype)
        rows = {k: v[ids] for k, v in self.stored().items()}
        if self._head is not None:  # (one whose layout gave our codes back: ``share_packed``)
            rows["qweight"] = cast(Tensor, self._head.rows_from_packed(ids))
        return dequantize_weight(rows, self.kind, self.group_size, self.out_dtype)


# -- whole stages ---------------------------------------------------------------------------

# False (bench only): float linears on torch's GEMM, whose sums depend on how many rows run.
EXACT_FLOAT = True


class RowLinear(nn.Linear):
    """A float linear whose output for a row has the same bits whatever rows run beside it
    (a decode row, a batch, a prompt's chunk, a replay, a draft): on a CPU with float32
    input, qblocks.c's qb_dense; torch's elsewhere. What ``exact_floats`` makes of a stage's
    nn.Linears; its weights and state-dict names are theirs."""

    lib: ctypes.CDLL | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.lib is None or not EXACT_FLOAT or x.dtype != torch.float32 or x.device.type != "cpu":
            return super().forward(x)
        lead = x.shape[:-1]
        y = qblocks.dense(self.lib, x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*lead, self.out_features)

    @property
    def in_dtype(self) -> torch.dtype:
        return torch.float32


def exact_floats(stage: nn.Module, lib: ctypes.CDLL | None) -> int:
    """Make each float nn.Linear of a CPU stage a RowLinear (in place: parameters, ties and
    names stay); how many. Nothing where the kernel library is not built."""
    if lib is None:
        return 0
    n = 0
    for m in stage.modules():
        w = m.weight if type(m) is nn.Linear else None
        if (w is not None and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
                and w.is_contiguous() and (m.bias is None or m.bias.dtype == torch.float32)):
            m.__class__ = RowLinear  # a subclass with no state of its own: the module as loaded
            cast(RowLinear, m).lib = lib
            n += 1
    return n


class Stage(Protocol):
    """What the stage-wide functions here read and replace of a ``shards.model.Stage``
    (described here, not imported: that module imports this one)."""

    config: ModelConfig
    layers: nn.ModuleDict
    output: nn.Linear | QuantLinear | None
    tok_embeddings: nn.Embedding | QuantEmbedding | None

    @property
    def device(self) -> torch.device: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def _swap_linears(stage: Stage, make: Callable[[str, nn.Linear], nn.Module | None]) -> None:
    for i, block in stage.layers.items():
        for name, parent_child in list(block.named_modules()):
            for cname, child in list(parent_child.named_children()):
                if isinstance(child, nn.Linear):
                    full = f"{name}.{cname}" if name else cname
                    new = make(f"layers.{i}.{full}", child)
                    if new is not None:
                        setattr(parent_child, cname, new)


def swap_in(stage: Stage, records: Mapping[str, TensorQuant] | QuantSpec) -> None:
    """Replace a (meta-device) Stage's linears by QuantLinears per the manifest's records
    (a linear without one, or with a float one, stays), before loading. State-dict names
    stay those of the shard files: ``layers.3.attention.wq.qweight``, ``output.qweight``,
    ``tok_embeddings.qweight`` (a tied, quantized head's embedding)."""
    if isinstance(records, QuantSpec):
        records = records_of(records.to_dict(), stage.config)

    def make(key: str, m: nn.Linear) -> QuantLinear | None:
        rec = records.get(key)
        if rec is None or rec.layout == "float":
            return None
        return QuantLinear(m.in_features, m.out_features, rec, device=m.weight.device, bias=m.bias is not None)

    _swap_linears(stage, make)
    c = stage.config
    head_rec = records.get("tok_embeddings" if c.tie_embeddings else "output")
    if stage.output is not None and head_rec is not None and head_rec.layout != "float":
        built = cast(nn.Linear, stage.output)  # (what Stage built: swap_in runs before loading)
        stage.output = QuantLinear(c.hidden_size, c.vocab_size, head_rec, device=built.weight.device)
    emb_rec = records.get("tok_embeddings")
    if stage.tok_embeddings is not None and emb_rec is not None and emb_rec.layout != "float":
        table = cast(nn.Embedding, stage.tok_embeddings)  # (what Stage built)
        stage.tok_embeddings = QuantEmbedding(c.vocab_size, c.hidden_size, emb_rec, device=table.weight.device)


def prepare(stage: Stage, act_dtype: torch.dtype) -> dict[str, int]:
    """After loading: tie a quantized head to its embedding, build device layouts; count paths."""
    emb, out = stage.tok_embeddings, stage.output
    tied = isinstance(emb, QuantEmbedding) and isinstance(out, QuantLinear) and stage.config.tie_embeddings
    if isinstance(emb, QuantEmbedding):
        emb.out_dtype = act_dtype
        for k, v in emb.stored().items():
            setattr(emb, k, _aligned(v))  # (so that an int8 head can share it as is)
        if tied:
            for k, v in emb.stored().items():  # one matrix for both (same tensors when loaded)
                setattr(out, k, v)
    paths: dict[str, int] = {}
    for m in stage.modules():
        if isinstance(m, QuantLinear) and m.path == "unprepared":
            p = m.prepare(act_dtype, keep_stored=tied and m is out, rescore=RESCORE if m is out else 0)
            paths[p] = paths.get(p, 0) + 1
    head, table = cast(QuantLinear, out), cast(QuantEmbedding, emb)  # (what they are where tied)
    if tied and head.path not in ("int8pack", "dense") and table.share_packed(head):
        for k in SUFFIXES:  # the head reads its rows from its packed layout too
            if getattr(out, k, None) is not None:
                setattr(out, k, None)
    _trim_heap()
    log.info("quant_kernels", device=str(stage.device), **paths)  # e.g. int4pack_cpu=210 planes_cpu=1
    return paths


def held_bytes(stage: nn.Module) -> int:
    """Bytes of every tensor a stage holds, each storage once: parameters, buffers and the
    device layouts the quantized modules built (what placement's byte count estimates)."""
    seen: dict[int, int] = {}
    for m in stage.modules():
        extra: tuple[Tensor | None, ...] = ()
        if isinstance(m, QuantLinear):
            extra = (m._packed, m._aux, *m._kscales.values())
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False), *extra):
            if isinstance(t, Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _trim_heap() -> None:
    """Give the packers' freed scratch back to the OS. Found when checked: glibc raises its
    mmap threshold after the first big free, so later chunks come from the heap and stay
    in RSS when freed (a SmolLM2 load kept 280 MB more than it holds)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def quantize_stage(stage: Stage, spec: QuantSpec) -> dict[str, int]:
    """Quantize a loaded full-precision Stage in place (tests, bench); shards come from convert."""
    act = next(p for p in stage.parameters() if p.is_floating_point()).dtype
    g = spec.group_for(spec.kind)
    _swap_linears(stage, lambda _key, m: QuantLinear.from_weight(m.weight, spec.kind, g, m.bias))
    if spec.head:
        kind, g, c = spec.head_as, spec.group_for(spec.head_as), stage.config
        # (a full-precision stage: its head an nn.Linear, its embedding an nn.Embedding)
        if stage.output is not None:
            stage.output = QuantLinear.from_weight(cast(nn.Linear, stage.output).weight, kind, g)
        if c.tie_embeddings and stage.tok_embeddings is not None:
            w = cast(nn.Embedding, stage.tok_embeddings).weight
            emb = QuantEmbedding(c.vocab_size, c.hidden_size, kind, g, device=w.device)
            src = stage.output.stored() if stage.output is not None else quantize_weight(w, kind, g)
            for k, v in src.items():
                setattr(emb, k, v)
            stage.tok_embeddings = emb
    return prepare(stage, act)
