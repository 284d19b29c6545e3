"""GGUF tensors kept as shipped: every block type repacked code for code, its linear run by
the device kernels, and a real model converted with its quantization kept.

The blocks are real: 64-row slices of tensors llama.cpp's ``llama-quantize`` made from
SmolLM2 and of the Gemma 3 270M Q4_K_M file (tests/data/gguf-blocks.gguf, made by
tests/data/make_gguf_blocks.py). The reference is the ``gguf`` package's own
``gguf.quants.dequantize``, which nobody here wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from shards import qblocks
from shards.errors import ModelError
from shards.convert import convert
from shards.ggml_blocks import repack
from shards.manifest import Manifest
from shards.model import load_stage
from shards.qlinear import QuantLinear, held_bytes
from shards.quant import dequantize_weight
from shards.span import Span
from shards.tokenizer import MeshTokenizer
from tests.test_quant import LONG  # the 100+ token prompt the int4 tests use

BLOCKS = Path(__file__).parent / "data" / "gguf-blocks.gguf"
READER = GGUFReader(str(BLOCKS))
TENSORS = {t.name: t for t in READER.tensors}
# GGUF type -> (our layout, group, the CPU kernel path it runs)
EXPECTED = {"F32": ("float", None, None), "F16": ("float", None, None), "BF16": ("float", None, None),
            "Q4_0": ("int4", 32, "blocks_cpu"), "Q4_1": ("int4", 32, "blocks_cpu"),
            "Q4_K": ("int4", 32, "blocks_cpu"), "Q8_0": ("int8", 32, "blocks_cpu"),
            "Q5_0": ("int8", 32, "blocks_cpu"), "Q5_1": ("int8", 32, "blocks_cpu"),
            "Q5_K": ("int8", 32, "blocks_cpu"), "Q6_K": ("int8", 16, "blocks_cpu")}
if qblocks.library() is None:  # no C compiler: torch's int4 kernel, one plane or two (tests/test_qblocks.py)
    EXPECTED = {k: (*v[:2], ("int4pack_cpu" if v[0] == "int4" else "planes_cpu") if v[2] == "blocks_cpu" else v[2])
                for k, v in EXPECTED.items()}


@pytest.fixture(scope="module", params=["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"])
def device(request) -> torch.device:
    """Where the kernels run: CUDA too, where there is one."""
    return torch.device(request.param)


def _repacked(name: str):
    t = TENSORS[name]
    cols, rows = (int(n) for n in t.shape)
    return repack(name, t.tensor_type, t.data, rows, cols), t


def _reference(t) -> torch.Tensor:
    cols, rows = (int(n) for n in t.shape)
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, cols))


def test_fixture_covers_every_type():
    assert {n.split(".")[0] for n in TENSORS} == set(EXPECTED)
    assert {n.split(".")[0] for n in TENSORS if ".gemma3." in n} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_repacked_blocks_dequantize_bit_for_bit(name):
    (stored, rec), t = _repacked(name)
    layout, group, _ = EXPECTED[t.tensor_type.name]
    assert (rec.layout, rec.group, rec.source) == (layout, group, t.tensor_type.name)
    want = _reference(t)
    got = stored["weight"].float() if layout == "float" else dequantize_weight(stored, layout)
    assert got.dtype == torch.float32 and torch.equal(got, want), name
    # Kept at their own size: floats as shipped, codes of 4 or 8 bits with the blocks' scales.
    per_weight = sum(v.numel() * v.element_size() for v in stored.values()) / want.numel()
    limit = {"F32": 4, "F16": 2, "BF16": 2, "int4": 0.75, "int8": 1.25}.get(t.tensor_type.name) or \
        {"int4": 0.75, "int8": 1.25}[layout]
    assert per_weight <= limit, (name, per_weight)


@pytest.mark.parametrize("name", sorted(n for n in TENSORS if EXPECTED[n.split(".")[0]][0] != "float"))
def test_quantized_linear_agrees_with_float_matmul(name, device):
    """The kernel on the repacked layout against x @ W^T of the dequantized weight (float64)."""
    (stored, rec), t = _repacked(name)
    w = dequantize_weight(stored, rec.layout).double()
    N, K = w.shape
    m = QuantLinear(K, N, rec, device=device)
    for k, v in stored.items():
        setattr(m, k, v.to(device))
    act = torch.float32 if device.type == "cpu" else torch.bfloat16
    path = m.prepare(act)
    if device.type == "cpu":
        assert path == EXPECTED[t.tensor_type.name][2]
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows in (1, 7, 64):
        x = torch.randn(rows, K, generator=gen)
        got = m(x.to(device, act)).double().cpu()
        want = x.double() @ w.T
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    print(f"{name}: {path} max relative error {worst:.2e}")
    # bf16 inputs and bf16 scales (and for Q6_K, requantized to groups of 32): about 2^-8 each;
    # the block kernel rounds its input rows to int8 blocks of 32 (as llama.cpp does).
    tol = 3e-2 if path == "blocks_cpu" else 1.5e-2 if t.tensor_type == T.Q6_K else 1e-2
    assert worst < tol, (name, worst)


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.TQ1_0, T.MXFP4, T.Q2_K, T.Q3_K, T.IQ2_XXS])
def test_unsupported_type_is_a_model_error_naming_tensor_and_type(qtype):
    from gguf.constants import GGML_QUANT_SIZES

    per, size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, 256 // per * size), dtype=np.uint8)
    with pytest.raises(ModelError, match=rf"blk\.3\.ffn_up\.weight.*{qtype.name}"):
        repack("blk.3.ffn_up.weight", qtype, raw, 4, 256)


# -- a real model, its GGUF quantization kept ----------------------------------------------

def _logits(stage, ids, device):
    with torch.inference_mode():
        x = stage.embed(torch.tensor(ids, device=device))
        return stage.head(stage(x, 0, stage.new_caches())).float().cpu()


def _extra_ggufs() -> list[str]:
    """More GGUF files to run end to end where a developer has them (``MESHD_TEST_GGUFS``,
    colon-separated: e.g. a Q4_K_M made by llama-quantize)."""
    return [p for p in os.environ.get("MESHD_TEST_GGUFS", "").split(":") if p]


@pytest.mark.real_model
@pytest.mark.parametrize("extra", [None, *_extra_ggufs()])
def test_real_model_kept_quantized_agrees_with_its_fp32_expansion(real_model_dir, real_gguf_path, real_fp32_dir,
                                                                  device, tmp_path_factory, extra):
    if extra is None:  # the default model: `meshd model fetch` keeps the Q4_1 file's quantization
        kept, src, ref_dir = real_model_dir, real_gguf_path, real_fp32_dir
    else:
        src, work = Path(extra), tmp_path_factory.mktemp("extra")
        kept = convert(src, work / "kept", name="kept", progress=False)
        ref_dir = convert(src, work / "fp32", dtype="float32", name="fp32", progress=False)
    m = Manifest.load(kept)
    assert m.quant["kind"] == "gguf" and m.quant["tensors"]
    # float32 activations on every device: the quantized linears feed their kernels bf16 (as
    # on CPU), everything else is the float32 model, so only the weights' path differs.
    n = m.n_layers
    q = load_stage(kept, Span(0, n), True, True, device, torch.float32)[0]
    f = load_stage(ref_dir, Span(0, n), True, True, device, torch.float32)[0]
    ids = MeshTokenizer.load(kept).encode(LONG)
    assert len(ids) >= 100
    got, ref = _logits(q, ids, device), _logits(f, ids, device)
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    sources = sorted({r["source"] for r in m.quant["tensors"].values()})
    print(f"{src.name} ({m.dtype}: {', '.join(sources)}) on {device}: {len(ids)}-token prompt top-1 {top1:.1%}, "
          f"max |dlogit| {(got - ref).abs().max():.3f}")
    assert top1 >= 0.97
    # Quantized files are the GGUF's size, and placement counts what they take loaded.
    gguf_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(src)).tensors)
    stored = sum(e.size for k, e in m.files.items() if k.endswith(".safetensors"))
    counted = m.embed_bytes + sum(m.layer_bytes(i) for i in range(n))
    print(f"GGUF tensors {gguf_bytes / 1e6:.1f} MB, shards {stored / 1e6:.1f} MB, placement counts "
          f"{counted / 1e6:.1f} MB")
    # (Placement counts what a CPU stage holds: with the block kernel Q5_x/Q6_K sit at the
    # file's size, below the shard's 8-bit codes.)
    assert stored <= 1.6 * gguf_bytes and counted >= min(stored, gguf_bytes) * 0.9
    if device.type == "cpu":  # what placement counts is what the loaded stage holds
        held = held_bytes(q)
        print(f"the loaded stage holds {held / 1e6:.1f} MB")
        assert abs(held - counted) <= 0.02 * counted, (held, counted)
