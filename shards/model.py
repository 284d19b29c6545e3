"""The forward every family shares, cut into stages (the layer's parts: ``shards/layers.py``).

A Llama is the plain case; the config's switches add what other families have (a scaled
embedding, a soft-capped head; the layer's own in layers.py), so a family is a config
reader and weight names, not code here.

A ``Stage`` holds an optional embedding, a span of transformer layers (keyed by their
absolute layer number) and an optional final norm and head, so one class serves the
supernode (embed + head) and every stage (a span). Tensor shapes in comments use
T = new positions, S = cached + new positions, H = hidden, V = vocab, nh / nkv = query /
key-value heads, hd = head dim. There is no batch dimension: one session per call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from shards.errors import ModelError, ShardsError
from shards import qblocks, qlinear, quant, rowops
from shards.config import ModelConfig
from shards.families import family
from shards.layers import AnyLinear, Block, Caches, KVCache, RMSNorm, Rope, rope_tables
from shards.manifest import EMBED_FILE, TOKENIZER_FILE, Manifest, layer_file
from shards.span import Span


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
        self.whole_block = True  # decode rows' blocks in one C call where they can (rowops.Kernels)
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
                x = rowops.block(self.rowops, block, x, *ropes[block.sliding], segments, self.whole_block)
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
               verify: bool = True, kernels: rowops.Kernels = rowops.Kernels.WHOLE_BLOCK) -> tuple[Stage, Manifest]:
    """Build a stage on the meta device and fill it from just its own shard files; a model
    whose files do not make one is a ModelError, whatever fails first. ``kernels``: which
    code runs its blocks on the CPU (the fastest there is unless a bench or test says)."""
    try:
        return _load_stage(model_dir, span, embed, head, device, dtype, verify, kernels)
    except LOAD_ERRORS as exc:
        if isinstance(exc, ShardsError):  # (InvalidParams is a ValueError)
            raise
        raise ModelError(f"model in {model_dir} does not load: {type(exc).__name__}: {exc}") from exc


def _load_stage(model_dir: Path, span: Span | None, embed: bool, head: bool, device: torch.device | str,
                dtype: torch.dtype, verify: bool, kernels: rowops.Kernels) -> tuple[Stage, Manifest]:
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
    stage.rowops = None if kernels is rowops.Kernels.TORCH else rowops.library_for(device, dtype)
    stage.whole_block = kernels is rowops.Kernels.WHOLE_BLOCK
    if stage.rowops is not None:  # the CPU's float linears row-invariant too (the quantized ones are)
        qlinear.exact_floats(stage, qblocks.library())
    stage.eval()
    return stage, manifest
