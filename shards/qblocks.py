"""GGUF blocks kept at their own size on the CPU, and the C kernel that runs them.

torch's packed CPU kernels take 4-bit codes only (and 8-bit with one scale a row), so a
Q6_K, Q8_0 or Q5_x weight ran as two 4-bit planes: 10 bits a weight where the file
spends 5.5-8.5. No library does better for torch on x86 (torchao 0.18 was evaluated: its
int4 CPU layout calls the same aten kernel, its int8/intx paths dequantize, its low-bit
kernels are for ARM), so shards/qblocks.c does what llama.cpp's CPU backend does: the
weight stays in llama.cpp's own block bytes and each input row is quantized to int8
blocks of 32 once per call, then integer dot products (AVX2, AVX512-VNNI where there is
one, plain C otherwise).

The C source is built at first use with the system compiler (``$CC``, default ``cc``)
into a cache keyed by the source, the command and the CPU (``$MESHD_KERNEL_CACHE``, else
``$MESHD_STATE_DIR/kernels``, else ``~/.cache/meshd/kernels``), written to a temporary
name and renamed so that concurrent processes never load half a file. Without a
compiler ``library()`` is None and the quantized linears keep their other paths
(shards/qlinear.py).

``pack`` rebuilds the blocks from the portable layout a shard file stores
(shards/quant.py): codes, and the scales the file's blocks had. The K-quants store
products d * sc (Q6_K, Q5_K), which ``_split`` factors back into an fp16 d and small
integers exactly, or refuses.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import structlog
import torch
from torch import Tensor

from shards.errors import ModelError
from shards.quant import GGUF_BLOCKS, INT4_BLOCKS, unpack_int4

log = structlog.get_logger()

SOURCE = Path(__file__).with_name("qblocks.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")
# GGUF type name -> (ggml type id, weights per block, bytes per block): what pack() and the
# kernel take (the sizes are shards/quant.py's GGUF_BLOCKS).
_GGML_IDS = {"Q8_0": 8, "Q5_0": 6, "Q5_1": 7, "Q6_K": 14, "Q5_K": 13, "Q4_K": 12, "Q4_0": 2, "Q4_1": 3}
TYPES = {name: (_GGML_IDS[name], *GGUF_BLOCKS[name]) for name in GGUF_BLOCKS}
TWO_PASS = True


# -- building and loading the library ---------------------------------------------------------

def cache_dir() -> Path:
    """Where built kernels are kept (the module's docstring says how it is chosen)."""
    if d := os.environ.get("MESHD_KERNEL_CACHE"):
        return Path(d)
    if d := os.environ.get("MESHD_STATE_DIR"):
        return Path(d) / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshd" / "kernels"


def library() -> ctypes.CDLL | None:
    """The built kernel library, or None where it cannot be built or loaded here."""
    return _load(os.environ.get("CC") or "cc", str(cache_dir()))


def _cpu_id() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()


def build(source: Path) -> ctypes.CDLL | None:
    """``source`` (a C file of shards/) compiled with FLAGS and loaded, from the cache when
    built before; None where it cannot be built or loaded here (said once in the log)."""
    return _build(os.environ.get("CC") or "cc", str(cache_dir()), str(source))


@functools.cache
def _build(cc: str, cache: str, source: str) -> ctypes.CDLL | None:
    cmd = [*shlex.split(cc), *FLAGS]
    src = Path(source).read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(cmd).encode(), platform.machine().encode(), _cpu_id()]))
    stem = Path(source).stem
    path = Path(cache) / f"{stem}-{key.hexdigest()[:20]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{stem}-", suffix=".so")
            os.close(fd)
            try:
                subprocess.run([*cmd, source, "-o", tmp], check=True, capture_output=True, timeout=300)
                os.replace(tmp, path)  # atomic: another process sees no file or a whole one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", None) or b""
        log.warning(f"{stem}_unavailable", cc=cc, reason=(str(e) + " " + err.decode(errors="replace"))[:300])
        return None


@functools.cache
def _load(cc: str, cache: str) -> ctypes.CDLL | None:
    lib = _build(cc, cache, str(SOURCE))
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qb_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.qb_rows.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr]
    lib.qb_quantize.argtypes = [ptr, i64, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr]
    lib.qb_dense.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, i64, ptr, ptr, i64, ctypes.c_int]
    for f in (lib.qb_matmul, lib.qb_rows, lib.qb_simd, lib.qb_quantize, lib.qb_dense):
        f.restype = ctypes.c_int
    log.info("qblocks_loaded", simd=("c", "avx2", "avx2+vnni", "avx512+vnni")[lib.qb_simd()])
    return lib


# -- running -----------------------------------------------------------------------------------

