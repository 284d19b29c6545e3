"""The forward every family shares, in the style of gpt-fast's model.py, cut into stages.

A Llama is the plain case; the config's switches add what other families have (biases,
q/k norms, sandwich norms, GELU, sliding-window layers with their own rope, a scaled
embedding, a soft-capped head), so a family is a config reader and weight names, not code here.

A ``Stage`` holds an optional embedding, a span of transformer layers (keyed by their
absolute layer number) and an optional final norm and head, so one class serves the
supernode (embed + head) and every stage (a span). Tensor shapes in comments use
T = new positions, S = cached + new positions, H = hidden, V = vocab, nh / nkv = query /
key-value heads, hd = head dim. There is no batch dimension: one session per call.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from shards.errors import ModelError, ShardsError
from shards import qblocks, qlinear, quant, rowops
from shards.config import ModelConfig
from shards.families import family
from shards.manifest import EMBED_FILE, TOKENIZER_FILE, Manifest, layer_file
from shards.rope import layer_cos_sin
from shards.span import Span


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

    def _grow(self, need: int) -> None:
        cap = -(-need // self.CHUNK) * self.CHUNK
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


class Stage(nn.Module):
    """Embedding (optional), layers ``span`` (optional), final norm + head (optional)."""

    def __init__(self, config: ModelConfig, span: Span | None, embed: bool, head: bool):
        super().__init__()
        if span is not None and span.stop > config.n_layers:
            raise ModelError(f"span {span} exceeds the model's {config.n_layers} layers")
        self.config, self.span, self.has_embed, self.has_head = config, span, embed, head
        c = config
        # (A QuantEmbedding and a QuantLinear where qlinear.swap_in put them.)
        self.tok_embeddings: nn.Embedding | qlinear.QuantEmbedding | None = (
            nn.Embedding(c.vocab_size, c.hidden_size) if embed else None)
        self.layers = nn.ModuleDict({str(i): Block(c, i) for i in (span or ())})  # read through ``layer``
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if head else None
        self.output: AnyLinear | None = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if head else None
        self.rowops: ctypes.CDLL | None = None  # shards/rowops.py's library, where load_stage found it can run
        self.tie()

    def tie(self) -> None:
        """Tied models: the head is the embedding matrix (same tensor when both live here)."""
        if (self.config.tie_embeddings and isinstance(self.tok_embeddings, nn.Embedding)
                and isinstance(self.output, nn.Linear)):
            self.output.weight = self.tok_embeddings.weight

    def layer(self, i: int) -> Block:
        """The block of absolute layer ``i`` (one of ``span``)."""
        return cast(Block, self.layers[str(i)])

    def blocks(self) -> Iterable[Block]:
        return cast("Iterable[Block]", self.layers.values())

    @property
    def device(self) -> torch.device:
        return next(chain(self.parameters(), self.buffers())).device

    @property
    def dtype(self) -> torch.dtype:  # of activations (quantized weights are buffers, not parameters)
        return next(t for t in chain(self.parameters(), self.buffers()) if t.is_floating_point()).dtype

    def new_caches(self) -> Caches:
        c = self.config
        return {i: KVCache(c.n_kv_heads, c.head_dim, self.dtype, self.device) for i in (self.span or ())}

    def embed(self, tokens: Tensor) -> Tensor:  # [T] int64 -> [T, H]
        if self.tok_embeddings is None:
            raise ModelError("this stage holds no embedding")
        x = self.tok_embeddings(tokens)
        if self.config.embed_scale is not None:  # in the embedding's dtype, as Gemma rounds it
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def forward(self, hidden: Tensor, start: int, caches: Caches | None = None) -> Tensor:
        """Run the span over ``hidden`` [T, H] at positions start .. start+T-1."""
        return self.forward_batch(hidden, [(start, hidden.shape[0], caches)])

    def forward_batch(self, hidden: Tensor, batch: Sequence[tuple[int, int, Caches | None]],
                      between: Callable[[], object] | None = None) -> Tensor:
        """Run the span over several sessions at once: ``hidden`` [N, H] holds each
        one's rows in turn, ``batch`` their (start, rows, caches). ``between``: called
        after each layer but the last (the engine runs urgent calls there)."""
        if self.span is None:
            return hidden
        x = hidden.to(device=self.device, dtype=self.dtype)
        if self.rowops is not None:  # updated in place there: never the caller's tensor
            x = x.clone(memory_format=torch.contiguous_format)
        spans = [(start, rows) for start, rows, _ in batch]
        ropes: dict[bool, Rope] = {}  # by layer kind: sliding or not
        for i in self.span:
            block = self.layer(i)
            if block.sliding not in ropes:
                ropes[block.sliding] = rope_tables(self.config, block.sliding, spans, x.device, x.dtype)
            segments = [(start, rows, None if caches is None else caches[i]) for start, rows, caches in batch]
            if self.rowops is not None:
                x = rowops.block(self.rowops, block, x, *ropes[block.sliding], segments)
            else:
                x = block(x, *ropes[block.sliding], segments)
            if between is not None and i + 1 < self.span.stop:
                between()
        return x

    def head(self, hidden: Tensor) -> Tensor:  # [T, H] -> [T, V] float32
        if self.output is None or self.norm is None:
            raise ModelError("this stage holds no head")
        x = hidden.to(device=self.device, dtype=self.dtype)
        logits = self.output(self.norm(x)).float()
        if (cap := self.config.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def fuse(stage: Stage) -> int:
    """Each block's q, k, v projections, and its gate and up, as one matmul each where their
    weights are stored alike (same dtype, or same quantized layout and group): a layer's
    decode step then makes 4 matmul calls instead of 7, and each call pays its own dispatch
    and input cast (measured: a third of a SmolLM2 decode step was such overhead).
    The parts are dropped, so the weights are held once. Returns how many were fused."""
    n = 0
    for block in stage.blocks():
        a, f = block.attention, block.feed_forward
        # As loaded: nothing fused yet, so every part is there.
        if (m := _fused(cast("tuple[AnyLinear, ...]", (a.wq, a.wk, a.wv)))) is not None:
            a.wqkv, a.wq, a.wk, a.wv = m, None, None, None
            n += 1
        if (m := _fused(cast("tuple[AnyLinear, ...]", (f.w1, f.w3)))) is not None:
            f.w13, f.w1, f.w3 = m, None, None
            n += 1
    return n


def _fused(parts: tuple[AnyLinear, ...]) -> AnyLinear | None:
    """One linear whose output rows are ``parts``' in turn, or None when they differ in kind."""
    K = parts[0].in_features
    N = sum(p.out_features for p in parts)
    if any(p.in_features != K for p in parts) or len({p.bias is None for p in parts}) != 1:
        return None
    if all(type(p) is nn.Linear for p in parts):
        linears = cast("tuple[nn.Linear, ...]", parts)  # (as just checked)
        if len({(p.weight.dtype, p.weight.device) for p in linears}) != 1:
            return None
        with torch.device("meta"):
            m: AnyLinear = nn.Linear(K, N, bias=parts[0].bias is not None)
        tensors: dict[str, list[Tensor | None]] = {"weight": [p.weight for p in linears],
                                                   "bias": [p.bias for p in linears]}
    elif all(type(p) is qlinear.QuantLinear for p in parts):
        quantized = cast("tuple[qlinear.QuantLinear, ...]", parts)  # (as just checked)
        r = quantized[0].record
        if any((p.record.layout, p.record.group, p.record.zeros) != (r.layout, r.group, r.zeros) for p in quantized):
            return None
        m = qlinear.QuantLinear(K, N, r, device="meta", bias=parts[0].bias is not None)
        tensors = {k: [getattr(p, k) for p in parts] for k in (*dict(m.named_buffers(recurse=False)), "bias")}
    else:
        return None
    for k, ts in tensors.items():
        if ts[0] is None:
            continue
        t = torch.cat([t.detach() for t in cast("list[Tensor]", ts)])  # (all None or none: checked above)
        if isinstance(getattr(m, k), nn.Parameter):
            setattr(m, k, nn.Parameter(t, requires_grad=False))
        else:
            setattr(m, k, t)
    return m


