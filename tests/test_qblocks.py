"""The C block kernel (shards/qblocks.c) on real GGUF blocks: the file's bytes rebuilt from
a shard's layout, its matmul against x @ W^T of ``gguf.quants.dequantize`` of the same
blocks (M = 1, a decode step, and M = 17, a prefill), its rows bit for bit, and the
quantized linear's fallback where there is no compiler.

The blocks are 64-row slices of real tensors (tests/data/gguf-blocks.gguf: SmolLM2 made
by llama-quantize, and the Gemma 3 270M Q4_K_M file's Q4_K, Q5_0, Q6_K and Q8_0).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from shards import qblocks
from shards.errors import ModelError
from shards.ggml_blocks import repack
from shards.qlinear import QuantEmbedding, QuantLinear
from shards.quant import BLOCK_RUNS, block_bytes

BLOCKS = Path(__file__).parent / "data" / "gguf-blocks.gguf"
TENSORS = {t.name: t for t in GGUFReader(str(BLOCKS)).tensors}
KERNEL = sorted(n for n, t in TENSORS.items() if t.tensor_type.name in qblocks.TYPES)

needs_cc = pytest.mark.skipif(qblocks.library() is None, reason="no C compiler to build shards/qblocks.c")


def _tensor(name: str):
    t = TENSORS[name]
    cols, rows = (int(n) for n in t.shape)
    stored, rec = repack(name, t.tensor_type, t.data, rows, cols)
    ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, cols))
    raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1).copy())
    return stored, rec, ref, raw


def test_fixture_has_the_kernels_types():
    assert {n.split(".")[0] for n in KERNEL} == set(qblocks.TYPES)
    assert {n.split(".")[0] for n in KERNEL if ".gemma3." in n} >= {"Q5_0", "Q6_K", "Q8_0"}


@pytest.mark.parametrize("name", KERNEL)
def test_pack_gives_back_the_files_blocks(name):
    """From the shard layout (codes, scales d * sc) back to the file's bytes, byte for byte:
    the weight is held at exactly the size the GGUF file gives it."""
    stored, rec, _, raw = _tensor(name)
    packed = qblocks.pack(stored, rec.source)
    assert packed.dtype == torch.uint8 and torch.equal(packed, raw)
    assert packed.numel() == block_bytes(rec.source, *_tensor(name)[2].shape)


@needs_cc
@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "plain-c"])
@pytest.mark.parametrize("name", KERNEL)
def test_kernel_agrees_with_float_matmul_of_gguf_dequantize(name, scalar):
    _, rec, ref, raw = _tensor(name)
    N, K = ref.shape
    gen = torch.Generator().manual_seed(0)
    lib = qblocks.library()
    errs = {}
    for m in (1, 17):
        x = torch.randn(m, K, generator=gen)
        got = qblocks.matmul(lib, raw, rec.source, x, N, scalar=scalar).double()
        want = x.double() @ ref.double().T
        errs[m] = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{name} ({'plain C' if scalar else 'SIMD'}): max relative error M=1 {errs[1]:.2e}, M=17 {errs[17]:.2e}")
    # The input rows are rounded to int8 blocks of 32 (as llama.cpp does): about 2^-8 of a
    # block's largest value each, some 1e-2 of the largest output on random rows.
    assert max(errs.values()) < 3e-2, errs


@needs_cc
def test_simd_and_plain_c_agree():
    name = next(n for n in KERNEL if n.startswith("Q6_K"))
    _, rec, ref, raw = _tensor(name)
    x = torch.randn(3, ref.shape[1], generator=torch.Generator().manual_seed(1))
    lib = qblocks.library()
    a = qblocks.matmul(lib, raw, rec.source, x, ref.shape[0])
    b = qblocks.matmul(lib, raw, rec.source, x, ref.shape[0], scalar=True)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


@needs_cc
@pytest.mark.parametrize("k", [32, 96, 576, 1536])
def test_simd_rounds_an_input_row_to_the_plain_c_codes(k):
    """The SIMD rounding of an input row (what every decode step's matmuls run on) gives
    the plain C's codes, scales and sums bit for bit, both passes: a K that is not a whole
    number of 64-code steps, an all-zero block, ties at .5 and large values included."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(k, generator=gen) * torch.logspace(-3, 3, k).roll(k // 3)
    if k > 64:
        x[:32] = 0.0
        x[32:64] = torch.arange(32) - 15.5  # halves: round to even, as lrintf
    lib = qblocks.library()
    for two in (False, True):
        plain, simd = qblocks.quantize(lib, x, two, simd=False), qblocks.quantize(lib, x, two, simd=True)
        for a, b in zip(plain, simd):
            assert torch.equal(a, b), (two, (a != b).nonzero()[:5])
        if two:
            assert plain[0][k:].abs().max() > 0  # the second pass ran


@needs_cc
@pytest.mark.parametrize("name", KERNEL)
def test_a_rows_outputs_are_the_same_bits_alone_and_in_a_batch(name):
    """A decode row (M = 1, which some types run two weight rows at a time) gives the bits
    it gives inside a decode batch and inside a prefill's: what makes batched generation equal
    plain. An odd row count leaves a last weight row on its own. A wide linear's decode batch
    (a head's: up to 64 rows, each run of 64 weight rows' outputs written straight to the
    output) gives the bits of the same rows inside a prefill (through a row-major buffer)."""
    _, rec, ref, raw = _tensor(name)
    n = ref.shape[0] - 1 if ref.shape[0] % 2 == 0 else ref.shape[0]
    x = torch.randn(70, ref.shape[1], generator=torch.Generator().manual_seed(5))
    lib = qblocks.library()
    batch = qblocks.matmul(lib, raw[:n], rec.source, x[:64].clone(), n)
    for m in (0, 5, 63):
        assert torch.equal(qblocks.matmul(lib, raw[:n], rec.source, x[m:m + 1].clone(), n), batch[m:m + 1])
    for rows in (2, 3, 6, 17, 33):  # decode batches and prefill chunks of several sizes
        assert torch.equal(qblocks.matmul(lib, raw[:n], rec.source, x[:rows].clone(), n), batch[:rows])
    wide = 4100  # 64 input rows x 4100 >= 2^18 outputs: the direct path; not a whole number of 64-row runs
    blocks = raw.repeat(-(-wide // raw.shape[0]), 1)[:wide].contiguous()
    prefill = qblocks.matmul(lib, blocks, rec.source, x, wide)
    assert torch.equal(qblocks.matmul(lib, blocks, rec.source, x[:64].clone(), wide), prefill[:64])
    assert torch.equal(qblocks.matmul(lib, blocks, rec.source, x[63:64].clone(), wide), prefill[63:64])


@needs_cc
@pytest.mark.parametrize("name", KERNEL)
def test_rows_dequantize_bit_for_bit(name):
    _, rec, ref, raw = _tensor(name)
    ids = torch.tensor([0, 5, 63, 5])
    assert torch.equal(qblocks.rows(qblocks.library(), raw, rec.source, ids, ref.shape[1]), ref[ids])


def _linear(name: str) -> tuple[QuantLinear, torch.Tensor]:
    stored, rec, ref, _ = _tensor(name)
    m = QuantLinear(ref.shape[1], ref.shape[0], rec)
    for k, v in stored.items():
        setattr(m, k, v)
    return m, ref


@needs_cc
@pytest.mark.parametrize("name", [n for n in KERNEL if n.split(".")[0] in BLOCK_RUNS])
def test_quant_linear_runs_the_blocks_at_their_size(name):
    m, ref = _linear(name)
    assert m.prepare(torch.float32) == "blocks_cpu"
    assert m._packed.numel() == block_bytes(m.record.source, *ref.shape)
    assert not m.stored()  # the shard layout is dropped: the blocks are all it holds
    x = torch.randn(17, ref.shape[1], generator=torch.Generator().manual_seed(2))
    for dt in (torch.float32, torch.bfloat16):
        y = m(x.to(dt))
        assert y.dtype == dt
        want = x.double() @ ref.double().T
        assert ((y.double() - want).abs().max() / want.abs().max()).item() < 3e-2


@needs_cc
def test_tied_embedding_reads_the_heads_blocks():
    name = next(n for n in KERNEL if n.startswith("Q8_0") and "token_embd" in n)
    head, ref = _linear(name)
    emb = QuantEmbedding(ref.shape[0], ref.shape[1], head.record)
    for k, v in head.stored().items():
        setattr(emb, k, v)
    assert head.prepare(torch.float32, keep_stored=True, rescore=4) == "blocks_cpu"
    assert emb.share_packed(head) and not emb.stored()
    ids = torch.tensor([3, 0, 63])
    assert torch.equal(emb(ids), ref[ids])
    # the head's rescored top logits are exact float32
    x = torch.randn(2, ref.shape[1], generator=torch.Generator().manual_seed(3))
    y, want = head(x), x @ ref.T
    top = y.topk(4, dim=-1).indices
    assert torch.allclose(y.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-5)


@needs_cc
def test_a_fused_linear_of_two_types_runs_each_rows_in_its_own_blocks():
    """model.py fuses q/k/v stored in one layout: Gemma's Q5_0 wk with its Q8_0 wv is one int8
    g32 linear recorded as Q5_0. Each run of rows keeps its own type (never Q8_0 codes in Q5_0
    blocks), and every part is probed."""
    (k_t, k_rec, k_ref, _), (v_t, _, v_ref, _) = _tensor("Q5_0.gemma3.blk.0.attn_k.weight"), \
        _tensor("Q8_0.gemma3.blk.0.attn_v.weight")
    t = {k: torch.cat((k_t[k], v_t[k])) for k in k_t}
    ref = torch.cat((k_ref, v_ref))
    m = QuantLinear(ref.shape[1], ref.shape[0], k_rec)
    for k, v in t.items():
        setattr(m, k, v)
    assert m.prepare(torch.float32) == "blocks_cpu"
    assert [(a, b, typ) for a, b, typ, _ in m._segments] == [(0, 64, "Q5_0"), (64, 128, "Q8_0")]
    assert m._packed.numel() == 64 * 20 * (22 + 34)
    x = torch.randn(17, ref.shape[1], generator=torch.Generator().manual_seed(5))
    want = x.double() @ ref.double().T
    assert ((m(x).double() - want).abs().max() / want.abs().max()).item() < 1e-4
    ids = torch.tensor([1, 70, 63, 64, 127])
    assert torch.equal(m.rows(ids), ref[ids])
    with pytest.raises(ModelError):  # and pack itself refuses codes its type cannot hold
        qblocks.pack(t, "Q5_0")


@pytest.mark.parametrize("name", [n for n in KERNEL if n.split(".")[0] in ("Q6_K", "Q8_0", "Q5_0")])
def test_without_a_compiler_the_linear_falls_back_and_stays_correct(name, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("MESHD_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert qblocks.library() is None
    m, ref = _linear(name)
    assert m.prepare(torch.float32) == "planes_cpu"
    x = torch.randn(5, ref.shape[1], generator=torch.Generator().manual_seed(4))
    want = x.double() @ ref.double().T
    assert ((m(x).double() - want).abs().max() / want.abs().max()).item() < 1.5e-2


@needs_cc
def test_concurrent_first_builds_share_one_cache(tmp_path):
    """Two processes building into an empty cache at once both load a whole library."""
    code = "from shards import qblocks; import sys; sys.exit(qblocks.library() is None)"
    env = os.environ | {"MESHD_KERNEL_CACHE": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert len(list(tmp_path.glob("qblocks-*.so"))) == 1 and not list(tmp_path.glob(".qblocks-*"))
