"""Conversion: HF and GGUF sources into model directories, checked against their sources."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from structlog.testing import capture_logs

from meshd.errors import ModelError, ShardCorrupt, ShardMissing
from shards.convert import convert
from shards.fetch import resolve_model
from shards.gguf_source import unpermute_rope
from shards.manifest import MANIFEST_FILE, Manifest, check_file_name, layer_file, sha256_file
from shards.model import load_stage
from shards.span import Span

LAYER_TENSORS = {
    "attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
    "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
    "feed_forward.w3.weight",
}


def _keys(path):
    with safe_open(str(path), framework="pt") as st:
        return set(st.keys())


def test_tiny_hf_convert_layout(tiny_hf_dir, tiny_model_dir):
    m = Manifest.load(tiny_model_dir)
    want = {"manifest.json"} | set(m.files)
    assert {p.name for p in tiny_model_dir.iterdir()} == want  # no temp files left behind
    assert set(m.files) == {"tokenizer.json", "embed.safetensors"} | {layer_file(i) for i in range(6)}
    assert m.n_layers == 6 and m.config.n_kv_heads == 2 and not m.config.tie_embeddings
    assert m.config.rope_theta == 50000.0
    for name, entry in m.files.items():
        path = tiny_model_dir / name
        assert path.stat().st_size == entry.size
        assert sha256_file(path) == entry.sha256
    assert _keys(tiny_model_dir / "embed.safetensors") == {"tok_embeddings.weight", "norm.weight", "output.weight"}
    assert _keys(tiny_model_dir / "layer-003.safetensors") == LAYER_TENSORS
    # The tokenizer is theirs, byte for byte; the chat template came from tokenizer_config.json.
    assert (tiny_model_dir / "tokenizer.json").read_bytes() == (tiny_hf_dir / "tokenizer.json").read_bytes()
    assert m.chat_template and "<|im_start|>" in m.chat_template


def test_tiny_hf_tensors_match_source(tiny_hf_dir, tiny_model_dir):
    """Tensors from both HF shards land, unchanged, under our names."""
    index = json.loads((tiny_hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2
    pairs = [("model.layers.4.self_attn.q_proj.weight", "layer-004.safetensors", "attention.wq.weight"),
             ("model.layers.0.mlp.down_proj.weight", "layer-000.safetensors", "feed_forward.w2.weight"),
             ("model.embed_tokens.weight", "embed.safetensors", "tok_embeddings.weight"),
             ("lm_head.weight", "embed.safetensors", "output.weight")]
    for theirs, file, ours in pairs:
        with safe_open(str(tiny_hf_dir / index[theirs]), framework="pt") as a, \
                safe_open(str(tiny_model_dir / file), framework="pt") as b:
            assert torch.equal(a.get_tensor(theirs), b.get_tensor(ours)), theirs


def test_rerun_is_a_noop(tiny_hf_dir, tiny_model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    with capture_logs() as logs:
        convert(tiny_hf_dir, tiny_model_dir, progress=False)
    assert [e["event"] for e in logs] == ["convert_skipped"]
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before


def test_bfloat16_conversion(tiny_hf_dir, tmp_path):
    out = convert(tiny_hf_dir, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert Manifest.load(out).dtype == "bfloat16"
    with safe_open(str(out / "layer-000.safetensors"), framework="pt") as st:
        assert st.get_tensor("attention.wq.weight").dtype == torch.bfloat16


@pytest.fixture
def tiny_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "copy")


def test_truncated_shard_named(tiny_copy):
    path = tiny_copy / "layer-002.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    m = Manifest.load(tiny_copy)
    m.verify(tiny_copy, ["layer-001.safetensors"])  # the others still check out
    with pytest.raises(ShardCorrupt, match="layer-002.safetensors"):
        m.verify(tiny_copy, m.files_for(Span(0, 6), embed=True))
    with pytest.raises(ShardCorrupt, match="layer-002"):
        load_stage(tiny_copy, Span(2, 3), False, False)
    load_stage(tiny_copy, Span(3, 6), False, True)  # a span without it loads


def test_flipped_byte_named(tiny_copy):
    path = tiny_copy / "embed.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # same size: only the sha256 can tell
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match="embed.safetensors.*sha256"):
        Manifest.load(tiny_copy).verify(tiny_copy)


def test_missing_shard_named(tiny_copy):
    (tiny_copy / "layer-005.safetensors").unlink()
    with pytest.raises(ShardMissing, match="layer-005.safetensors"):
        load_stage(tiny_copy, Span(4, 6), False, True)


def test_rerun_repairs_a_corrupt_directory(tiny_hf_dir, tiny_copy):
    (tiny_copy / "layer-001.safetensors").write_bytes(b"garbage")
    with capture_logs() as logs:
        convert(tiny_hf_dir, tiny_copy, name="tiny-llama", progress=False)
    assert "convert_done" in [e["event"] for e in logs]
    Manifest.load(tiny_copy).verify(tiny_copy)


def test_half_finished_conversion_is_not_a_model(tiny_copy):
    (tiny_copy / MANIFEST_FILE).unlink()
    with pytest.raises(ModelError, match="not a model directory"):
        resolve_model(tiny_copy.parent, str(tiny_copy))
    with pytest.raises(ModelError, match="meshd model fetch"):
        resolve_model(tiny_copy.parent, "smollm2-135m")


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/etc/passwd", "sub/layer.safetensors",
                                 "..", "", "a\\b"])
def test_manifest_refuses_escaping_names(tiny_model_dir, bad):
    with pytest.raises(ModelError, match="outside"):
        check_file_name(bad)
    data = json.loads((tiny_model_dir / MANIFEST_FILE).read_text())
    data["files"][bad] = {"sha256": "0" * 64, "size": 1}
    with pytest.raises(ModelError):
        Manifest.from_bytes(json.dumps(data).encode())


def test_files_for_and_sizes(tiny_model_dir):
    m = Manifest.load(tiny_model_dir)
    assert m.files_for(Span(2, 4), embed=False) == ["layer-002.safetensors", "layer-003.safetensors"]
    assert m.files_for(None, embed=True) == ["embed.safetensors", "tokenizer.json"]
    with pytest.raises(ModelError):
        m.files_for(Span(4, 7), embed=False)
    assert m.layer_bytes(0) == (tiny_model_dir / "layer-000.safetensors").stat().st_size
    assert m.embed_bytes == (tiny_model_dir / "embed.safetensors").stat().st_size
    import hashlib
    assert m.digest == hashlib.sha256((tiny_model_dir / MANIFEST_FILE).read_bytes()).hexdigest()


@pytest.mark.real_model
def test_gguf_convert_real(real_fp32_dir, real_gguf_path):
    """``--dtype float32``: every tensor dequantized (the default keeps the GGUF's own
    quantization: tests/test_gguf_quant.py)."""
    real_model_dir = real_fp32_dir
    m = Manifest.load(real_model_dir)
    assert m.dtype == "float32" and m.quant is None
    c = m.config
    assert (c.n_layers, c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim) == \
        (30, 576, 1536, 9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.vocab_size, c.tie_embeddings) == (100000.0, 1e-5, 49152, True)
    assert c.bos_token_id == 1 and 2 in c.eos_token_ids and c.max_position == 8192
    assert len(m.files) == 32 and "tokenizer.json" in m.files
    assert _keys(real_model_dir / "embed.safetensors") == {"tok_embeddings.weight", "norm.weight"}
    assert _keys(real_model_dir / "layer-029.safetensors") == LAYER_TENSORS

    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(real_gguf_path))
    raw = {t.name: t for t in reader.tensors}

    def deq(name):
        t = raw[name]
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's permute, verbatim in effect
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    with safe_open(str(real_model_dir / "layer-007.safetensors"), framework="pt") as st:
        wq, wk, wv = (st.get_tensor(f"attention.{n}.weight") for n in ("wq", "wk", "wv"))
    # Our Q/K are exactly the rows llama.cpp permuted, put back; V is untouched.
    assert torch.equal(llama_cpp_permute(wq, 9), deq("blk.7.attn_q.weight"))
    assert torch.equal(llama_cpp_permute(wk, 3), deq("blk.7.attn_k.weight"))
    assert not torch.equal(wq, deq("blk.7.attn_q.weight"))
    assert torch.equal(wv, deq("blk.7.attn_v.weight"))
    w = torch.randn(192, 8)
    assert torch.equal(llama_cpp_permute(unpermute_rope(w, 3), 3), w)


@pytest.mark.real_model
def test_gguf_rerun_is_a_noop(real_model_dir, real_gguf_path):
    manifest_before = (real_model_dir / MANIFEST_FILE).read_bytes()
    with capture_logs() as logs:
        convert(real_gguf_path, real_model_dir, name=Manifest.load(real_model_dir).name, progress=False)
    assert [e["event"] for e in logs] == ["convert_skipped"]
    assert (real_model_dir / MANIFEST_FILE).read_bytes() == manifest_before


def test_interrupted_conversion_leaves_no_manifest(tiny_hf_dir, tiny_copy, monkeypatch):
    from shards.hf_source import HFSource

    real = HFSource.layer_tensors

    def dies_at_layer_3(self, i):
        if i == 3:
            raise KeyboardInterrupt  # the user pressed ^C mid-way
        return real(self, i)

    monkeypatch.setattr(HFSource, "layer_tensors", dies_at_layer_3)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_hf_dir, tiny_copy, dtype="bfloat16", progress=False)
    # The old manifest went first (its files are being replaced); no new one was written.
    assert not (tiny_copy / MANIFEST_FILE).exists()
    assert not list(tiny_copy.glob(".*.tmp"))
    with pytest.raises(ModelError):
        Manifest.load(tiny_copy)


def test_state_dir_models(tiny_model_dir, tmp_path):
    from shards.fetch import KNOWN_MODELS, list_models

    state = tmp_path / "state"
    assert list_models(state) == []
    shutil.copytree(tiny_model_dir, state / "models" / "tiny-llama")
    (state / "models" / "half-done").mkdir()  # no manifest: not listed
    assert [m.name for m in list_models(state)] == ["tiny-llama"]
    assert resolve_model(state, "tiny-llama") == state / "models" / "tiny-llama"
    assert resolve_model(state, str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ModelError, match="meshd model convert"):
        resolve_model(state, "no-such-model")
    assert KNOWN_MODELS["smollm2-135m"].member.endswith(".gguf")


def test_unknown_source_refused(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"not a model")
    with pytest.raises(ModelError, match="neither a GGUF"):
        convert(tmp_path / "x.bin", tmp_path / "out", progress=False)
