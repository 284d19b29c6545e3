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
import enum
import functools
import threading
from collections.abc import Callable
from typing import cast, overload

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from shards import qblocks
from shards.qlinear import QuantLinear, RowLinear

from shards.layers import AnyLinear, Block, RMSNorm

log = structlog.get_logger()

SOURCE = qblocks.SOURCE.with_name("rowops.c")
_BF16 = torch.bfloat16


_I64, _VOIDP, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Kernels(enum.Enum):
    """Which code runs a stage's blocks on the CPU (``load_stage``'s ``kernels``): the
    fastest there is by default; the others for side-by-side runs (benches, tests)."""
    WHOLE_BLOCK = "whole-block"  # a decode row's block in one C call (ro_block) where its linears allow
    ROWS = "rows"  # the small steps in C, each linear called from here (``block`` without ro_block)
    TORCH = "torch"  # Block.forward: torch ops only


class Segment(ctypes.Structure):
    """rowops.c's ro_segment: a run of a linear's output columns in one block type."""
    _fields_ = [("type", _I64), ("blocks", _VOIDP), ("first", _I64), ("rows", _I64)]


class Linear(ctypes.Structure):
    """rowops.c's ro_linear (nseg -1: not run in C)."""
    _fields_ = [("n", _I64), ("k", _I64), ("bias", _VOIDP), ("nseg", _I64), ("seg", ctypes.POINTER(Segment))]


class BlockPlan(ctypes.Structure):
    """rowops.c's ro_plan: a block as ``ro_block`` runs it (the fields are described there)."""
    _fields_ = [("H", _I64), ("nq", _I64), ("nkv", _I64), ("hd", _I64), ("inter", _I64), ("gelu", _I64),
                ("eps_attn", _F32), ("eps_mid", _F32), ("eps_last", _F32), ("eps_qk", _F32), ("scale", _F32),
                ("w_attn", _VOIDP), ("w_post_attn", _VOIDP), ("w_ffn", _VOIDP), ("w_post_ffn", _VOIDP), ("w_q", _VOIDP),
                ("w_k", _VOIDP), ("n_qkv", _I64), ("n_gate_up", _I64), ("bf_h1", _I64), ("bf_att", _I64),
                ("bf_h5", _I64), ("bf_p", _I64), ("linear", ctypes.POINTER(Linear))]


def layout() -> list[int]:
    """The sizes and field offsets of the three Structures, in ``ro_layout``'s order."""
    kinds = (BlockPlan, Linear, Segment)
    return [ctypes.sizeof(k) for k in kinds] + [getattr(k, f[0]).offset for k in kinds for f in k._fields_]


def c_layout(lib: ctypes.CDLL) -> list[int]:
    """What the built library says of its structs (``ro_layout``)."""
    out = (ctypes.c_int64 * 64)()
    n = lib.ro_layout(out, 64)
    return list(out[:n])


