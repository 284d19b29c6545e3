"""The tokenizer: GPT-2 byte-level BPE from the GGUF vocabulary, chat prompts, streaming decode."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.tokenizer import MeshTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines\r\n",
    "Unicode: café naïve Ærøskøbing — “quotes” …",
    "CJK: 日本語のテキスト 中文 한국어",
    "Emoji: 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "digits 1234567890 and 3.14159",
]


@pytest.fixture(scope="module")
def real_tok(real_model_dir):
    return MeshTokenizer.load(real_model_dir)


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return MeshTokenizer.load(tiny_model_dir)


@pytest.mark.real_model
def test_real_known_ids(real_tok):
    # Whole-word tokens of SmolLM2's vocabulary: what a correct GPT-2 BPE must produce.
    vocab = real_tok.tokenizer.get_vocab()
    assert real_tok.encode("The quick brown fox") == [504, 2365, 6354, 16438]
    assert [vocab[t] for t in ("The", "Ġquick", "Ġbrown", "Ġfox")] == [504, 2365, 6354, 16438]
    assert real_tok.encode("Hello, world!") == [vocab["Hello"], vocab[","], vocab["Ġworld"], vocab["!"]]
    # SmolLM's pre-tokenizer splits every digit on its own.
    assert real_tok.encode("2024") == [vocab[d] for d in "2024"]
    assert real_tok.vocab_size == 49152


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_real_round_trip(real_tok, text):
    assert real_tok.decode(real_tok.encode(text)) == text


@pytest.mark.real_model
def test_real_specials(real_tok):
    ids = real_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert real_tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert real_tok.decode(ids, skip_special=True) == "user\nhi"
    assert real_tok.encode("<|endoftext|>") == [0]
    assert real_tok.eos_ids == {0, 2}


@pytest.mark.real_model
def test_real_chat_prompt_matches_template(real_tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert real_tok.chat_prompt(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert real_tok.chat_prompt(with_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    ids = real_tok.encode(real_tok.chat_prompt(msgs))
    assert ids.count(1) == 3 and ids.count(2) == 2


def _stream(tok, ids):
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS)
def test_real_stream_decoder(real_tok, text):
    ids = real_tok.encode(text)
    pieces, tail = _stream(real_tok, ids)
    assert "".join(pieces) + tail == text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.real_model
def test_stream_holds_back_split_characters(real_tok):
    ids = real_tok.encode("🙂")
    assert len(ids) > 1  # the emoji's four bytes are split over tokens
    dec = real_tok.stream_decoder()
    assert [dec.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1]) == "🙂"
    assert dec.flush() == ""
    dec = real_tok.stream_decoder()
    dec.push(ids[0])
    assert dec.flush() == "\ufffd"  # what was held back comes out at the end, as is


def test_tiny_round_trip_and_specials(tiny_tok):
    for text in TEXTS:
        assert tiny_tok.decode(tiny_tok.encode(text)) == text
    im_start, im_end = tiny_tok.token_id("<|im_start|>"), tiny_tok.token_id("<|im_end|>")
    assert tiny_tok.encode("<|im_start|>x<|im_end|>")[0] == im_start
    assert im_end in tiny_tok.eos_ids


def test_plain_chatml_without_template(tiny_tok, tiny_model_dir):
    plain = MeshTokenizer(tiny_tok.tokenizer, None, tiny_tok.eos_ids)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    assert plain.chat_prompt(msgs) == want
    assert tiny_tok.chat_prompt(msgs) == want  # the tiny model's own template is plain ChatML
    assert json.loads((tiny_model_dir / "manifest.json").read_text())["chat_template"]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_tiny_stream_equals_decode(tiny_model_dir, text):
    tok = MeshTokenizer.load(tiny_model_dir)
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text