def matmul(lib: ctypes.CDLL, blocks: Tensor, source: str, x: Tensor, n: int, scalar: bool = False,
           two: bool = TWO_PASS) -> Tensor:
    """x [M, K] (float32) @ W^T -> [M, n] float32, W = ``blocks`` [n, bytes a row] of one
    type, bound for this one call (``Bound``). ``two``: the input rounded to int8 twice
    (value, then its rounding error): see qblocks.c. ``scalar``: the plain C throughout."""
    return Bound(lib, [(0, n, source, blocks)], x.shape[1], two, scalar)(x)


def dense(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] float32 @ weight^T (+ bias) -> [M, N] float32, ``weight`` [N, K] float32 or
    bf16 (contiguous), each output summed in one order whatever M (qblocks.c's qb_dense)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if (x.dtype != torch.float32 or weight.shape[1] != k or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)))):
        raise ModelError(f"the float kernel takes float32 [M, {weight.shape[1]}] and a contiguous weight, "
                         f"not {x.dtype} {list(x.shape)}")
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.qb_dense(x.data_ptr(), x.stride(0), m, weight.data_ptr(), int(weight.dtype == torch.bfloat16), n, k,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"qb_dense(K={k}) returned {rc}")
    return y


class Bound:
    """One linear's row segments [(r0, r1, type, blocks)] bound to the kernel once: a call
    is one output tensor and a C call a segment, into its columns, with the type ids and
    pointers worked out at load. (``matmul``'s Python, a slice and a tensor a segment, was
    about 5 us of a decode step's 10-40 us small linears.) ``two``, ``scalar``: as ``matmul``'s."""

    def __init__(self, lib: ctypes.CDLL, segments: list[tuple[int, int, str, Tensor]], k: int, two: bool,
                 scalar: bool = False):
        self.lib, self.k, self.n, self.two, self.scalar = lib, k, segments[-1][1], int(two), int(scalar)
        self._blocks = [b for *_, b in segments]  # what the pointers point into, kept alive
        self._calls = [(TYPES[typ][0], b.data_ptr(), r0, r1 - r0) for r0, r1, typ, b in segments]

    def __call__(self, x: Tensor) -> Tensor:  # [M, k] float32 -> [M, n] float32
        x = x.contiguous()
        m = x.shape[0]
        if x.dtype != torch.float32 or x.shape[1] != self.k:
            raise ModelError(f"the block kernel takes float32 [M, {self.k}], not {x.dtype} {list(x.shape)}")
        y = torch.empty(m, self.n, dtype=torch.float32)
        xp, yp, threads = x.data_ptr(), y.data_ptr(), torch.get_num_threads()
        for tid, bp, r0, rows in self._calls:
            rc = self.lib.qb_matmul(tid, bp, rows, self.k, xp, m, yp + 4 * r0, self.n, threads, self.scalar, self.two)
            if rc:
                raise RuntimeError(f"qb_matmul(type {tid}, K={self.k}) returned {rc}")
        return y


def quantize(lib: ctypes.CDLL, x: Tensor, two: bool, simd: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One row x [K] float32 as the kernel rounds it: codes int8 [2K] (the second pass's
    after the first's), scales, second scales and block sums float32 [3K/32], codes summed
    in fours int32 [K/2]; ``simd`` False: the plain C's (what the SIMD's must equal)."""
    x = x.reshape(-1).to(torch.float32).contiguous()
    k = x.numel()
    q, f, ls = torch.zeros(2 * k, dtype=torch.int8), torch.zeros(3 * k // 32), torch.zeros(k // 2, dtype=torch.int32)
    if lib.qb_quantize(x.data_ptr(), k, int(two), int(simd), q.data_ptr(), f.data_ptr(), ls.data_ptr()):
        raise ModelError(f"the block kernel rounds rows of a multiple of 32 values, not {k}")
    return q, f, ls


def rows(lib: ctypes.CDLL, blocks: Tensor, source: str, ids: Tensor, k: int) -> Tensor:
    """Rows ``ids`` of W as float32 [T, k], bit for bit what dequantize_weight gives."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if lib.qb_rows(TYPES[source][0], blocks.data_ptr(), k, ids.data_ptr(), ids.numel(), out.data_ptr()):
        raise RuntimeError(f"qb_rows({source}, K={k}) failed")
    return out


# -- the portable layout back into blocks -------------------------------------------------------

# Types that hold a stored layout's rows exactly, by (group, zeros), the record's own first.
# A fused linear (model.py joins q/k/v, gate/up stored in the same layout) can hold parts of
# different GGUF types: Gemma's Q5_0 wq, wk with a Q8_0 wv. Each row takes the first type that
# holds it exactly; runs of rows of one type are segments, each run by the kernel on its own.
_FAMILY = {(32, False): ("Q5_0", "Q8_0"), (32, True): ("Q5_1", "Q5_K"), (16, False): ("Q6_K",)}
_CODES = {"Q5_0": (-16, 15), "Q8_0": (-128, 127), "Q5_1": (0, 31), "Q5_K": (0, 31), "Q6_K": (-32, 31)}


def _fits(t: Mapping[str, Tensor], source: str) -> Tensor:
    """Rows [N] (bool) that ``source``'s blocks hold exactly (K-quants: as far as the codes
    say; their scales are factored, or refused, by pack)."""
    q, s, z = t["qweight"], t["scales"], t.get("zeros")
    lo, hi = _CODES[source]
    ok = ((q >= lo) & (q <= hi)).all(1)
    _, per, _ = TYPES[source]
    if q.shape[1] % per:
        return torch.zeros_like(ok)
    if per == 32:  # fp16 scales (and zeros)
        for v in (s,) if z is None else (s, z):
            ok &= (v.half().float() == v.float()).all(1)
    return ok


def segments(t: Mapping[str, Tensor], source: str, group: int, chunk: int = 4096) -> list[tuple[int, int, str]]:
    """[(r0, r1, type)] covering the rows of a stored layout, runs of one block type. An int4
    layout (Q4_0, Q4_1, Q4_K) is its own type throughout (pack checks it holds exactly)."""
    if source in INT4_BLOCKS:
        return [(0, t["qweight"].shape[0], source)]
    cands = _FAMILY.get((group, t.get("zeros") is not None), ())
    cands = (source, *(c for c in cands if c != source)) if source in cands else cands
    if not cands:
        raise ModelError(f"no block type holds {source} at group {group}")
    n = t["qweight"].shape[0]
    choice = torch.full((n,), -1, dtype=torch.int64)
    for r0 in range(0, n, chunk):  # a chunk of rows at a time: the head's temporaries stay small
        sub = {k: v[r0:r0 + chunk] for k, v in t.items() if v is not None}
        ch = choice[r0:r0 + chunk]
        for i, c in enumerate(cands):
            ch.copy_(torch.where((ch < 0) & _fits(sub, c), i, ch))
    if bool((choice < 0).any()):
        raise ModelError(f"rows of a {source} layout fit none of {', '.join(cands)}")
    edges = [0, *(torch.nonzero(choice[1:] != choice[:-1]).flatten() + 1).tolist(), len(choice)]
    return [(a, b, cands[int(choice[a])]) for a, b in zip(edges, edges[1:])]

def pack(t: Mapping[str, Tensor], source: str) -> Tensor:
    """The GGUF blocks [N, bytes a row] (uint8) of a weight stored per shards/quant.py."""
    if source not in TYPES:
        raise ModelError(f"no block kernel for {source}")
    q = t["qweight"]
    if source in INT4_BLOCKS:
        q = unpack_int4(q).to(torch.int16)
    n, k = q.shape
    _, per, size = TYPES[source]
    if k % per:
        raise ModelError(f"{source}: {k} columns are not whole blocks of {per}")
    lo, hi = _CODES.get(source, (0, 15))
    if q.numel() and not (int(q.min()) >= lo and int(q.max()) <= hi):
        raise ModelError(f"codes outside {source}'s range {lo}..{hi}")
    q = q.to(torch.int16).reshape(n, k // per, per)
    out = _PACK[source](q, t["scales"].reshape(n, k // per, -1), t.get("zeros"))
    out = out.reshape(n, k // per * size).contiguous()
    assert out.shape[1] == k // per * size
    return out


def _bytes16(x: Tensor) -> Tensor:  # fp16 [...] -> uint8 [..., 2] (little-endian)
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _exact_f16(s: Tensor, what: str) -> Tensor:
    h = s.to(torch.float16)
    if not torch.equal(h.float(), s.float()):
        raise ModelError(f"{what} scales are not float16 values")
    return h


def _u8(x: Tensor) -> Tensor:
    return x.to(torch.uint8)


def _nibble_pairs(u: Tensor) -> Tensor:  # [..., 2h] codes -> [..., h]: low = first half
    h = u.shape[-1] // 2
    return _u8((u[..., :h] & 15) | ((u[..., h:] & 15) << 4))


def _bits(b: Tensor) -> Tensor:  # [..., 8j] of 0/1 -> [..., j] bytes, bit i of byte j = b[8j + i]
    w = torch.tensor([1 << i for i in range(8)], dtype=torch.int16)
    return _u8((b.unflatten(-1, (-1, 8)) * w).sum(-1))


def _split(s: Tensor, lo: int, hi: int, what: str) -> tuple[Tensor, Tensor]:
    """s [..., n] float32, each d * q with d one fp16 per row of n and q integers in
    [lo, hi] -> (d [...], q [..., n]) with d * q == s exactly in float32. Tries the code of
    the largest |s| from the largest magnitude down: llama.cpp's quantizers put it at the
    end of the range (Q6_K's at -128), so the first try or two settle nearly every row."""
    s = s.float()
    ref = s.gather(-1, s.abs().argmax(-1, keepdim=True))  # [..., 1]
    d, q = torch.zeros_like(ref), torch.zeros_like(s)
    done = ref == 0
    for c in sorted((c for c in range(lo, hi + 1) if c), key=lambda c: (-abs(c), c)):
        if bool(done.all()):
            break
        dc = ref / c
        qc = torch.round(s / dc)
        ok = (dc.half().float() == dc) & (dc * qc == s).all(-1, keepdim=True)
        ok &= ((qc >= lo) & (qc <= hi)).all(-1, keepdim=True) & ~done
        d, q = torch.where(ok, dc, d), torch.where(ok, qc, q)
        done |= ok
    if not bool(done.all()):
        raise ModelError(f"{what} scales are not fp16 times integers in [{lo}, {hi}]")
    return d[..., 0].half(), q.to(torch.int16)


def _pack_q8_0(q, s, z):
    return torch.cat((_bytes16(_exact_f16(s[..., 0], "Q8_0")), q.to(torch.int8).view(torch.uint8)), -1)


def _q5_bits(u):  # 5-bit codes [..., 32] -> qh [..., 4], qs [..., 16]
    return _bits(u >> 4), _nibble_pairs(u)


def _pack_q4_0(q, s, z):  # q [.., 32] in 0..15, w = (q - 8) d: stored as q d + (-8 d)
    d = _exact_f16(s[..., 0], "Q4_0")
    if z is None or not torch.equal(z.reshape(s.shape)[..., 0].float(), -8 * d.float()):
        raise ModelError("Q4_0 zeros are not -8 times the scale")
    return torch.cat((_bytes16(d), _nibble_pairs(q)), -1)


def _pack_q4_1(q, s, z):
    zz = z.reshape(s.shape)
    return torch.cat((_bytes16(_exact_f16(s[..., 0], "Q4_1")), _bytes16(_exact_f16(zz[..., 0], "Q4_1")),
                      _nibble_pairs(q)), -1)


def _pack_q5_0(q, s, z):
    qh, qs = _q5_bits(q + 16)
    return torch.cat((_bytes16(_exact_f16(s[..., 0], "Q5_0")), qh, qs), -1)


def _pack_q5_1(q, s, z):
    qh, qs = _q5_bits(q)
    zz = z.reshape(s.shape)
    return torch.cat((_bytes16(_exact_f16(s[..., 0], "Q5_1")), _bytes16(_exact_f16(zz[..., 0], "Q5_1")), qh, qs), -1)


def _pack_q6_k(q, s, z):  # q [.., 256] in -32..31, s [.., 16] = d * sc
    d, sc = _split(s, -128, 127, "Q6_K")
    u = q + 32
    ql, qh = [], []
    for h in range(2):  # halves of 128: ql 64 bytes (weights l, l + 64), qh 32 (l + 32 i, i < 4)
        uh = u[..., 128 * h:128 * (h + 1)]
        ql.append(_nibble_pairs(uh))
        four = (uh >> 4).unflatten(-1, (4, 32))
        qh.append(_u8(sum(four[..., i, :] << (2 * i) for i in range(4))))
    return torch.cat((*ql, *qh, sc.to(torch.int8).view(torch.uint8), _bytes16(d)), -1)


def _k_head(s, z, what):  # -> d, dmin (fp16 bytes) and the 12 bytes of 6-bit scales and mins
    d, sc = _split(s, 0, 63, what)
    dmin, m = _split(-z.reshape(s.shape).float(), 0, 63, what)
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    hi = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    mix = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat((_bytes16(d), _bytes16(dmin), _u8(lo), _u8(hi), _u8(mix)), -1)


def _k_qs(u):  # [..., 256] -> [..., 128]: chunk c holds sub-blocks 2c (low) and 2c + 1 (high)
    return _nibble_pairs(u.unflatten(-1, (4, 64))).flatten(-2)


def _pack_q4_k(q, s, z):
    return torch.cat((_k_head(s, z, "Q4_K"), _k_qs(q)), -1)


def _pack_q5_k(q, s, z):
    high = (q >> 4).unflatten(-1, (8, 32))  # bit i of qh byte l: weight l of sub-block i
    qh = _u8(sum(high[..., i, :] << i for i in range(8)))
    return torch.cat((_k_head(s, z, "Q5_K"), qh, _k_qs(q)), -1)


_PACK = {"Q8_0": _pack_q8_0, "Q5_0": _pack_q5_0, "Q5_1": _pack_q5_1, "Q6_K": _pack_q6_k,
         "Q4_K": _pack_q4_k, "Q5_K": _pack_q5_k, "Q4_0": _pack_q4_0, "Q4_1": _pack_q4_1}
