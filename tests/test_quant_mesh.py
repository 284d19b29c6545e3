"""A quantized model split across namespaced peers answers what it answers on one node."""

from __future__ import annotations

import pytest

from shards.convert import convert
from shards.manifest import Manifest
from tests.meshlab import complete, greedy_reference, http_json
from tests.fixtures.api import EXTRACT

PROMPT = "quantized spans"
TOKENS = 24


@pytest.fixture(scope="module")
def tiny_int4_dir(tiny_hf_dir, tmp_path_factory):
    return convert(tiny_hf_dir, tmp_path_factory.mktemp("tiny-int4") / "tiny-int4", quantize="int4",
                   quantize_head="int8", name="tiny-int4", progress=False)


@pytest.mark.netns
def test_int4_span_across_peers_equals_one_node(meshlab, tiny_int4_dir):
    assert Manifest.load(tiny_int4_dir).dtype == "int4"
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    # The layer delay makes every peer worth a span; the two without files fetch theirs.
    daemons = [
        meshlab.start(h, model=str(tiny_int4_dir) if i == 0 else "tiny-int4", vram=(3 - i) * 10**9,
                      layer_delay_ms=5.0)
        for i, h in enumerate(hosts)
    ]
    view = meshlab.wait_converged(daemons, n_stages=2)
    owners = {a["node"] for a in view["plan"]}
    assert len(owners) >= 2, view["plan"]
    entry = next(d for d in daemons if d.node_id != view["supernode"])
    got, _ = complete(entry.url, PROMPT, TOKENS)
    want = greedy_reference(tiny_int4_dir, PROMPT, TOKENS)
    assert got == want, f"mesh {got} != one node {want}" + meshlab.fail_report()
    fetched = next(d for d in daemons if d.node_id in owners and d is not daemons[0])
    assert any(fetched.state_dir.glob("models/tiny-int4/layer-*.safetensors")), "the quantized span was not fetched"


@pytest.mark.netns
@pytest.mark.real_model
def test_real_gguf_kept_quantized_across_peers_equals_one_node(meshlab, real_model_dir):
    """The default model as `meshd model fetch` gives it (the GGUF's Q4_1 layers and Q8_0
    embedding kept as shipped) on three namespaced peers, two of them fetching their spans."""
    m = Manifest.load(real_model_dir)
    assert m.quant["kind"] == "gguf" and {r["source"] for r in m.quant["tensors"].values()} == {"Q4_1", "Q8_0"}
    prompt, n = "Once upon a time, in a small village by the sea,", 24
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    daemons = [meshlab.start(h, model=str(real_model_dir) if i == 0 else m.name, vram=(3 - i) * 10**9,
                             layer_delay_ms=2.0, extra=("--speculate", "always"))  # drafts whatever they cost
               for i, h in enumerate(hosts)]
    view = meshlab.wait_converged(daemons, n_stages=2, timeout=180)
    owners = {a["node"] for a in view["plan"]}
    assert len(owners) >= 2, view["plan"]
    got, _ = complete(daemons[2].url, prompt, n)
    want = greedy_reference(real_model_dir, prompt, n)
    assert got == want, f"mesh {got} != one node {want}" + meshlab.fail_report()
    fetched = [d for d in daemons[1:] if d.node_id in owners]
    assert fetched and all(any(d.state_dir.glob(f"models/{m.name}/layer-*.safetensors")) for d in fetched)
    # Speculative decoding across the stages: an answer that repeats its prompt, drafted by
    # prompt lookup on the supernode, each draft's rows through both stages in the step:
    # the tokens one node gives one row at a time, in fewer steps than tokens.
    got, _ = complete(daemons[2].url, EXTRACT, 40)
    assert got == greedy_reference(real_model_dir, EXTRACT, 40), meshlab.fail_report()
    supernode = next(d for d in daemons if d.node_id == view["supernode"])
    spec = http_json(supernode.url + "/status")[1]["node"]["scheduler"]["speculation"]
    assert spec["accepted"] > 0 and spec["tokens_per_step"] > 1, spec
    if view["plan"][0]["node"] == view["supernode"]:
        # Its own first span ran next steps ahead while the other stage ran this one (used
        # where a step took its whole draft and the guessed token after it), and the tokens
        # above are one node's all the same. (tests/test_pipeline.py: a look-ahead used and
        # one missed, each giving one engine's tokens.)
        assert spec["ahead"] > 0, spec
