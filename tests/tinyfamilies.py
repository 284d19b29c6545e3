"""Tiny random-weight models of every family, made with transformers and saved as Hugging
Face directories with a tokenizer and the family's real chat template, for the parity tests.

Each ``Case`` is one family's config (small sizes, but every switch its real models use:
rope scaling, sliding windows, biases, norms, fused projections). Tokenizers:

- SentencePiece families (Mistral, Gemma 3, Phi-3, Llama 2 style) get a vocabulary trained
  here with ``sentencepiece`` (``tokenizer.model``, which llama.cpp's converter reads), made a
  Hugging Face tokenizer by transformers itself;
- byte-level families (Llama 3, Qwen2/3) get their real vocabulary, from the vocab GGUF files
  llama.cpp keeps with its tokenizer tests, as a tokenizer.json (the tests check that
  tokenizer against llama.cpp's recorded outputs of the original one, and llama.cpp's
  converter accepts it only if it splits text as the original does).

Templates are the real ones llama.cpp keeps (``models/templates``); Gemma 3's is not there,
so the tiny Gemma has Gemma 2's, the same turn format.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A mesh of small machines runs one model that none of them could hold alone.",
    "Hello, world! Numbers 0123456789 and symbols #$%&*() live here too.",
    "Café, naïve, 日本語, emoji 🙂 and 🚀, Ærøskøbing — “quotes” …",
    "    def f(x):\n        return x + 1  # indented code\n\tand tabs\n\n\nnewlines",
    "What is the capital of France? Paris is the capital of France.",
]

# What tokenizers are checked on: ASCII, contractions, whitespace runs, Unicode, emoji, digits.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world!", "I've been 'told' he's there, 'RE you sure?",
    " leading space", "  two leading", "trailing   ", "tabs\tand\nnewlines\n\n\nthree\r\n", "   ", "\n", "",
    "    def f(x):\n        return x + 1", "Unicode: café naïve Ærøskøbing — “quotes” …",
    "CJK: 日本語のテキスト 中文 한국어", "Emoji: 🙂🚀👩‍👩‍👧 🇫🇷", "digits 1234567890 3.14159 12,345",
]


@dataclass(frozen=True)
class Vocab:
    size: int
    bos: int | None
    eos: list[int]
    pad: int | None


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # meshd's architecture name for it
    model: str  # transformers' class name
    config: Callable[[Vocab], dict]  # kwargs of the transformers config
    vocab: str = "spm"  # "spm" (trained here) or a llama.cpp vocab name ("llama-bpe", "qwen2")
    template: str | None = None  # file in llama.cpp's models/templates
    spm_prefix: bool = True  # SentencePiece puts "▁" before the text (not Gemma)
    specials: tuple[str, ...] = ()  # chat markers, special tokens of the tokenizer
    tokenizer_class: str = "LlamaTokenizer"
    prompt_len: int = 24  # tokens of the parity prompt
    gguf_prompt_len: int | None = 24  # of the GGUF check; None: llama.cpp cannot write this model
    extra: dict = field(default_factory=dict)


def _small(v: Vocab, **kw) -> dict:
    base = dict(vocab_size=v.size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rms_norm_eps=1e-5, bos_token_id=v.bos, eos_token_id=v.eos if len(v.eos) > 1 else v.eos[0],
                pad_token_id=v.pad, tie_word_embeddings=False)
    return base | kw


CASES = [
    # Llama 3.1: llama3 rope scaling with an original context of 32, so a 64-token prompt
    # runs past the low-frequency wavelength boundary (32 / low_freq_factor); head_dim 16 at
    # theta 10000 has frequencies in all three bands. Its real 128k vocabulary, several EOS.
    Case("llama31", "llama", "LlamaForCausalLM", lambda v: _small(
        v, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        vocab="llama-bpe", template="meta-llama-Llama-3.1-8B-Instruct.jinja", prompt_len=64, gguf_prompt_len=64),
    # Mistral with a window of 8 and a 40-token prompt. llama.cpp writes Mistral as "llama"
    # without the window (and runs it without): its file is checked on a prompt inside the window.
    Case("mistral", "mistral", "MistralForCausalLM", lambda v: _small(v, sliding_window=8),
         template="mistralai-Mistral-Nemo-Instruct-2407.jinja",
         specials=("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), prompt_len=40, gguf_prompt_len=8),
    Case("qwen2", "qwen2", "Qwen2ForCausalLM", lambda v: _small(
        v, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), vocab="qwen2",
        template="Qwen-Qwen2.5-7B-Instruct.jinja"),
    # Qwen3: heads wider than hidden / n_heads, as the real ones.
    Case("qwen3", "qwen3", "Qwen3ForCausalLM", lambda v: _small(
        v, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), vocab="qwen2",
        template="Qwen-Qwen3-0.6B.jinja"),
    # Gemma 3: six layers (llama.cpp's pattern makes the sixth global), a window of 8 and a
    # 40-token prompt, linear rope scaling on the global layer only, as the 4B+ models.
    Case("gemma3", "gemma3", "Gemma3ForCausalLM", lambda v: _small(
        v, num_hidden_layers=6, num_key_value_heads=1, sliding_window=8, query_pre_attn_scalar=16,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        template="google-gemma-2-2b-it.jinja", spm_prefix=False, specials=("<mask>", "<start_of_turn>", "<end_of_turn>"),
        tokenizer_class="GemmaTokenizer", prompt_len=40, gguf_prompt_len=40),
    # Phi-3: fused projections; a window of 16 that transformers applies (and llama.cpp reads).
    Case("phi3", "phi3", "Phi3ForCausalLM", lambda v: _small(
        v, sliding_window=16, original_max_position_embeddings=256, num_key_value_heads=4),
        template="microsoft-Phi-3.5-mini-instruct.jinja",
        specials=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"), prompt_len=40,
        gguf_prompt_len=40),
    # Llama 2 layout with linear and dynamic (NTK) rope scaling past a context of 32.
    # llama.cpp writes linear scaling; it drops dynamic, so that one has no GGUF check.
    Case("llama-linear", "llama", "LlamaForCausalLM", lambda v: _small(
        v, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        template="meta-llama-Llama-3.2-3B-Instruct.jinja", prompt_len=48, gguf_prompt_len=48),
    Case("llama-dynamic", "llama", "LlamaForCausalLM", lambda v: _small(
        v, max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                         "factor": 2.0}),
        prompt_len=48, gguf_prompt_len=None),
]
CASE = {c.name: c for c in CASES}


# -- tokenizers ----------------------------------------------------------------------------


def _train_spm(case: Case) -> tuple[bytes, Vocab]:
    import sentencepiece as spm

    gemma = case.tokenizer_class == "GemmaTokenizer"
    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>")
           if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=buf, vocab_size=420, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, add_dummy_prefix=case.spm_prefix,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
        allow_whitespace_only_pieces=True, hard_vocab_limit=False, user_defined_symbols=list(case.specials),
        minloglevel=2, num_threads=1, **ids)
    proc = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    eos = [ids["eos_id"]] + [proc.piece_to_id(s) for s in case.specials if s in ("<end_of_turn>", "<|end|>")]
    return buf.getvalue(), Vocab(proc.get_piece_size(), ids["bos_id"], eos, ids["pad_id"] if gemma else None)


def write_spm_tokenizer(case: Case, out: Path, template: str | None) -> Vocab:
    from transformers import AutoTokenizer

    model, vocab = _train_spm(case)
    (out / "tokenizer.model").write_bytes(model)
    names = (dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
             if case.tokenizer_class == "GemmaTokenizer" else dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": case.tokenizer_class,
                                                           "add_bos_token": True, **names}))
    tok = AutoTokenizer.from_pretrained(out)
    if case.specials:
        tok.add_special_tokens({"additional_special_tokens": list(case.specials)})
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    # The added tokens listed in tokenizer_config.json as Hub repositories have them (transformers 5
    # no longer writes them; llama.cpp's converter reads its token types from there).
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return vocab


_BPE_SPECIALS = {
    "llama-bpe": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "qwen2": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
}


@functools.cache
def _bpe_tokenizer_json(vocab_gguf: Path) -> str:
    from shards.gguf_source import FastGGUFReader, _Fields
    from shards.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(_Fields(FastGGUFReader(str(vocab_gguf)))).to_str()


def write_bpe_tokenizer(case: Case, out: Path, template: str | None, vocab_gguf: Path) -> Vocab:
    from tokenizers import Tokenizer

    raw = _bpe_tokenizer_json(vocab_gguf)
    (out / "tokenizer.json").write_text(raw)
    tok = Tokenizer.from_str(raw)
    names = _BPE_SPECIALS[case.vocab]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names}
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    ids = {k: tok.token_to_id(v) for k, v in names.items()}
    # Several end ids, as Llama 3.1 (end of turn, end of text) and Qwen2.5 (end of turn, end of text) have.
    eos = [ids["eos_token"], tok.token_to_id("<|end_of_text|>" if case.vocab == "llama-bpe" else "<|endoftext|>")]
    return Vocab(tok.get_vocab_size(), ids.get("bos_token"), eos, ids.get("pad_token"))


# -- models ------------------------------------------------------------------------------


def _init(model: torch.nn.Module, seed: int, norm_center: float) -> None:
    """Weights that keep activations O(1) so greedy output varies with context: linears
    ~ 1/sqrt(fan_in), norms near ``norm_center`` (not exactly: a lost norm shows), biases small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(norm_center + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


def write_case(case: Case, out: Path, llama_cpp: Path, seed: int = 0) -> Path:
    """The case's Hugging Face directory: config.json, model.safetensors, tokenizer, template."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    template = (llama_cpp / "models" / "templates" / case.template).read_text() if case.template else None
    if case.vocab == "spm":
        vocab = write_spm_tokenizer(case, out, template)
    else:
        vocab = write_bpe_tokenizer(case, out, template, llama_cpp / "models" / f"ggml-vocab-{case.vocab}.gguf")
    cls = getattr(transformers, case.model)
    config = cls.config_class(**case.config(vocab), dtype=torch.float32)
    torch.manual_seed(seed)
    model = cls(config).eval()
    _init(model, seed, 0.0 if case.family == "gemma3" else 1.0)  # Gemma's norms multiply by 1 + w
    model.save_pretrained(out)
    return out


def load_reference(hf_dir: Path, device: str):
    """transformers' own model of the directory, fp32, eager attention (the plain reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.to(device).eval()


def reference_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding with transformers' own KV cache: tokens, and the prompt's logits [T, V]."""
    dev = next(model.parameters()).device
    out, past, logits = [], None, None
    feed = torch.tensor([ids], device=dev)
    with torch.inference_mode():
        for step in range(n):
            res = model(input_ids=feed, past_key_values=past, use_cache=True)
            if step == 0:
                logits = res.logits[0].float().cpu()
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            feed = torch.tensor([[nxt]], device=dev)
    return out, logits
