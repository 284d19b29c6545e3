"""A tiny random-weight Llama written as a Hugging Face directory, for tests.

The weights are random but the directory is real: config.json, sharded safetensors with an
index, and a byte-level BPE tokenizer.json trained here with the ChatML specials, so tests
exercise the same converter and loader a user's model goes through.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shards.hf_source import EMBED_NAMES, LAYER_NAMES

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A mesh of small machines runs one model that none of them could hold alone.",
    "Hello, world! Numbers 0123456789 and symbols #$%&*() live here too.",
    "Café, naïve, 日本語, emoji 🙂 and 🚀 are bytes to a byte-level tokenizer.",
    "<|im_start|>user\nWhat is a transformer layer?<|im_end|>\n<|im_start|>assistant\n",
] * 20
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def write_tiny_hf_model(out_dir: Path, seed: int = 0, n_layers: int = 6, hidden: int = 64, heads: int = 4,
                        kv_heads: int = 2, intermediate: int = 128, vocab: int = 300,
                        rope_theta: float = 50000.0, tied: bool = False) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight() -> torch.Tensor:  # near one, not exactly, so a lost norm shows
        return 1.0 + rand(hidden, std=0.1)

    # std ~ 1/sqrt(fan_in): activations stay O(1) and greedy output varies with context.
    embed = {"tok_embeddings.weight": rand(vocab_size, hidden, std=1.0), "norm.weight": norm_weight()}
    if not tied:
        embed["output.weight"] = rand(vocab_size, hidden, std=hidden ** -0.5)
    tensors = {EMBED_NAMES[k]: v for k, v in embed.items()}
    for i in range(n_layers):
        layer = {
            "attention_norm.weight": norm_weight(),
            "attention.wq.weight": rand(heads * head_dim, hidden, std=hidden ** -0.5),
            "attention.wk.weight": rand(kv_heads * head_dim, hidden, std=hidden ** -0.5),
            "attention.wv.weight": rand(kv_heads * head_dim, hidden, std=hidden ** -0.5),
            "attention.wo.weight": rand(hidden, heads * head_dim, std=(heads * head_dim) ** -0.5),
            "ffn_norm.weight": norm_weight(),
            "feed_forward.w1.weight": rand(intermediate, hidden, std=hidden ** -0.5),
            "feed_forward.w2.weight": rand(hidden, intermediate, std=intermediate ** -0.5),
            "feed_forward.w3.weight": rand(intermediate, hidden, std=hidden ** -0.5),
        }
        tensors |= {LAYER_NAMES[k].format(i=i): v for k, v in layer.items()}

    # Two shards with an index, as Hugging Face writes larger models.
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map: dict[str, str] = {}
    for n, part in enumerate(halves, 1):
        fname = f"model-{n:05d}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tied,
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return out
