"""Safe loading, beyond tests/test_convert.py: what ``StageEngine.load`` (the daemon's
loader) does with a model directory someone has tampered with.

- a shard altered in place, size kept: refused by its sha256 before any tensor is read,
  the error naming the file;
- pickle: a manifest that names ``.bin`` / ``.pt`` files instead of our safetensors is
  refused, and a pickle written under a ``.safetensors`` name with a manifest that
  vouches for it is refused as "not safetensors" (a ModelError, which a daemon turns
  into a Reject); nothing is ever unpickled (``pickle`` and ``torch.load`` are
  booby-trapped for the duration);
- a manifest whose file names point outside the directory is refused at load.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil

import pytest
import torch

from meshd.errors import KNOWN_ERRORS, ModelError, ShardCorrupt
from shards.engine import StageEngine
from shards.manifest import MANIFEST_FILE, Manifest, layer_file
from shards.span import Span


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


@pytest.fixture
def no_unpickling(monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("the loader unpickled something")

    monkeypatch.setattr(torch, "load", trap)
    monkeypatch.setattr(pickle, "load", trap)
    monkeypatch.setattr(pickle, "loads", trap)
    monkeypatch.setattr(pickle, "Unpickler", trap)


def rewrite_manifest(model_dir, edit) -> None:
    data = json.loads((model_dir / MANIFEST_FILE).read_text())
    edit(data)
    (model_dir / MANIFEST_FILE).write_text(json.dumps(data))


def vouch(model_dir, name: str) -> None:
    """Make the manifest's size and sha256 for ``name`` those of the file now there."""
    raw = (model_dir / name).read_bytes()

    def edit(data):
        data["files"][name] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}

    rewrite_manifest(model_dir, edit)


def load(model_dir, span=Span(0, 3), embed=False, head=False) -> StageEngine:
    return StageEngine.load(model_dir, span, embed, head, "cpu", "float32")


def test_a_shard_altered_in_place_is_refused_by_sha256(model):
    for name, span, embed in ((layer_file(1), Span(0, 3), False), ("embed.safetensors", None, True)):
        path = model / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40  # inside the tensor data, the header still parses
        path.write_bytes(bytes(data))
        with pytest.raises(ShardCorrupt, match=rf"{name}.*sha256"):
            load(model, span, embed=embed, head=embed)
    # A span that does not touch the altered layer still loads.
    load(model, Span(3, 6)).close()


def test_a_shard_altered_after_a_good_load_is_hashed_again(model):
    """Loads skip re-hashing files unchanged since they last checked out; a change
    made after one, even with the old size and mtime put back, is still caught."""
    import os

    load(model).close()  # checks out, and is remembered as such
    load(model).close()  # unchanged: loads again (from the remembered check)
    path = model / layer_file(1)
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime as it was
    with pytest.raises(ShardCorrupt, match=rf"{layer_file(1)}.*sha256"):
        load(model)


def test_pickle_named_in_a_manifest_is_refused(model, no_unpickling):
    n = Manifest.load(model).n_layers
    # A .bin (pickle) in place of a layer's safetensors file, listed in the manifest.
    (model / "layer-000.bin").write_bytes(pickle.dumps({"attention.wq.weight": [0.0]}))
    (model / layer_file(0)).unlink()
    vouch(model, "layer-000.bin")
    rewrite_manifest(model, lambda d: d["files"].pop(layer_file(0)))
    with pytest.raises(ModelError, match=layer_file(0)):
        load(model, Span(0, n))
    # The other layers are unaffected.
    load(model, Span(1, n)).close()


def test_pickle_under_a_safetensors_name_is_refused(model, no_unpickling, tmp_path):
    path = model / layer_file(2)
    torch.save({"attention.wq.weight": torch.zeros(4)}, tmp_path / "evil.pt")
    path.write_bytes((tmp_path / "evil.pt").read_bytes())
    vouch(model, layer_file(2))  # the manifest vouches for it: only the format can tell
    with pytest.raises(ModelError, match=layer_file(2)) as info:
        load(model, Span(2, 3))
    assert isinstance(info.value, KNOWN_ERRORS)  # what a daemon catches, to Reject the plan
    load(model, Span(3, 6)).close()


