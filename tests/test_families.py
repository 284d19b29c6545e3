"""Every family against transformers on the same weights: tiny random models saved as
Hugging Face directories (tests/tinyfamilies.py), converted by meshd, run as 3 spans in
sequence; and the same models as GGUF files written by llama.cpp's own converter.

Logits of a prompt equal transformers' forward (fp32, max |Δ| <= 1e-4) and 32 greedy
tokens are equal, including a Llama 3.1 prompt past its rope scaling's low-frequency
boundary and Mistral / Gemma 3 / Phi-3 prompts longer than their sliding windows. The
device is CUDA where there is one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shards.convert import convert
from shards.engine import generate_greedy
from shards.manifest import Manifest
from shards.model import load_stage
from shards.span import Span
from tests.tinyfamilies import CASE, CASES, load_reference, reference_greedy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

TOL = 1e-4
GREEDY = 32
GGUF_CASES = [c.name for c in CASES if c.gguf_prompt_len is not None]


def _spans(n_layers: int) -> list[Span]:
    a, b = max(1, n_layers // 3), max(2, 2 * n_layers // 3)
    return [Span(0, a), Span(a, b), Span(b, n_layers)]


def _stages(model_dir: Path, device: str):
    n = Manifest.load(model_dir).n_layers
    spans = _spans(n)
    return [load_stage(model_dir, s, i == 0, i == len(spans) - 1, device, torch.float32)[0]
            for i, s in enumerate(spans)]


def _prompt(vocab: int, n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _logits(stages, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x = stages[0].embed(torch.tensor(ids, device=stages[0].device))
        for s in stages:
            x = s(x, 0, s.new_caches())
        return stages[-1].head(x).cpu()


@pytest.fixture(scope="module")
def references(family_dirs, device):
    """transformers' model of each case, loaded once."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_reference(family_dirs[name], device)
        return cache[name]
    return get


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_hf_dir_matches_transformers(name, family_dirs, family_models, references, device):
    case = CASE[name]
    model_dir = family_models(name, "hf")
    m = Manifest.load(model_dir)
    assert m.architecture == case.family
    stages = _stages(model_dir, device)
    ids = _prompt(m.config.vocab_size, case.prompt_len)
    want, want_logits = reference_greedy(references(name), ids, GREEDY)
    got_logits = _logits(stages, ids)
    diff = (got_logits - want_logits).abs().max().item()
    got = generate_greedy(stages, ids, GREEDY)
    print(f"\n{name}: {case.prompt_len}-token prompt, max |Δlogit| {diff:.2e}; {GREEDY} greedy tokens equal: "
          f"{got == want}")
    assert diff <= TOL
    assert got == want


@pytest.mark.parametrize("name", GGUF_CASES)
def test_llama_cpp_gguf_matches_transformers(name, family_models, references, device):
    case = CASE[name]
    model_dir = family_models(name, "gguf")
    m = Manifest.load(model_dir)
    assert m.architecture == case.family if case.family != "mistral" else m.architecture == "llama"
    stages = _stages(model_dir, device)
    ids = _prompt(m.config.vocab_size, case.gguf_prompt_len, seed=2)
    _, want_logits = reference_greedy(references(name), ids, 1)
    diff = (_logits(stages, ids) - want_logits).abs().max().item()
    print(f"\n{name} from llama.cpp's GGUF: {case.gguf_prompt_len}-token prompt, max |Δlogit| {diff:.2e}")
    assert diff <= TOL


def test_gguf_and_hf_conversions_agree_on_the_config(family_models):
    """What each family reads from llama.cpp's metadata is what it reads from config.json
    (Mistral aside: llama.cpp writes it as a Llama without its window)."""
    for name in GGUF_CASES:
        hf = Manifest.load(family_models(name, "hf")).config.to_dict()
        gg = Manifest.load(family_models(name, "gguf")).config.to_dict()
        for key in ("rope_scaling", "max_position", "eos_token_ids"):  # said differently by the two formats
            hf.pop(key, None), gg.pop(key, None)
        if name == "mistral":
            assert "sliding_window" not in gg and hf.pop("sliding_window") == 8
            hf.pop("layer_types")
        assert gg == hf, name


def test_llama31_config_and_stops(family_models):
    hf = Manifest.load(family_models("llama31", "hf")).config
    gg = Manifest.load(family_models("llama31", "gguf")).config
    assert hf.rope_scaling.kind == "llama3" and hf.rope_scaling.original_max_position == 32
    assert gg.rope_scaling.kind == "factors" and len(gg.rope_scaling.freq_factors) == hf.head_dim // 2
    from shards.tokenizer import MeshTokenizer

    tok = MeshTokenizer.load(family_models("llama31", "hf"))
    # Every end id of the model stops: end of turn and end of text.
    assert {tok.token_id("<|eot_id|>"), tok.token_id("<|end_of_text|>")} <= tok.eos_ids


def test_manifest_switches(family_models):
    g = Manifest.load(family_models("gemma3", "hf")).config
    assert g.layer_types == ("sliding",) * 5 + ("full",) and g.rope_local_theta == 10000.0
    assert g.qk_norm and g.sandwich_norms and g.hidden_act == "gelu_tanh" and g.embed_scale == 8.0
    q = Manifest.load(family_models("qwen2", "gguf")).config
    assert q.attn_bias and not q.qk_norm
    d = Manifest.load(family_models("llama-dynamic", "hf")).config
    assert d.rope_scaling.original_max_position == 32 and d.max_position == 64  # the engine's context limit
    raw = json.loads((family_models("qwen3", "hf") / "manifest.json").read_text())["config"]
    assert raw["qk_norm"] is True and "attn_bias" not in raw  # defaults stay out of the manifest


