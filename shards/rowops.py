"""A transformer block's forward on the CPU with its small steps fused in C (shards/rowops.c).

Measured on SmolLM2-135M Q4_1, one thread: a decode step's four matmuls took about 250 us
a layer, and the ~80 torch ops around them (two norms, the casts to and from the int4
kernel's bf16, rope, the KV write, SDPA and its views, SiLU, the product, two residual
adds, eight module calls) another 240 us. Here a block is its matmuls (the same kernels,
called on inputs already in their dtype) and four C calls: norm; per new row, q/k norm,
rope, the cache write and attention; residual + norm; activation * up; and the last
residual. A segment of more than one row (a prompt's chunk) still attends through torch's
SDPA, whose fused kernel is the better one at that size.

``block`` computes what ``Block.forward`` does: the same matmul kernels on the same
inputs; the per-row arithmetic in C may differ from torch's in the last bits (sums in
another order, its own exp). Which code runs depends only on the segment (one row with a
cache, or not), never on what else is in the batch, so one node and a mesh, batched or
not, give the same floats; the family tests check it against transformers and llama.cpp.
Activations are float32 on the CPU; elsewhere ``library_for`` says None and the torch
forward runs.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shards import qblocks
from shards.qlinear import QuantLinear

SOURCE = qblocks.SOURCE.with_name("rowops.c")
_BF16 = torch.bfloat16


def library_for(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The built library where a stage on ``device`` with activations ``dtype`` can use it;
    None elsewhere, where it cannot be built, or with MESHD_ROWOPS=0 (for side-by-side runs)."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get("MESHD_ROWOPS") == "0":
        return None
    return _declared(qblocks.build(SOURCE))


@functools.cache
def _declared(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if lib is None:
        return None
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.ro_add_norm.argtypes = [i64, i64, ptr, i64, ptr, i64, i32, ptr, ptr, f32, ptr, i64, i32]
    lib.ro_act_mul.argtypes = [i64, i64, ptr, i64, i32, ptr, i64, i32, i32, ptr, i64, i32]
    lib.ro_attend.argtypes = [i64, i64, i64, ptr, i32, ptr, i32, ptr, i32, ptr, ptr, f32, ptr, ptr,
                              ptr, ptr, i64, i64, i64, f32, ptr, i32]
    for f in (lib.ro_add_norm, lib.ro_act_mul, lib.ro_attend):
        f.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"rowops {what} returned {rc}")


# -- what a block's forward needs, worked out once ---------------------------------------------

def _in_dtype(lin: nn.Module) -> torch.dtype:
    return lin.in_dtype if isinstance(lin, QuantLinear) else lin.weight.dtype


def _runner(lin: nn.Module):  # x in the linear's input dtype -> bf16 or float32 [N, out]
    return lin.raw if isinstance(lin, QuantLinear) else functools.partial(F.linear, weight=lin.weight, bias=lin.bias)


class _Linears:
    """Linears that read one normed input: the dtype the norm writes it in (bf16 when all
    take bf16, else float32, cast for those that take bf16) and each one's call."""

    def __init__(self, linears: tuple[nn.Module, ...]):
        dtypes = [_in_dtype(m) for m in linears]
        self.dtype = _BF16 if all(d == _BF16 for d in dtypes) else torch.float32
        self.casts = [None if d == self.dtype else d for d in dtypes]
        self.runs = [_runner(m) for m in linears]

    def __call__(self, x: Tensor) -> list[Tensor]:
        return [run(x if cast is None else x.to(cast)) for run, cast in zip(self.runs, self.casts)]


class _Plan:
    """A block's modules, dtypes and constants for ``block`` (the weights do not change
    after loading, so this is made on the first call)."""

    def __init__(self, b: nn.Module):
        a, f = b.attention, b.feed_forward
        self.attention_norm, self.ffn_norm = b.attention_norm, b.ffn_norm
        self.post_attention_norm, self.post_ffn_norm = b.post_attention_norm, b.post_ffn_norm
        self.qkv = _Linears((a.wqkv,) if a.wqkv is not None else (a.wq, a.wk, a.wv))
        self.wo, self.wo_dtype = _runner(a.wo), _in_dtype(a.wo)
        self.gate_up = _Linears((f.w13,) if f.w13 is not None else (f.w1, f.w3))
        self.w2, self.w2_dtype, self.inter = _runner(f.w2), _in_dtype(f.w2), f.w2.in_features
        self.gelu = int(f.act is not F.silu)
        self.attention = a
        self.nq, self.nkv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_norm, self.k_norm = a.q_norm, a.k_norm
        self.eps = a.q_norm.eps if a.q_norm is not None else 0.0
        self.scale = a.scale if a.scale is not None else a.head_dim ** -0.5