@pytest.mark.parametrize("bad", ["../layer-000.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_manifest_pointing_outside_is_refused_at_load(model, bad, no_unpickling):
    (model.parent / "layer-000.safetensors").write_bytes((model / layer_file(0)).read_bytes())
    rewrite_manifest(model, lambda d: d["files"].__setitem__(bad, {"sha256": "0" * 64, "size": 1}))
    with pytest.raises(ModelError, match="outside"):
        load(model, Span(0, 1))


@pytest.mark.parametrize("quant", ["int8", {"tensors": []}, {"tensors": {"layers.0.attention.wq.weight": []}}],
                         ids=["a-string", "tensors-a-list", "a-record-a-list"])
def test_a_manifests_quant_of_the_wrong_shape_is_a_model_error(model, quant):
    """A peer's manifest is read before any tensor: values of the wrong type are a refusal
    (a Reject of the plan), never a crash of the task loading it, nor of the next start."""
    rewrite_manifest(model, lambda d: d.__setitem__("quant", quant))
    with pytest.raises(ModelError):
        load(model, Span(0, 1))


def test_a_shards_tensor_of_the_wrong_dtype_or_shape_is_a_model_error(model):
    from safetensors.torch import load_file, save_file

    path = model / layer_file(0)
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("norm.weight"))
    for bad in (tensors[name].to(torch.int8), torch.zeros(3)):
        save_file(tensors | {name: bad}, path)
        vouch(model, layer_file(0))
        with pytest.raises(ModelError, match="does not load"):
            load(model, Span(0, 1))


@pytest.mark.parametrize("bad", ["manifest.json", ".hidden.safetensors", "x" * 300 + ".safetensors"],
                         ids=["the-manifest", "hidden", "300-bytes"])
def test_a_manifest_naming_itself_a_hidden_file_or_a_name_too_long_is_refused(model, bad):
    rewrite_manifest(model, lambda d: d["files"].__setitem__(bad, {"sha256": "0" * 64, "size": 1}))
    with pytest.raises(ModelError, match="not a shard file"):
        Manifest.load(model)


def test_a_tokenizer_whose_regex_panics_is_a_model_error_not_a_base_exception(model):
    """A pre-tokenizer regex that hits the regex engine's limit on ordinary text: the
    tokenizers library panics, which pyo3 raises as a BaseException that passes every
    ``except Exception`` (a handler, a task group). It is a ModelError here."""
    from shards.tokenizer import MeshTokenizer

    data = json.loads((model / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(.*?.){12}$."}, "behavior": "Isolated", "invert": False},
        data["pre_tokenizer"]]}
    (model / "tokenizer.json").write_text(json.dumps(data))
    vouch(model, "tokenizer.json")
    tok = MeshTokenizer.load(model)
    with pytest.raises(ModelError, match="tokenizer failed"):
        tok.encode("Hello, how are you today? Tell me a story about the sea and the ships.")
    (model / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="does not load"):
        MeshTokenizer.load(model)


@pytest.mark.parametrize("edit", [
    {"query_scale": "x"}, {"embed_scale": -1.0}, {"final_softcap": float("inf")}, {"sliding_window": 0},
    {"rope_scaling": {"kind": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0,
                      "original_max_position": 8192}},
    {"rope_scaling": {"kind": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                      "original_max_position": 8192}},
    {"rope_scaling": {"kind": "factors", "freq_factors": [1.0, 2.0, 3.0]}},
], ids=["query-scale-string", "embed-scale-negative", "softcap-inf", "window-0", "llama3-low-0",
        "llama3-low-equals-high", "factors-too-few"])
def test_a_config_value_that_would_fail_mid_forward_is_refused_when_read(model, edit):
    """Values read once and used at every forward (a ZeroDivisionError there would end the
    link that carried the step): refused when the manifest is read."""
    rewrite_manifest(model, lambda d: d["config"].update(edit))
    with pytest.raises(ModelError):
        Manifest.load(model)