def test_converted_once_per_source(family_models, family_dirs, tmp_path):
    """A GGUF written by llama.cpp converts to the same tensors as its HF directory (up to
    llama.cpp's Q/K row order, undone, and Gemma's norm offset, added on the HF side)."""
    from safetensors.torch import load_file

    for name in ("gemma3", "phi3", "llama31"):
        a, b = family_models(name, "hf"), family_models(name, "gguf")
        for f in ("embed.safetensors", "layer-001.safetensors"):
            ta, tb = load_file(str(a / f)), load_file(str(b / f))
            assert set(ta) == set(tb), (name, f)
            for k in ta:
                assert torch.allclose(ta[k], tb[k], atol=1e-6), (name, f, k)


# -- what the forward does not do is refused at conversion, naming it ---------------------------


def _hf_dir(tmp_path: Path, **config) -> Path:
    from safetensors.torch import save_file

    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(base | config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("config, named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
    ({"architectures": ["MixtralForCausalLM"]}, "MixtralForCausalLM"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"attention_bias": True}, "attention_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unsupported_hf_config_is_refused(tmp_path, config, named):
    from meshd.errors import ModelError

    with pytest.raises(ModelError, match=named.replace("(", r"\(").replace("[", r"\[")):
        convert(_hf_dir(tmp_path, **config), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def _gguf(path: Path, arch: str = "llama", extra: dict | None = None, tensors: tuple[str, ...] = ()) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16, "context_length": 64,
                       "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-5}.items():
        w.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                        else gguf.GGUFValueType.UINT32)
    for key, value in (extra or {}).items():
        w.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                        else gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(65 + i) for i in range(10)])
    for name in tensors:
        w.add_tensor(name, np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, extra, tensors, named", [
    ("llama", {"attn_logit_softcapping": 50.0}, (), "llama.attn_logit_softcapping"),
    ("llama", {"expert_count": 8}, (), "expert_count=8"),
    ("llama", {"rope.scaling.type": "yarn"}, (), "rope.scaling.type='yarn'"),
    ("qwen2", {"rope.dimension_count": 2}, (), "rope.dimension_count=2"),
    ("llama", {}, ("blk.0.attn_q.bias",), "blk.0.attn_q.bias"),
    ("deepseek2", {}, (), "'deepseek2' is not supported"),
])
def test_unsupported_gguf_is_refused(tmp_path, arch, extra, tensors, named):
    from meshd.errors import ModelError

    with pytest.raises(ModelError, match=named.replace("(", r"\(")):
        convert(_gguf(tmp_path / "m.gguf", arch, extra, tensors), tmp_path / "out", progress=False)


def test_unknown_architecture_in_a_manifest_is_refused(family_models, tmp_path):
    import shutil

    from meshd.errors import ModelError

    d = shutil.copytree(family_models("qwen2", "hf"), tmp_path / "m")
    raw = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(raw | {"architecture": "mamba"}))
    with pytest.raises(ModelError, match="'mamba' is not supported"):
        load_stage(d, Span(0, 1), True, False, verify=False)


def test_quantized_qwen2_keeps_its_biases(family_dirs, family_models, tmp_path):
    """Weight-only quantization leaves biases in float and applies them (Qwen2's q, k, v)."""
    src = family_models("qwen2", "hf")
    q = convert(family_dirs["qwen2"], tmp_path / "q8", quantize="int8", name="q8", progress=False)
    f, _ = load_stage(src, Span(0, 3), True, True)
    s, _ = load_stage(q, Span(0, 3), True, True)
    for i in range(3):  # q, k and v run as one fused matmul: their biases are its bias, in turn
        want, got = (st.layers[str(i)].attention.wqkv.bias for st in (f, s))
        assert want is not None and torch.equal(got, want)
    ids = torch.arange(1, 25)
    with torch.inference_mode():
        a, b = (st.head(st(st.embed(ids), 0, st.new_caches())) for st in (f, s))
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


@pytest.mark.parametrize("name", ["mistral", "gemma3", "llama-dynamic"])
def test_batched_sessions_equal_each_alone(name, family_models):
    """Sliding windows and dynamic rope are per session in a batched step: two sessions at
    different positions, stepped together, get what each gets alone."""
    d = family_models(name, "hf")
    stage = load_stage(d, Span(0, Manifest.load(d).n_layers), True, True)[0]
    vocab = stage.config.vocab_size
    a, b = _prompt(vocab, 40, seed=3), _prompt(vocab, 11, seed=4)
    with torch.inference_mode():
        alone = []
        for ids in (a, b):
            c = stage.new_caches()
            stage(stage.embed(torch.tensor(ids[:-1])), 0, c)
            alone.append(stage.head(stage(stage.embed(torch.tensor(ids[-1:])), len(ids) - 1, c)))
        ca, cb = stage.new_caches(), stage.new_caches()
        stage(stage.embed(torch.tensor(a[:-1])), 0, ca)
        stage(stage.embed(torch.tensor(b[:-5])), 0, cb)
        # a decodes one row while b prefills its last five, in one forward
        x = stage.forward_batch(stage.embed(torch.tensor(a[-1:] + b[-5:])), [(len(a) - 1, 1, ca), (len(b) - 5, 5, cb)])
        both = stage.head(x)
    assert torch.allclose(both[0], alone[0][0], atol=1e-5)
    assert torch.allclose(both[-1], alone[1][0], atol=1e-5)
