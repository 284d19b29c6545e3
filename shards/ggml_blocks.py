"""One GGUF tensor's raw blocks -> shard tensors, code for code.

What the GGUF source calls per tensor (``repack``). Each llama.cpp block type becomes one
of the portable layouts of shards/quant.py without a detour through full precision:

    type   block (weights, bytes)   stored as                         w =
    Q4_0   32, 18   d, qs[16]        int4  g32  scales=d    zeros=-8d  (fp16)   code*scale + zero
    Q4_1   32, 20   d, m, qs[16]     int4  g32  scales=d    zeros=m    (fp16)
    Q4_K   256, 144 d, dmin, 12 B of 6-bit (sc, m) x 8, qs[128]
                                     int4  g32  scales=d*sc zeros=-dmin*m (fp32)
    Q8_0   32, 34   d, qs[32]        int8  g32  scales=d               (fp16)   code*scale [+ zero]
    Q5_0   32, 22   d, qh[4], qs[16] int8  g32  code=q-16, scales=d    (fp16)
    Q5_1   32, 24   d, m, qh, qs     int8  g32  code=q, scales=d, zeros=m (fp16)
    Q5_K   256, 176 d, dmin, scales, qh[32], qs[128]
                                     int8  g32  code=q, scales=d*sc, zeros=-dmin*m (fp32)
    Q6_K   256, 210 ql[128], qh[64], sc int8[16], d
                                     int8  g16  code=q-32, scales=d*sc (fp32)
    F32/F16/BF16                     kept as they are (``float``)

The products d*sc and dmin*m of the K-quants are exact in float32 (11 + 6 or 8 bits), not in
float16, so those scales are stored fp32. Every layout dequantizes to exactly the float32
values ``gguf.quants.dequantize`` gives for the same blocks (tests/test_gguf_quant.py).
Other types (IQ*, TQ*, MXFP4, Q2_K, Q3_K, ...) are refused by name; ``--dtype`` expands them.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from shards.errors import ModelError
from shards.quant import TensorQuant, pack_int4

QK = 256  # K-quant super-block

# type -> (weights per block, bytes per block)
BLOCKS = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q5_1: (32, 24), T.Q8_0: (32, 34),
          T.Q4_K: (QK, 144), T.Q5_K: (QK, 176), T.Q6_K: (QK, 210)}
FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SUPPORTED = tuple(t.name for t in (*FLOATS, *BLOCKS))


def repack(name: str, qtype: T | int, raw: np.ndarray, rows: int, cols: int
           ) -> tuple[dict[str, torch.Tensor], TensorQuant]:
    """Tensor ``name`` [rows, cols] of GGUF type ``qtype`` as {"weight"} (floats) or
    {"qweight", "scales"[, "zeros"]}, with the record the manifest keeps for it."""
    qtype = T(qtype)
    if qtype in FLOATS:
        w = _float(raw, qtype).reshape(rows, cols)
        return {"weight": w}, TensorQuant("float", None, False, qtype.name)
    if qtype not in BLOCKS:
        raise ModelError(f"tensor {name}: GGUF type {qtype.name} cannot be kept as shipped "
                         f"(kept: {', '.join(SUPPORTED)}); convert with --dtype float32 (or bfloat16) "
                         f"to expand it to floats")
    per, size = BLOCKS[qtype]
    if cols % per:
        raise ModelError(f"tensor {name}: {cols} columns are not whole {qtype.name} blocks of {per}")
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // per, size)
    t = _REPACK[qtype](b)
    layout = "int4" if t["qweight"].dtype == torch.uint8 else "int8"
    if layout == "int4":
        t["qweight"] = pack_int4(t["qweight"].reshape(rows, cols))
    else:
        t["qweight"] = t["qweight"].reshape(rows, cols)
    group = cols // (t["scales"].numel() // rows)
    t["scales"] = t["scales"].reshape(rows, cols // group)
    if "zeros" in t:
        t["zeros"] = t["zeros"].reshape(rows, cols // group)
    t = {k: v.contiguous() for k, v in t.items()}
    return t, TensorQuant(layout, group, "zeros" in t, qtype.name)


def _float(raw: np.ndarray, qtype: T) -> torch.Tensor:
    a = np.ascontiguousarray(raw)
    if qtype == T.BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.view(np.float16 if qtype == T.F16 else np.float32).copy())


# -- block decoders: b is uint8 [rows, blocks, bytes]; codes come out in weight order --------

def _f16(b: np.ndarray, at: int) -> torch.Tensor:  # [rows, blocks] float16 at byte offset ``at``
    return torch.from_numpy(b[..., at:at + 2].copy().view(np.float16)[..., 0].copy())


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """qs [..., 16] -> codes [..., 32]: low nibbles are weights 0..15, high ones 16..31."""
    q = torch.from_numpy(qs.copy())
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def _high_bits(qh: np.ndarray) -> torch.Tensor:
    """qh [..., 4] (a little-endian uint32) -> bit j of it for weight j, [..., 32] uint8."""
    bits = torch.from_numpy(qh.copy()).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)
    return (bits & 1).reshape(*qh.shape[:-1], 32)


def _q4_0(b):
    d = _f16(b, 0)
    return {"qweight": _nibbles(b[..., 2:18]), "scales": d, "zeros": d * -8}


def _q4_1(b):
    return {"qweight": _nibbles(b[..., 4:20]), "scales": _f16(b, 0), "zeros": _f16(b, 2)}


def _q5_0(b):
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
    return {"qweight": q.to(torch.int8) - 16, "scales": _f16(b, 0)}


def _q5_1(b):
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
    return {"qweight": q.to(torch.int8), "scales": _f16(b, 0), "zeros": _f16(b, 2)}


def _q8_0(b):
    return {"qweight": torch.from_numpy(b[..., 2:].copy().view(np.int8)), "scales": _f16(b, 0)}


def _k_scales(s: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins (llama.cpp's get_scale_min_k4)."""
    t = torch.from_numpy(s.copy())
    lo, hi, mix = t[..., 0:4], t[..., 4:8], t[..., 8:12]
    sc = torch.cat((lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)), dim=-1)
    mn = torch.cat((hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_affine(b) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: per 32 weights scale d*sc and zero -(dmin*m), both exact in fp32."""
    d, dmin = _f16(b, 0).float(), _f16(b, 2).float()
    sc, mn = _k_scales(b[..., 4:16])
    return d[..., None] * sc.float(), -(dmin[..., None] * mn.float())  # [rows, blocks, 8]


def _k_low(qs: np.ndarray) -> torch.Tensor:
    """qs [..., 128] -> 4-bit codes [..., 256]: chunk c of 32 bytes holds sub-blocks 2c (low
    nibbles) and 2c+1 (high nibbles)."""
    q = torch.from_numpy(qs.copy()).unflatten(-1, (4, 32))
    return torch.stack((q & 0x0F, q >> 4), dim=-2).flatten(-3)


def _q4_k(b):
    scales, zeros = _k_affine(b)
    return {"qweight": _k_low(b[..., 16:144]), "scales": scales, "zeros": zeros}


def _q5_k(b):
    scales, zeros = _k_affine(b)
    qh = torch.from_numpy(b[..., 16:48].copy())  # bit i of byte l: weight l of sub-block i
    high = ((qh.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1).flatten(-2)
    q = _k_low(b[..., 48:176]) | (high << 4)
    return {"qweight": q.to(torch.int8), "scales": scales, "zeros": zeros}


def _q6_k(b):
    ql = torch.from_numpy(b[..., 0:128].copy()).unflatten(-1, (2, 64))  # two halves of 128 weights
    qh = torch.from_numpy(b[..., 128:192].copy()).unflatten(-1, (2, 32))
    low = torch.stack((ql & 0x0F, ql >> 4), dim=-2).flatten(-2)  # [.., 2, 128]
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).flatten(-2)  # [.., 2, 128]
    q = (low | (high << 4)).flatten(-2).to(torch.int8) - 32  # [.., 256]
    sc = torch.from_numpy(b[..., 192:208].copy().view(np.int8)).float()
    d = _f16(b, 208).float()
    return {"qweight": q, "scales": d[..., None] * sc}  # scales per 16 weights


_REPACK = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
           T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
