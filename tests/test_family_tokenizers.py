"""Tokenizers and chat templates of every family against independent references.

- llama.cpp's tokenizer test vectors: token ids its maintainers recorded from the original
  Hugging Face tokenizers (Llama 2 SentencePiece, Llama 3, Qwen2, Phi-3, GPT-2, StarCoder),
  encoded here by the tokenizer meshd rebuilds from the vocab GGUF next to them;
- transformers' own tokenizer of each tiny family directory (ASCII, Unicode, whitespace
  runs, special tokens written in text, BOS), for what meshd converts from that directory
  and from the GGUF llama.cpp wrote of it. A SentencePiece vocabulary that prefixes a space
  is checked against ``sentencepiece`` itself instead: transformers 5 rebuilds such a
  vocabulary without the prefix that sentencepiece (and llama.cpp) put before a leading space;
- transformers' ``apply_chat_template`` with each family's real template, tools included.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from shards.tokenizer import MeshTokenizer
from tests.llamacpp import vocab_cases
from tests.tinyfamilies import CASE, CASES, TEXTS, _bpe_tokenizer_json

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCABS = ("llama-spm", "llama-bpe", "qwen2", "phi-3", "gpt-2", "starcoder")
# Vocabularies whose GGUF rebuild equals transformers' tokenizer of the directory: byte-level
# ones, and SentencePiece without a space prefix (Gemma).
SAME_AS_TRANSFORMERS = {c.name for c in CASES if c.vocab != "spm" or not c.spm_prefix}


@pytest.fixture(scope="module")
def vectors(llama_cpp_src):
    return vocab_cases(llama_cpp_src, VOCABS)


@pytest.mark.parametrize("vocab", VOCABS)
def test_gguf_vocab_matches_llama_cpp_vectors(vocab, vectors):
    from shards.gguf_source import FastGGUFReader, _Fields
    from shards.tokenizer import tokenizer_from_gguf

    path, texts, want = vectors[vocab]
    if vocab in ("llama-bpe", "qwen2"):  # built once for the tiny models too
        tok = Tokenizer.from_str(_bpe_tokenizer_json(path))
    else:
        tok = tokenizer_from_gguf(_Fields(FastGGUFReader(str(path))))
    got = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    wrong = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, first: {wrong[0]!r}"


def _texts(case, ref) -> list[str]:
    specials = [s for s in ref.all_special_tokens if s]
    marks = [s for s in case.specials if s != "<mask>"][:2]
    return TEXTS + [f"{specials[0]}x{specials[-1]} y", f"a {specials[-1]}\nb"] + [f"{m}hi {m} there" for m in marks]


@pytest.mark.parametrize("name, fmt", [(c.name, "hf") for c in CASES] + [
    (c.name, "gguf") for c in CASES if c.gguf_prompt_len is not None and c.name in SAME_AS_TRANSFORMERS])
def test_tokenizer_matches_transformers(name, fmt, family_dirs, family_models):
    case = CASE[name]
    ref = transformers.AutoTokenizer.from_pretrained(family_dirs[name])
    tok = MeshTokenizer.load(family_models(name, fmt))
    for text in _texts(case, ref):
        assert tok.encode_prompt(text) == ref(text)["input_ids"], text  # with BOS where the model wants one
        ids = ref.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("name", sorted({c.name for c in CASES if c.gguf_prompt_len is not None} - SAME_AS_TRANSFORMERS))
def test_sentencepiece_gguf_matches_sentencepiece(name, family_dirs, family_models):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(family_dirs[name] / "tokenizer.model"))
    tok = MeshTokenizer.load(family_models(name, "gguf"))
    for text in TEXTS:
        ids = sp.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.encode_prompt(text) == sp.encode(text, add_bos=True), text
        assert tok.decode(ids) == sp.decode(ids), text
        pieces, dec = [], tok.stream_decoder()
        pieces = [dec.push(i) for i in ids]
        assert "".join(pieces) + dec.flush() == sp.decode(ids), text  # spaces kept piece by piece
    for mark in CASE[name].specials:  # a chat marker written in text is that one token
        assert tok.encode(f"x{mark}y").count(tok.token_id(mark)) == 1, mark


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}]
CHATS = {
    "one turn": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <there> & \"you\""}],
    "turns": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke. 🙂"}],
}
# OpenAI's shapes: arguments as a JSON string, content None beside tool calls.
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call9abcd", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call9abcd", "content": "18 C and sunny"},
]
# What transformers' documentation asks of a caller: arguments as an object, no None.
TOOL_CHAT_HF = [
    TOOL_CHAT[0],
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call9abcd", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    TOOL_CHAT[2],
]
TEMPLATED = [c.name for c in CASES if c.template]


def _reference(ref, chat, **kw):
    try:
        return ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kw)
    except Exception as e:  # the template refuses (a Gemma system turn): we must refuse too
        return e


@pytest.mark.parametrize("name", TEMPLATED)
def test_chat_template_matches_transformers(name, family_dirs, family_models):
    ref = transformers.AutoTokenizer.from_pretrained(family_dirs[name])
    extra = {"enable_thinking": False} if name == "qwen3" else {}
    for fmt in ("hf", "gguf") if CASE[name].gguf_prompt_len is not None else ("hf",):
        tok = MeshTokenizer.load(family_models(name, fmt))
        assert tok.chat_template == ref.chat_template
        for label, chat in CHATS.items():
            want = _reference(ref, chat, **extra)
            if isinstance(want, Exception):
                with pytest.raises(Exception, match=str(want)[:40]):
                    tok.render_chat(chat, **extra)
                continue
            assert tok.render_chat(chat, **extra) == want, (fmt, label)
            if fmt == "hf" or name in SAME_AS_TRANSFORMERS:  # (see the module's note on SentencePiece)
                assert tok.encode_chat(chat, **extra) == ref.apply_chat_template(
                    chat, add_generation_prompt=True, **extra)["input_ids"], (fmt, label)
        if tok.template.supports_tools:
            want = _reference(ref, TOOL_CHAT_HF, tools=TOOLS, **extra)
            assert not isinstance(want, Exception), want
            got = tok.render_chat(TOOL_CHAT, tools=TOOLS, **extra)
            assert got == want and "get_weather" in got and "18 C and sunny" in got, fmt


def test_tool_templates_are_detected(family_models):
    tools = {name: MeshTokenizer.load(family_models(name, "hf")).template.supports_tools for name in TEMPLATED}
    assert tools["llama31"] and tools["qwen2"] and tools["qwen3"] and tools["mistral"]
    assert not tools["gemma3"] and not tools["phi3"]


def test_template_sandbox(family_models):
    from meshd.errors import ModelError
    from shards.chat import ChatTemplate

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ModelError):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="no chat template"):
        ChatTemplate(None).render([{"role": "user", "content": "x"}], tools=TOOLS)
    with pytest.raises(ModelError, match="not JSON"):
        MeshTokenizer.load(family_models("qwen2", "hf")).render_chat(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}])