def _read(path: Path, keys: list[tuple[str, str]], device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """(file key, our state-dict key) pairs from one safetensors file (never pickle)."""
    out: dict[str, Tensor] = {}
    read: dict[str, Tensor] = {}
    try:
        opened = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:  # a pickle, or anything else, under a shard's name: never unpickled
        raise ModelError(f"{path.name} is not a safetensors file: {e}") from None
    with opened as st:
        have = set(st.keys())
        for theirs, ours in keys:
            if theirs not in have:
                raise ModelError(f"{path.name} lacks tensor {theirs}")
            if theirs not in read:  # a tied head shares the embedding's tensor
                t = st.get_tensor(theirs)  # quantized tensors keep their dtypes (codes, fp16/fp32 scales)
                keep = not t.is_floating_point() or theirs.endswith((".scales", ".zeros"))
                moved = t.to(device=device, dtype=t.dtype if keep else dtype)
                # A tensor still on the file's mmap keeps the whole file resident beside the
                # copies made from it (packed layouts): own the bytes, let the map go.
                read[theirs] = moved.clone() if moved.data_ptr() == t.data_ptr() else moved
            out[ours] = read[theirs]
    return out


# What a model directory's values can raise past the checks made on them (a manifest's quant
# records or config of the wrong type or range, a shard's tensor of the wrong dtype or shape):
# a model that does not load, not a crash of the task that loads it.
LOAD_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, ArithmeticError, RuntimeError,
               MemoryError)


