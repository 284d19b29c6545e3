"""Our forward against Hugging Face transformers' LlamaForCausalLM on the same weights.

The transformers model is built from our own shard files (renamed back with the HF name
table, nothing re-permuted, since we store the rotate-half layout transformers uses), so a
match checks our attention, rope, norms and head, and the GGUF conversion behind them.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shards.engine import generate_greedy
from shards.hf_source import EMBED_NAMES, LAYER_NAMES
from shards.manifest import EMBED_FILE, Manifest, layer_file
from shards.model import load_stage
from shards.span import Span
from shards.tokenizer import MeshTokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]


def hf_model_from_shards(model_dir):
    m = Manifest.load(model_dir)
    c = m.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) or None, attn_implementation="eager", dtype=torch.float32)
    state = {}
    for ours, t in load_file(str(model_dir / EMBED_FILE)).items():
        state[EMBED_NAMES[ours]] = t
    if c.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for i in range(c.n_layers):
        for ours, t in load_file(str(model_dir / layer_file(i))).items():
            state[LAYER_NAMES[ours].format(i=i)] = t
    model = transformers.LlamaForCausalLM(cfg)  # on CPU, so its rope buffers are real
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if c.tie_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def hf_greedy(model, ids, n):
    """Greedy with transformers' own KV cache; returns tokens, the prompt's logits and, per
    step, how far its top token led the next one (relative to the largest logit)."""
    out, margins, past = [], [], None
    feed = torch.tensor([ids])
    with torch.inference_mode():
        for step in range(n):
            res = model(input_ids=feed, past_key_values=past, use_cache=True)
            if step == 0:
                prompt_logits = res.logits[0].float()
            past = res.past_key_values
            last = res.logits[0, -1].float()
            top = last.topk(2).values
            margins.append(float((top[0] - top[1]) / last.abs().max()))
            nxt = int(last.argmax())
            out.append(nxt)
            feed = torch.tensor([[nxt]])
    return out, prompt_logits, margins


# Two float32 implementations sum in different orders (and with the threads the process
# has): where transformers' own top two tokens are this close, either may win, and the
# greedy continuations part there without either being wrong. Measured on SmolLM2 fp32:
# logits agree to ~1e-6 relative, so a real divergence shows far above this.
TIE = 1e-5


def same_greedy(got, want, margins) -> bool:
    """Token for token, up to a step where transformers' top two were tied."""
    for g, w, margin in zip(got, want, margins):
        if g != w:
            return margin < TIE
    return len(got) == len(want)


def _compare(model_dir, stage, n):
    tok = MeshTokenizer.load(model_dir)
    hf = hf_model_from_shards(model_dir)
    worst = 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        want, hf_logits, margins = hf_greedy(hf, ids, n)
        with torch.inference_mode():
            ours_logits = stage.head(stage(stage.embed(torch.tensor(ids)), 0, stage.new_caches()))
        diff = (ours_logits - hf_logits).abs().max().item()
        rel = diff / hf_logits.abs().max().item()
        worst = max(worst, rel)
        got = generate_greedy(stage, ids, n)
        print(f"\n{prompt!r}: max abs logit diff {diff:.3e} (relative {rel:.2e}); "
              f"{n} greedy tokens equal: {got == want}; text {tok.decode(got)!r}")
        assert same_greedy(got, want, margins), (got, want, margins)
        assert rel < 1e-3
    return worst


def test_tiny_matches_transformers(tiny_model_dir):
    stage = load_stage(tiny_model_dir, Span(0, 6), True, True)[0]
    _compare(tiny_model_dir, stage, 32)


@pytest.mark.real_model
@pytest.mark.timeout(900)  # 30 fp32 layers twice over on a shared box: minutes when the suite runs beside it
def test_real_matches_transformers(real_fp32_dir, real_stage):
    _compare(real_fp32_dir, real_stage, 24)