def library_for(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The built library where a stage on ``device`` with activations ``dtype`` can use it;
    None elsewhere, or where it cannot be built."""
    if device.type != "cpu" or dtype != torch.float32:
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
    lib.ro_attend_rows.argtypes = [i64, i32, i64, i64, i64, ptr, i64, i32, ptr, i64, i32, ptr, i64, i32, ptr, ptr,
                                   f32, ptr, ptr, ptr, ptr, i64, i64, i64, f32, ptr, i64, i32]
    lib.ro_block.argtypes = [ptr, ptr, i32, i32, i64, ptr, ptr, ptr, ptr, ptr, i32, i32, ptr, i64, i32]
    lib.ro_layout.argtypes = [ptr, i32]
    for f in (lib.ro_add_norm, lib.ro_act_mul, lib.ro_attend, lib.ro_attend_rows, lib.ro_block, lib.ro_layout):
        f.restype = ctypes.c_int
    if c_layout(lib) != layout():  # a struct changed on one side only: the step-by-step path, not wrong reads
        log.warning("rowops_unavailable", reason="rowops.c's structs and rowops.py's differ")
        return None
    return lib


# A segment of several rows (a prompt's chunk, a replay's, a speculative draft's) attends row
# by row as a decode row does (ro_attend_rows), so that a row's bits never depend on how many
# rows ran with it: exact failover, prefix cache and speculation. False (bench only): torch's
# SDPA over the segment, whose sums depend on the segment's shape.
EXACT_ROWS = True


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"rowops {what} returned {rc}")


# -- what a block's forward needs, worked out once ---------------------------------------------

def _in_dtype(lin: AnyLinear) -> torch.dtype:
    return lin.in_dtype if isinstance(lin, (QuantLinear, RowLinear)) else lin.weight.dtype


def _runner(lin: AnyLinear) -> Callable[[Tensor], Tensor]:  # x in the linear's input dtype -> bf16 or float32 [N, out]
    if isinstance(lin, QuantLinear):
        return lin.raw
    return lin if isinstance(lin, RowLinear) else functools.partial(F.linear, weight=lin.weight, bias=lin.bias)


class _Linears:
    """Linears that read one normed input: the dtype the norm writes it in (bf16 when all
    take bf16, else float32, cast for those that take bf16) and each one's call."""

    def __init__(self, linears: tuple[AnyLinear, ...]):
        dtypes = [_in_dtype(m) for m in linears]
        self.dtype = _BF16 if all(d == _BF16 for d in dtypes) else torch.float32
        self.casts = [None if d == self.dtype else d for d in dtypes]
        self.runs = [_runner(m) for m in linears]
        self.linears = linears

    def __call__(self, x: Tensor) -> list[Tensor]:
        return [run(x if cast is None else x.to(cast)) for run, cast in zip(self.runs, self.casts)]


class _Plan:
    """A block's modules, dtypes and constants for ``block`` (the weights do not change
    after loading, so this is made on the first call)."""

    def __init__(self, b: Block):
        a, f = b.attention, b.feed_forward
        self.attention_norm, self.ffn_norm = b.attention_norm, b.ffn_norm
        self.post_attention_norm, self.post_ffn_norm = b.post_attention_norm, b.post_ffn_norm
        # (the parts are there where the fused linear is not)
        self.qkv = _Linears((a.wqkv,) if a.wqkv is not None else cast("tuple[AnyLinear, ...]", (a.wq, a.wk, a.wv)))
        self.wo, self.wo_dtype = _runner(a.wo), _in_dtype(a.wo)
        self.gate_up = _Linears((f.w13,) if f.w13 is not None else cast("tuple[AnyLinear, ...]", (f.w1, f.w3)))
        self.w2, self.w2_dtype, self.inter = _runner(f.w2), _in_dtype(f.w2), f.w2.in_features
        self.gelu = int(f.act is not F.silu)
        self.attention = a
        self.nq, self.nkv, self.hd = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_norm, self.k_norm = a.q_norm, a.k_norm
        self.eps = a.q_norm.eps if a.q_norm is not None else 0.0
        self.scale = a.scale if a.scale is not None else a.head_dim ** -0.5
        self.whole = _whole_plan(self, a.wo, f.w2)


class _Whole:
    """A block's plan for rowops.c's ``ro_block`` (its steps and layout are described there):
    ``runs``, in order, ("c", first, last) for steps run in one C call and ("torch", step) for a
    linear on another kernel, run here between them. Keeps the tensors it points into."""

    def __init__(self, plan: BlockPlan, keep: list, matmul: int | None, torch_steps: set[int], sizes: tuple,
                 dtypes: tuple):
        self.plan = plan
        self.keep, self.matmul, self.sizes, self.dtypes = keep, matmul, sizes, dtypes
        self.runs: list[tuple] = []
        first = 0
        for step in range(9):
            if step in torch_steps:
                if first < step:
                    self.runs.append(("c", first, step))
                self.runs.append(("torch", step))
                first = step + 1
        if first < 9:
            self.runs.append(("c", first, 9))

    def scratch(self, n: int) -> tuple:
        """The float32 scratch of ro_block for n rows and, as the rows of the dtype the C writes
        there, its parts h, o, qkv, att, gu, p. One buffer a thread, shared by every block (a
        buffer lives only within one block's call), grown to the largest batch seen; the parts'
        views are kept by (n, sizes, dtypes) until it grows."""
        need = n * sum(self.sizes)
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < need:
            buf = _scratch.buf = torch.empty(need, dtype=torch.float32)
            _scratch.views = {}
        key = (n, self.sizes, self.dtypes)
        got = _scratch.views.get(key)
        if got is None:
            parts = buf[:need].split([n * k for k in self.sizes])
            got = _scratch.views[key] = (buf, *(_view(t, n, dt) for t, dt in zip(parts, self.dtypes)))
        return got


_scratch = threading.local()  # ro_block's buffer on this thread (_Whole.scratch)


def _eps(norm: RMSNorm | None, post: RMSNorm | None) -> float:  # add_norm's
    n = norm if norm is not None else post
    return n.eps if n is not None else 0.0


def _on_blocks(m: AnyLinear) -> bool:
    return isinstance(m, QuantLinear) and m.path == "blocks_cpu" and (m.bias is None or m.bias.dtype == torch.float32)


def _whole_plan(pl: _Plan, wo: AnyLinear, w2: AnyLinear) -> _Whole | None:
    """The plan, with the linears on the block kernel (a GGUF file's Q8_0, Q5_x, Q6_K and Q5_K)
    run in C; None where that kernel is not built or no linear runs on it."""
    lib = qblocks.library()
    norms = (pl.attention_norm, pl.post_attention_norm, pl.ffn_norm, pl.post_ffn_norm, pl.q_norm, pl.k_norm)
    slots = {1: pl.qkv.linears, 3: (wo,), 5: pl.gate_up.linears, 7: (w2,)}
    in_c = {step: all(_on_blocks(m) for m in ms) for step, ms in slots.items()}
    f32 = torch.float32  # what each slot's input is written in: its own dtype where torch runs it
    takes = {step: f32 if in_c[step] else dtype for step, dtype in
             ((1, pl.qkv.dtype), (3, pl.wo_dtype), (5, pl.gate_up.dtype), (7, pl.w2_dtype))}
    if (lib is None or not any(in_c.values())
            or any(n is not None and n.weight.dtype != torch.float32 for n in norms)
            or not (in_c[1] or in_c[5] or pl.qkv.dtype == pl.gate_up.dtype)):  # (h is one buffer)
        return None
    keep: list = []  # what the plan points into: tensors and ctypes arrays

    def ptr(t: Tensor | None) -> int:
        if t is None:
            return 0
        t = t.detach().contiguous()
        keep.append(t)
        return t.data_ptr()
    linears = []
    for step, ms in slots.items():
        for m in ms:
            segs = cast(QuantLinear, m)._segments if in_c[step] else []  # (on the block kernel: a QuantLinear)
            runs = (Segment * max(1, len(segs)))(*(Segment(qblocks.TYPES[typ][0], ptr(blocks), r0, r1 - r0)
                                                  for r0, r1, typ, blocks in segs))
            keep.append(runs)
            linears.append(Linear(m.out_features, m.in_features, ptr(m.bias) if in_c[step] else 0,
                                  len(segs) if in_c[step] else -1, runs))
    table = (Linear * len(linears))(*linears)
    keep.append(table)
    n_attn, n_post_attn, n_ffn, n_post_ffn, n_q, n_k = (ptr(None if n is None else n.weight) for n in norms)
    plan = BlockPlan(H=pl.attention_norm.weight.shape[0], nq=pl.nq, nkv=pl.nkv, hd=pl.hd, inter=pl.inter,
                     gelu=int(pl.gelu), eps_attn=_eps(pl.attention_norm, None),
                     eps_mid=_eps(pl.ffn_norm, pl.post_attention_norm), eps_last=_eps(None, pl.post_ffn_norm),
                     eps_qk=pl.eps, scale=pl.scale, w_attn=n_attn, w_post_attn=n_post_attn, w_ffn=n_ffn,
                     w_post_ffn=n_post_ffn, w_q=n_q, w_k=n_k, n_qkv=len(slots[1]), n_gate_up=len(slots[5]),
                     bf_h1=int(takes[1] == _BF16), bf_att=int(takes[3] == _BF16), bf_h5=int(takes[5] == _BF16),
                     bf_p=int(takes[7] == _BF16), linear=table)
    H = plan.H
    wqkv = (pl.nq + 2 * pl.nkv) * pl.hd
    sizes = (H, H, wqkv, pl.nq * pl.hd, 2 * pl.inter, pl.inter)  # h, o, qkv, att, gu, p
    dtypes = (takes[5] if in_c[1] else takes[1], f32, f32, takes[3], f32, takes[7])  # as sizes
    return _Whole(plan, keep, ctypes.cast(lib.qb_matmul, ctypes.c_void_p).value,
                  {step for step, c in in_c.items() if not c}, sizes, dtypes)


def _plan(b: Block) -> _Plan:
    plan = b.__dict__.get("_rowops_plan")
    if plan is None:
        plan = b.__dict__["_rowops_plan"] = _Plan(b)
    return plan


def _ptr(t: Tensor, offset: int = 0) -> int:
    return t.data_ptr() + offset * t.element_size()


def _weight(norm: RMSNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


# -- one block ----------------------------------------------------------------------------

@overload
def add_norm(lib: ctypes.CDLL, x: Tensor, a: Tensor | None, post: RMSNorm | None, norm: RMSNorm,
             dtype: torch.dtype = torch.float32) -> Tensor: ...
@overload
def add_norm(lib: ctypes.CDLL, x: Tensor, a: Tensor | None, post: RMSNorm | None, norm: None,
             dtype: torch.dtype = torch.float32) -> None: ...
def add_norm(lib: ctypes.CDLL, x: Tensor, a: Tensor | None, post: RMSNorm | None, norm: RMSNorm | None,
             dtype: torch.dtype = torch.float32) -> Tensor | None:
    """x += a (normed by ``post`` first, when given), in place; then ``norm``(x) in ``dtype``
    (None when ``norm`` is None)."""
    N, H = x.shape
    out = None if norm is None else torch.empty(N, H, dtype=dtype)
    eps = n.eps if (n := norm or post) is not None else 0.0
    _check(lib.ro_add_norm(N, H, x.data_ptr(), x.stride(0), None if a is None else a.data_ptr(),
                           0 if a is None else a.stride(0), int(a is not None and a.dtype == _BF16),
                           _weight(post), _weight(norm), eps, None if out is None else out.data_ptr(), H,
                           int(dtype == _BF16)), "add_norm")
    return out


def block(lib: ctypes.CDLL, b: Block, x: Tensor, cos: Tensor, sin: Tensor, segments, whole: bool = True) -> Tensor:
    """``Block.forward`` of x [N, H] (float32, contiguous, updated in place and returned);
    ``whole``: decode rows' blocks in one C call where the plan has one (``Kernels``)."""
    pl = _plan(b)
    if (whole and pl.whole is not None and segments and all(rows == 1 and cache is not None for _, rows, cache in segments)
            and len({id(c) for _, _, c in segments}) == len(segments)):  # (one cache twice: the error below)
        return _whole_block(lib, pl, x, cos, sin, segments)
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


def _whole_block(lib: ctypes.CDLL, pl: _Plan, x: Tensor, cos: Tensor, sin: Tensor, segments) -> Tensor:
    """``block`` for decode rows (one new position each, with a cache): its steps in C, and
    between them the linears the block kernel does not run, on inputs the C wrote in their
    dtype; the C reads what they give in place."""
    w, n = cast(_Whole, pl.whole), len(segments)  # (``block`` calls this only where there is one)
    vals: list[int] = []
    for start, _, cache in segments:
        cache.reserve(start, 1)
        vals += (cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, start, pl.attention.first_key(start))
    rows = (ctypes.c_int64 * len(vals))(*vals)
    cos, sin = cos.contiguous(), sin.contiguous()
    scratch, h, o, qkv, att, gu, p = w.scratch(n)
    ext: Tensor | None = None  # what the linear run here last gave
    for run in w.runs:
        if run[0] == "c":
            if ext is not None and ext.stride(-1) != 1:
                ext = ext.contiguous()
            e = (0, 0, 0) if ext is None else (ext.data_ptr(), ext.stride(0), int(ext.dtype == _BF16))
            _check(lib.ro_block(ctypes.addressof(w.plan), w.matmul, torch.get_num_threads(), int(qblocks.TWO_PASS), n,
                                x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, scratch.data_ptr(), *run[1:], *e),
                   "block")
            ext = None
        elif run[1] in (1, 5):
            ys = (pl.qkv if run[1] == 1 else pl.gate_up)(h)
            if len(ys) == 1:
                ext = ys[0]
            else:  # parts apart: side by side in the float32 scratch (exact)
                torch.cat(ys, dim=1, out=qkv if run[1] == 1 else gu)
        else:
            ext = (pl.wo(att) if run[1] == 3 else pl.w2(p))
    for start, _, cache in segments:
        cache.length = start + 1
    return x


def _view(t: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """Part of the float32 scratch as the [n, k] rows the C wrote there in ``dtype``."""
    k = t.numel() // n
    return t.view(n, k) if dtype == torch.float32 else t.view(dtype)[:n * k].view(n, k)


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
        elif cache is not None and EXACT_ROWS:  # a prompt's chunk, a replay, a draft: each row as alone
            cache.reserve(start, rows)
            (tq, cq), (tk, ck), (tv, cv) = parts
            window = pl.attention.window or 0
            _check(lib.ro_attend_rows(rows, torch.get_num_threads(), nq, nkv, hd,
                                      _ptr(tq, off * tq.stride(0) + cq), tq.stride(0), flags[0],
                                      _ptr(tk, off * tk.stride(0) + ck), tk.stride(0), flags[1],
                                      _ptr(tv, off * tv.stride(0) + cv), tv.stride(0), flags[2],
                                      _weight(pl.q_norm), _weight(pl.k_norm), pl.eps, _ptr(cos, off * hd),
                                      _ptr(sin, off * hd), cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity,
                                      start, window, pl.scale, _ptr(out, off * nq * hd), nq * hd,
                                      int(out.dtype == _BF16)), "attend_rows")
            cache.length = start + rows
        else:  # rows without a cache (a whole forward from 0): torch's fused SDPA, as Attention.forward runs it
            sl = slice(off, off + rows)
            q, k, v = (t[sl, c:c + n * hd].float().view(rows, n, hd) for (t, c), n in zip(parts, (nq, nkv, nkv)))
            q, k, v = pl.attention.heads(torch.cat((q, k), dim=1), v, cos[sl], sin[sl])
            out[sl] = pl.attention._attend(q, k, v, start, cache).transpose(0, 1).reshape(rows, -1)
        off += rows
    return out
