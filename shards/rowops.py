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


# -- the linears, called on inputs already in their kernel's dtype --------------------------

def _in_dtype(lin: nn.Module) -> torch.dtype:
    return lin.in_dtype if isinstance(lin, QuantLinear) else lin.weight.dtype


def _run(lin: nn.Module, x: Tensor) -> Tensor:  # -> bf16 or float32 [N, out]
    if isinstance(lin, QuantLinear):
        return lin.raw(x)
    return F.linear(x, lin.weight, lin.bias)


def _inputs(t: Tensor, linears: tuple[nn.Module, ...]) -> list[Tensor]:
    """``t`` (float32, or bf16 when every linear takes bf16) in each linear's dtype."""
    return [t if _in_dtype(m) == t.dtype else t.to(_in_dtype(m)) for m in linears]


def _out_dtype(linears: tuple[nn.Module, ...]) -> torch.dtype:
    """bf16 when all take it (written rounded once, in C), else float32 (cast for the rest)."""
    return _BF16 if all(_in_dtype(m) == _BF16 for m in linears) else torch.float32


def _ptr(t: Tensor, offset: int = 0) -> int:
    return t.data_ptr() + offset * t.element_size()


# -- one block ----------------------------------------------------------------------------

def add_norm(lib: ctypes.CDLL, x: Tensor, a: Tensor | None, post: nn.Module | None, norm: nn.Module | None,
             linears: tuple[nn.Module, ...] = ()) -> list[Tensor]:
    """x += a (normed by ``post`` first, when given), in place; then ``norm``(x) in the
    dtype each of ``linears`` takes (none when ``norm`` is None)."""
    N, H = x.shape
    out = torch.empty(N, H, dtype=_out_dtype(linears)) if norm is not None else None
    eps = (norm or post).eps if (norm or post) is not None else 0.0
    _check(lib.ro_add_norm(N, H, x.data_ptr(), x.stride(0),
                           None if a is None else a.data_ptr(), 0 if a is None else a.stride(0),
                           int(a is not None and a.dtype == _BF16),
                           None if post is None else post.weight.data_ptr(),
                           None if norm is None else norm.weight.data_ptr(), eps,
                           None if out is None else out.data_ptr(), H, int(out is not None and out.dtype == _BF16)),
           "add_norm")
    return [] if out is None else _inputs(out, linears)


def block(lib: ctypes.CDLL, b: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, segments) -> Tensor:
    """``Block.forward`` of x [N, H] (float32, contiguous, updated in place and returned)."""
    a, f = b.attention, b.feed_forward
    projs = (a.wqkv,) if a.wqkv is not None else (a.wq, a.wk, a.wv)
    ys = [_run(m, n) for m, n in zip(projs, add_norm(lib, x, None, None, b.attention_norm, projs))]
    att = _attention(lib, a, ys, cos, sin, segments, _in_dtype(a.wo))
    o = _run(a.wo, att)
    ffn = (f.w13,) if f.w13 is not None else (f.w1, f.w3)
    gu = [_run(m, n) for m, n in zip(ffn, add_norm(lib, x, o, b.post_attention_norm, b.ffn_norm, ffn))]
    N, inter = x.shape[0], f.w2.in_features
    g, u = (gu[0], gu[0][:, inter:]) if len(gu) == 1 else gu  # gate and up side by side, or apart
    p = torch.empty(N, inter, dtype=_in_dtype(f.w2))
    _check(lib.ro_act_mul(N, inter, g.data_ptr(), g.stride(0), int(g.dtype == _BF16), u.data_ptr(), u.stride(0),
                          int(u.dtype == _BF16), int(f.act is not F.silu), p.data_ptr(), inter,
                          int(p.dtype == _BF16)), "act_mul")
    add_norm(lib, x, _run(f.w2, p), b.post_ffn_norm, None)
    return x


def _attention(lib: ctypes.CDLL, a: nn.Module, ys: list[Tensor], cos: Tensor, sin: Tensor, segments,
               dtype: torch.dtype) -> Tensor:
    """The attention of each segment -> [N, nh * hd] in ``dtype`` (what wo takes). ``ys``:
    the projections' outputs, q/k/v side by side in one, or one each."""
    nq, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    if len(ys) == 1:  # (tensor, first column) of q, k and v
        parts = [(ys[0], 0), (ys[0], nq * hd), (ys[0], (nq + nkv) * hd)]
    else:
        parts = [(y, 0) for y in ys]
    N = ys[0].shape[0]
    out = torch.empty(N, nq * hd, dtype=dtype)
    qn = None if a.q_norm is None else a.q_norm.weight.data_ptr()
    kn = None if a.k_norm is None else a.k_norm.weight.data_ptr()
    eps = a.q_norm.eps if a.q_norm is not None else 0.0
    scale = a.scale if a.scale is not None else hd ** -0.5
    flags = [int(t.dtype == _BF16) for t, _ in parts]
    cos, sin = cos.contiguous(), sin.contiguous()  # read as rows of hd
    off = 0
    for start, rows, cache in segments:
        if rows == 1 and cache is not None:
            first = max(0, start + 1 - a.window) if a.window is not None else 0
            cache.reserve(start, 1)
            (tq, cq), (tk, ck), (tv, cv) = parts
            _check(lib.ro_attend(nq, nkv, hd, _ptr(tq, off * tq.stride(0) + cq), flags[0],
                                 _ptr(tk, off * tk.stride(0) + ck), flags[1], _ptr(tv, off * tv.stride(0) + cv),
                                 flags[2], qn, kn, eps, _ptr(cos, off * hd), _ptr(sin, off * hd),
                                 cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, start, first, scale,
                                 _ptr(out, off * nq * hd), int(out.dtype == _BF16)), "attend")
            cache.length = start + 1
        else:  # a prompt's rows: torch's fused SDPA, as Attention.forward runs it
            sl = slice(off, off + rows)
            q, k, v = (t[sl, c:c + n * hd].float().view(rows, n, hd) for (t, c), n in zip(parts, (nq, nkv, nkv)))
            q, k, v = a.heads(torch.cat((q, k), dim=1), v, cos[sl], sin[sl])
            out[sl] = a._attend(q, k, v, start, cache).transpose(0, 1).reshape(rows, -1)
        off += rows
    return out
