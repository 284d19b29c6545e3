"""The parts of a transformer layer every family shares, in the style of gpt-fast's model.py:
RMS norm, rope, a session's KV cache, attention, the feed-forward, the block that joins
them. ``shards/model.py`` builds stages of these blocks; ``shards/rowops.py`` runs the same
block in C (the same kernels, so the same bits) and reads these modules for it.

A Llama is the plain case; the config's switches add what other families have (biases,
q/k norms, sandwich norms, GELU, sliding-window layers with their own rope), so a family is
a config reader and weight names, not code here. Tensor shapes in comments use T = new
positions, S = cached + new positions, H = hidden, nh / nkv = query / key-value heads,
hd = head dim. There is no batch dimension: one session per call.
"""

from __future__ import annotations

import contextlib
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shards import qlinear
from shards.config import ModelConfig
from shards.errors import ModelError
from shards.rope import layer_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op where it computes exactly what the lines below do (all float32):
            # seven small ops a norm were a tenth of a decode step.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()  # the mean of squares in float32 whatever the weights' dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(c: ModelConfig, sliding: bool, spans: list[tuple[int, int]], device: torch.device,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and the signed sin [N, hd] that ``apply_rope`` takes, for the rows of ``spans``."""
    cos, sin = layer_cos_sin(c, sliding, spans, device, dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:  # x [heads, T, hd], cos/sin [T, hd]
    """The rotate-half rope, x * cos + cat(-x2, x1) * sin, with the sign folded into the sin
    table: cat(x2, x1) is a roll, so this is 4 ops where the plain form is 7, and the same
    floats (a negation is exact either side of the product)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


# (start position, rows, that layer's cache) per session in a batch, in row order.
Segments = list[tuple[int, int, "KVCache | None"]]


class KVCache:
    """One layer's keys and values for one session: [nkv, capacity, hd], grown in chunks."""

    CHUNK = 256

    def __init__(self, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.empty(n_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @classmethod
    def room_for(cls, positions: int) -> int:
        """The capacity a cache has once it has held ``positions`` (whole chunks; it never shrinks)."""
        return -(-positions // cls.CHUNK) * cls.CHUNK

    def _grow(self, need: int) -> None:
        cap = self.room_for(need)
        nkv, _, hd = self.k.shape
        k = self.k.new_empty(nkv, cap, hd)
        v = self.v.new_empty(nkv, cap, hd)
        k[:, : self.length] = self.k[:, : self.length]
        v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = k, v

    def reserve(self, start: int, rows: int) -> None:
        """Room for ``rows`` positions from ``start``, which must be the length."""
        if start != self.length:
            raise ModelError(f"KV cache holds {self.length} positions, cannot append at {start}")
        if start + rows > self.capacity:
            self._grow(start + rows)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [nkv, T, hd] at ``start`` (== length); return all [nkv, S, hd]."""
        self.reserve(start, k.shape[1])
        end = start + k.shape[1]
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ModelError(f"cannot cut a KV cache of {self.length} positions back to {n}")
        self.length = n


Rope = tuple[Tensor, Tensor]  # cos, sin [N, hd] for the rows of a forward

# A projection as a stage holds it: an nn.Linear as built (a RowLinear once qlinear.exact_floats
# made it row-invariant), or a QuantLinear where qlinear.swap_in put one.
AnyLinear = nn.Linear | qlinear.QuantLinear


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        # wq, wk, wv are None once ``fuse`` joined them into wqkv.
        self.wq: AnyLinear | None = nn.Linear(c.hidden_size, c.q_size, bias=c.attn_bias)
        self.wk: AnyLinear | None = nn.Linear(c.hidden_size, c.kv_size, bias=c.attn_bias)
        self.wv: AnyLinear | None = nn.Linear(c.hidden_size, c.kv_size, bias=c.attn_bias)
        self.wo: AnyLinear = nn.Linear(c.q_size, c.hidden_size, bias=False)
        # Per-head norms of q and k (over hd), before rope.
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = c.query_scale  # None: SDPA's own 1/sqrt(hd)
        self.window = c.sliding_window if c.is_sliding(layer) else None
        self.wqkv: AnyLinear | None = None  # wq, wk, wv as one matmul, once ``fuse`` made it

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: Segments) -> Tensor:
        """x [N, H]: the rows of every segment one after another; the projections
        run on all rows at once, attention per segment against its own cache."""
        N, nq, nkv, hd = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        if self.wqkv is not None:  # q, k and v heads side by side in one output
            qkv = self.wqkv(x).view(N, nq + 2 * nkv, hd)
            qk, v = qkv[:, : nq + nkv], qkv[:, nq + nkv:]
        else:  # not fused: the three parts are there
            wq, wk, wv = cast("tuple[AnyLinear, AnyLinear, AnyLinear]", (self.wq, self.wk, self.wv))
            qk = torch.cat((wq(x).view(N, nq, hd), wk(x).view(N, nkv, hd)), dim=1)
            v = wv(x).view(N, nkv, hd)
        q, k, v = self.heads(qk, v, cos, sin)
        if len(segments) == 1:
            start, _, cache = segments[0]
            y = self._attend(q, k, v, start, cache)
        else:
            ys, off = [], 0
            for start, rows, cache in segments:
                sl = slice(off, off + rows)
                ys.append(self._attend(q[:, sl], k[:, sl], v[:, sl], start, cache))
                off += rows
            y = torch.cat(ys, dim=1)
        return self.wo(y.transpose(0, 1).reshape(N, -1))  # [nh, N, hd] -> [N, H]

    def heads(self, qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q and k heads [N, nh + nkv, hd] normed and roped, v [N, nkv, hd] -> q [nh, N, hd],
        k and v [nkv, N, hd]."""
        nq = self.n_heads
        if self.q_norm is not None:  # (k_norm is built with it)
            qk = torch.cat((self.q_norm(qk[:, :nq]), cast(RMSNorm, self.k_norm)(qk[:, nq:])), dim=1)
        # One rope over the q and k heads together.
        q, k = apply_rope(qk.transpose(0, 1), cos, sin).split((nq, self.n_kv_heads))
        return q, k, v.transpose(0, 1)

    def first_key(self, start: int) -> int:
        """The first key position that any new row from ``start`` on can see (its window's)."""
        return 0 if self.window is None else max(0, start + 1 - self.window)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, cache: KVCache | None) -> Tensor:
        """One segment: q [nh, T, hd], k/v [nkv, T, hd] at positions start.. -> [nh, T, hd]."""
        T = q.shape[1]
        if cache is not None:
            k, v = cache.update(start, k, v)  # [nkv, S, hd]
        elif start != 0:
            raise ModelError("a forward from a position other than 0 needs a KV cache")
        S = k.shape[1]
        first = self.first_key(start)
        if first:
            k, v = k[:, first:], v[:, first:]
        # Batched 4-d inputs with the kv heads shared in place (enable_gqa): SDPA's fused
        # kernels take these; 3-d inputs or repeated kv heads fall to its math path, which
        # measured 2.4x slower for one decode row (torch 2.13 CPU).
        q, k, v = q[None], k[None], v[None]
        if T == 1:  # one new position sees everything before it (in its window)
            return self._sdpa(q, k, v)
        if S == T and self.window is None:
            return self._sdpa(q, k, v, is_causal=True)
        # new row i (position start+i) sees keys first .. start+i, and only the last `window`
        pos = torch.arange(start, start + T, device=q.device)[:, None]  # [T, 1]
        key = torch.arange(first, S, device=q.device)[None, :]  # [1, S']
        mask = key <= pos
        if self.window is not None:
            mask &= key > pos - self.window
        return self._sdpa(q, k, v, attn_mask=mask)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:  # [1, heads, T|S, hd] -> [nh, T, hd]
        gqa = self.n_heads != self.n_kv_heads
        with sdpa_kernel(CUDA_ATTENTION) if q.is_cuda else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=gqa, **kw)[0]


# On CUDA, torch prefers its cuDNN attention, which builds a plan for every new shape: a decode
# row against a KV length the process has not seen cost 47-65 ms on an H200 (0.04 ms once
# seen), so every new position of every session stalled. The flash and memory-efficient
# kernels take any length at ~0.06 ms; math is the fallback for what they refuse.
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        # w1 and w3 are None once ``fuse`` joined them into w13.
        self.w1: AnyLinear | None = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)  # gate
        self.w2: AnyLinear = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)  # down
        self.w3: AnyLinear | None = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)  # up
        self.act = F.silu if c.hidden_act == "silu" else _gelu_tanh
        self.w13: AnyLinear | None = None  # w1 and w3 as one matmul, once ``fuse`` made it

    def forward(self, x: Tensor) -> Tensor:  # [T, H] -> [T, H]
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:  # not fused: both parts are there
            w1, w3 = cast("tuple[AnyLinear, AnyLinear]", (self.w1, self.w3))
            gate, up = w1(x), w3(x)
        return self.w2(self.act(gate) * up)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


class Block(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.sliding = c.is_sliding(layer)
        self.attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attention = Attention(c, layer)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.feed_forward = FeedForward(c)
        # Gemma's sandwich: each sublayer's output is normed again before the residual add.
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.sandwich_norms else None
        self.post_ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.sandwich_norms else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: Segments) -> Tensor:
        a = self.attention(self.attention_norm(x), cos, sin, segments)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        return h + f


Caches = dict[int, KVCache]  # absolute layer number -> that layer's cache
