"""The tokenizer: byte-level BPE built from a GGUF vocabulary, or a Hugging Face tokenizer.json.

``MeshTokenizer`` wraps a ``tokenizers.Tokenizer`` with what serving needs: encoding that
recognises special tokens written in text, the chat prompt, the end-of-sequence ids, and an
incremental decoder that never emits half a UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shards.errors import ModelError
from shards.manifest import TOKENIZER_FILE, Manifest

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer names -> the same split in the tokenizers library.
# "smollm" (like starcoder) splits every digit on its own before the GPT-2 regex.
_GPT2_SPLIT = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
_PRE_TOKENIZERS = {
    "gpt2": lambda: _GPT2_SPLIT,
    "default": lambda: _GPT2_SPLIT,
    "smollm": lambda: [pre_tokenizers.Digits(individual_digits=True), *_GPT2_SPLIT],
    "starcoder": lambda: [pre_tokenizers.Digits(individual_digits=True), *_GPT2_SPLIT],
}

END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def tokenizer_from_gguf(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                        model: str, pre: str) -> Tokenizer:
    """Rebuild the byte-level BPE that llama.cpp's vocabulary encodes."""
    if model != "gpt2":
        raise ModelError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    if pre not in _PRE_TOKENIZERS:
        raise ModelError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(_PRE_TOKENIZERS[pre]())
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(token_types) if t == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(token_types) if t == _USER_DEFINED]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok


def _render_chatml(messages: Sequence[dict]) -> str:
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back bytes of an unfinished character."""

    _MAX_HELD = 8  # a run of tokens this long that still ends in U+FFFD is real output

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._tok.decode(self._pending, skip_special_tokens=self._skip)
        if text.endswith("\ufffd") and len(self._pending) < self._MAX_HELD:
            return ""
        # Byte-level BPE decodes a concatenation to the concatenation of its bytes, so a
        # clean boundary here is a clean boundary for everything that follows.
        self._pending.clear()
        return text

    def flush(self) -> str:
        text = self._tok.decode(self._pending, skip_special_tokens=self._skip) if self._pending else ""
        self._pending.clear()
        return text


class MeshTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 eos_ids: frozenset[int] = frozenset(), bos_id: int | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_id = bos_id
        # A chat model ends its turn with <|im_end|>, a base model its text with <|endoftext|>,
        # whichever eos the config names.
        ends = {tokenizer.token_to_id(t) for t in END_TOKENS} - {None}
        self.eos_ids = frozenset(eos_ids) | ends
        self._template = None

    @classmethod
    def load(cls, model_dir: Path) -> MeshTokenizer:
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise ModelError(f"{model_dir} has no {TOKENIZER_FILE}")
        tok = Tokenizer.from_file(str(path))
        manifest = Manifest.load(model_dir)
        c = manifest.config
        if tok.get_vocab_size() > c.vocab_size:
            raise ModelError(f"tokenizer has {tok.get_vocab_size()} tokens, the model only {c.vocab_size}")
        return cls(tok, manifest.chat_template, frozenset(c.eos_token_ids), c.bos_token_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it are read as specials."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self.tokenizer, skip_special)

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        """The prompt text for a chat: the model's own template if it has one, else ChatML."""
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ModelError("each chat message needs a string role and content")
        if not self.chat_template:
            return _render_chatml(messages)
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        special = lambda i: self.tokenizer.id_to_token(i) if i is not None else ""  # noqa: E731
        return self._template.render(messages=list(messages), add_generation_prompt=True,
                                     bos_token=special(self.bos_id),
                                     eos_token=special(min(self.eos_ids) if self.eos_ids else None))