def _plan(b: nn.Module) -> _Plan:
    plan = b.__dict__.get("_rowops_plan")
    if plan is None:
        plan = b.__dict__["_rowops_plan"] = _Plan(b)
    return plan


def _ptr(t: Tensor, offset: int = 0) -> int:
    return t.data_ptr() + offset * t.element_size()


def _weight(norm: nn.Module | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


# -- one block ----------------------------------------------------------------------------

def add_norm(lib: ctypes.CDLL, x: Tensor, a: Tensor | None, post: nn.Module | None, norm: nn.Module | None,
             dtype: torch.dtype = torch.float32) -> Tensor | None:
    """x += a (normed by ``post`` first, when given), in place; then ``norm``(x) in ``dtype``
    (None when ``norm`` is None)."""
    N, H = x.shape
    out = None if norm is None else torch.empty(N, H, dtype=dtype)
    eps = (norm or post).eps if (norm or post) is not None else 0.0
    _check(lib.ro_add_norm(N, H, x.data_ptr(), x.stride(0), None if a is None else a.data_ptr(),
                           0 if a is None else a.stride(0), int(a is not None and a.dtype == _BF16),
                           _weight(post), _weight(norm), eps, None if out is None else out.data_ptr(), H,
                           int(dtype == _BF16)), "add_norm")
    return out


def block(lib: ctypes.CDLL, b: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, segments) -> Tensor:
    """``Block.forward`` of x [N, H] (float32, contiguous, updated in place and returned)."""
    pl = _plan(b)
    ys = pl.qkv(add_norm(lib, x, None, None, pl.attention_norm, pl.qkv.dtype))
    o = pl.wo(_attention(lib, pl, ys, cos, sin, segments))
    gu = pl.gate_up(add_norm(lib, x, o, pl.post_attention_norm, pl.ffn_norm, pl.gate_up.dtype))
    N, inter = x.shape[0], pl.inter
    g, u = (gu[0], gu[0][:, inter:]) if len(gu) == 1 else gu  # gate and up side by side, or apart
    p = torch.empty(N, inter, dtype=pl.w2_dtype)
    _check(lib.ro_act_mul(N, inter, g.data_ptr(), g.stride(0), int(g.dtype == _BF16), u.data_ptr(), u.stride(0),
                          int(u.dtype == _BF16), pl.gelu, p.data_ptr(), inter, int(p.dtype == _BF16)), "act_mul")
    add_norm(lib, x, pl.w2(p), pl.post_ffn_norm, None)
    return x


def _attention(lib: ctypes.CDLL, pl: _Plan, ys: list[Tensor], cos: Tensor, sin: Tensor, segments) -> Tensor:
    """The attention of each segment -> [N, nh * hd] in the dtype wo takes. ``ys``: the
    projections' outputs, q/k/v side by side in one, or one each."""
    nq, nkv, hd = pl.nq, pl.nkv, pl.hd
    if len(ys) == 1:  # (tensor, first column) of q, k and v
        parts = [(ys[0], 0), (ys[0], nq * hd), (ys[0], (nq + nkv) * hd)]
    else:
        parts = [(y, 0) for y in ys]
    N = ys[0].shape[0]
    out = torch.empty(N, nq * hd, dtype=pl.wo_dtype)
    flags = [int(t.dtype == _BF16) for t, _ in parts]
    cos, sin = cos.contiguous(), sin.contiguous()  # read as rows of hd
    off = 0
    for start, rows, cache in segments:
        if rows == 1 and cache is not None:
            first = pl.attention.first_key(start)
            cache.reserve(start, 1)
            (tq, cq), (tk, ck), (tv, cv) = parts
            _check(lib.ro_attend(nq, nkv, hd, _ptr(tq, off * tq.stride(0) + cq), flags[0],
                                 _ptr(tk, off * tk.stride(0) + ck), flags[1], _ptr(tv, off * tv.stride(0) + cv),
                                 flags[2], _weight(pl.q_norm), _weight(pl.k_norm), pl.eps, _ptr(cos, off * hd),
                                 _ptr(sin, off * hd), cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, start,
                                 first, pl.scale, _ptr(out, off * nq * hd), int(out.dtype == _BF16)), "attend")
            cache.length = start + 1
        else:  # a prompt's rows: torch's fused SDPA, as Attention.forward runs it
            sl = slice(off, off + rows)
            q, k, v = (t[sl, c:c + n * hd].float().view(rows, n, hd) for (t, c), n in zip(parts, (nq, nkv, nkv)))
            q, k, v = pl.attention.heads(torch.cat((q, k), dim=1), v, cos[sl], sin[sl])
            out[sl] = pl.attention._attend(q, k, v, start, cache).transpose(0, 1).reshape(rows, -1)
        off += rows
    return out