def load_stage(model_dir: Path, span: Span | None, embed: bool, head: bool,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               verify: bool = True) -> tuple[Stage, Manifest]:
    """Build a stage on the meta device and fill it from just its own shard files; a model
    whose files do not make one is a ModelError, whatever fails first."""
    try:
        return _load_stage(model_dir, span, embed, head, device, dtype, verify)
    except LOAD_ERRORS as exc:
        if isinstance(exc, ShardsError):  # (InvalidParams is a ValueError)
            raise
        raise ModelError(f"model in {model_dir} does not load: {type(exc).__name__}: {exc}") from exc


def _load_stage(model_dir: Path, span: Span | None, embed: bool, head: bool, device: torch.device | str,
                dtype: torch.dtype, verify: bool) -> tuple[Stage, Manifest]:
    model_dir = Path(model_dir)
    manifest = Manifest.load(model_dir)
    family(manifest.architecture)  # a model of an architecture this meshd does not know is refused
    names = [n for n in manifest.files_for(span, embed or head) if n != TOKENIZER_FILE or embed]
    if verify:
        manifest.verify(model_dir, names)
    device = torch.device(device)
    with torch.device("meta"):
        stage = Stage(manifest.config, span, embed, head)
    records = quant.records_of(manifest.quant, manifest.config)
    if records:
        qlinear.swap_in(stage, records)  # QuantLinears whose tensors are the shard files'
    state: dict[str, Tensor] = {}
    if embed or head:
        keys = []
        if embed:
            assert stage.tok_embeddings is not None  # (a stage built with embed has one)
            keys += [(f"tok_embeddings.{k}",) * 2 for k in stage.tok_embeddings.state_dict(keep_vars=True)]
        if head:
            # A head-only stage of a tied model still needs the embedding matrix, as its head.
            src = "tok_embeddings" if manifest.config.tie_embeddings else "output"
            keys += [("norm.weight", "norm.weight")]
            assert stage.output is not None  # (a stage built with head has one)
            keys += [(f"{src}.{k}", f"output.{k}") for k in stage.output.state_dict(keep_vars=True)]
        state |= _read(model_dir / EMBED_FILE, keys, device, dtype)
    for i in span or ():
        prefix = f"layers.{i}."
        keys = [(k[len(prefix):], k) for k in stage.state_dict(keep_vars=True) if k.startswith(prefix)]
        state |= _read(model_dir / layer_file(i), keys, device, dtype)
    stage.load_state_dict(state, strict=True, assign=True)
    state.clear()  # the stage holds each tensor now; fusing frees the parts it joins
    stage.tie()
    fuse(stage)
    if records:
        qlinear.prepare(stage, dtype)  # the device's packed layouts, checked against a plain matmul
    stage.rowops = rowops.library_for(device, dtype)
    if stage.rowops is not None:  # the CPU's float linears row-invariant too (the quantized ones are)
        qlinear.exact_floats(stage, qblocks.library())
    stage.eval()
    return stage, manifest
