"""The tokenizer: a Hugging Face tokenizer.json as it is, or one rebuilt from a GGUF vocabulary.

GGUF vocabularies come in two kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with the merges listed; how text is split before merging is
  named by ``tokenizer.ggml.pre`` (llama.cpp's names, mapped here to the split the
  original tokenizer.json has);
- ``llama``: SentencePiece BPE (Llama 2, Mistral, Phi-3, Gemma) with byte fallback: no
  merges in the file, so they are derived from the vocabulary ranked by score (Gemma: by
  position, which its scores do not follow); spaces become "▁", and a "▁" is put in front
  of the text when ``add_space_prefix`` says so (llama.cpp's default).

Control tokens become special tokens and user-defined ones plain added tokens, under the
ids the file gives them. Whether a prompt starts with BOS (``add_bos_token``) is the
tokenizer's post-processor, as in a Hugging Face tokenizer.json.

``MeshTokenizer`` wraps a ``tokenizers.Tokenizer`` with what serving needs: encoding that
recognises special tokens written in text, the chat prompt (shards/chat.py), every
end-of-generation id, and an incremental decoder that never emits half a character.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from shards.errors import ModelError
from shards.chat import CHATML_MARKERS, pick_template
from shards.chat_templates import GivenTemplate
from shards.manifest import TOKENIZER_FILE, Manifest

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The splits of the original tokenizer.json files, by llama.cpp's pre-tokenizer names.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> list:
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _regex_split(regex: str) -> list:
    return [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


# name -> (pre-tokenizers, normalizer or None, ignore_merges)
_BPE_PRE = {
    "default": lambda: (_gpt2_split(), None, False),
    "gpt2": lambda: (_gpt2_split(), None, False),
    "gpt-2": lambda: (_gpt2_split(), None, False),
    # SmolLM and StarCoder split every digit on its own before the GPT-2 regex.
    "smollm": lambda: ([pre_tokenizers.Digits(individual_digits=True), *_gpt2_split()], None, False),
    "starcoder": lambda: ([pre_tokenizers.Digits(individual_digits=True), *_gpt2_split()], None, False),
    # Llama 3 takes a word that is in the vocabulary whole, without merging up to it.
    "llama-bpe": lambda: (_regex_split(_LLAMA3_SPLIT), None, True),
    "llama3": lambda: (_regex_split(_LLAMA3_SPLIT), None, True),
    "llama-v3": lambda: (_regex_split(_LLAMA3_SPLIT), None, True),
    # Mistral Nemo and later: its tokenizer.json's split (llama.cpp keeps no test vectors for it).
    "tekken": lambda: (_regex_split(_TEKKEN_SPLIT), None, True),
    "qwen2": lambda: (_regex_split(_QWEN2_SPLIT), normalizers.NFC(), False),
    "deepseek-r1-qwen": lambda: (_regex_split(_QWEN2_SPLIT), normalizers.NFC(), False),
}
# Pre-tokenizers whose vocabularies start a prompt with BOS unless the file says otherwise.
_BPE_ADD_BOS = {"llama-bpe", "llama3", "llama-v3", "tekken"}

# Texts of end-of-generation tokens (llama.cpp's list, the ones in use): any of them that
# the vocabulary has stops a generation, whatever the config names as EOS.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
              "<end_of_turn>")


def _field(fields: Mapping, key: str, default=None):
    value = fields.get(key)
    return default if value is None else value


def tokenizer_from_gguf(fields: Mapping) -> Tokenizer:
    """The tokenizer a GGUF file's ``tokenizer.ggml.*`` metadata describes."""
    kind = _field(fields, "tokenizer.ggml.model")
    tokens: list[str] = list(_field(fields, "tokenizer.ggml.tokens", ()))
    if not tokens:
        raise ModelError("GGUF file has no tokenizer.ggml.tokens")
    types = list(_field(fields, "tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    if kind == "gpt2":
        pre = _field(fields, "tokenizer.ggml.pre", "default")
        if pre not in _BPE_PRE:
            raise ModelError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_BPE_PRE))})")
        tok = _byte_level_bpe(tokens, _field(fields, "tokenizer.ggml.merges", ()), pre)
        add_bos = _field(fields, "tokenizer.ggml.add_bos_token", pre in _BPE_ADD_BOS)
    elif kind == "llama":
        arch = _field(fields, "general.architecture", "")
        tokens = [_respell_spaces(t) if ty == _USER_DEFINED else t for t, ty in zip(tokens, types)]
        tok = _sentencepiece_bpe(tokens, _field(fields, "tokenizer.ggml.scores", [0.0] * len(tokens)),
                                 rank_by_position=arch.startswith("gemma"),
                                 add_space_prefix=_field(fields, "tokenizer.ggml.add_space_prefix", True),
                                 unk=_field(fields, "tokenizer.ggml.unknown_token_id"))
        add_bos = _field(fields, "tokenizer.ggml.add_bos_token", True)
    else:
        raise ModelError(f"GGUF tokenizer model {kind!r} is not supported (known: gpt2, llama)")
    add_eos = _field(fields, "tokenizer.ggml.add_eos_token", False)
    bos, eos = _field(fields, "tokenizer.ggml.bos_token_id"), _field(fields, "tokenizer.ggml.eos_token_id")
    _post_processor(tok, tokens, bos if add_bos else None, eos if add_eos else None)
    return _with_added_tokens(tok, tokens, types)


def gguf_special_tokens(fields: Mapping) -> dict[str, str]:
    """bos/eos/unk/pad token texts (what chat templates call ``bos_token`` ...)."""
    tokens = _field(fields, "tokenizer.ggml.tokens", ())
    out = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = fields.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            out[name] = tokens[int(i)]
    return out


def _byte_level_bpe(tokens: list[str], merges: Sequence[str], pre: str) -> Tokenizer:
    splits, normalizer, ignore_merges = _BPE_PRE[pre]()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = cast("list[tuple[str, str]]", [tuple(m.split(" ", 1)) for m in merges])  # ("left right" each)
    model = (models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=True)
             if ignore_merges else models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    return tok


def _respell_spaces(token: str) -> str:
    """llama.cpp's converter writes SentencePiece's user-defined space tokens with real
    spaces; as vocabulary entries they are runs of "▁"."""
    return "\u2581" * len(token) if token and not token.strip(" ") else token


def _sentencepiece_bpe(tokens: list[str], scores: Sequence[float], rank_by_position: bool,
                       add_space_prefix: bool, unk: int | None) -> Tokenizer:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # A merge (left, right) ranks by the score of the piece it makes (Gemma: by the piece's
    # position), then by the longer left part; ties stay in vocabulary order (transformers' order).
    ranked = []
    for i, piece in enumerate(tokens):
        key = i if rank_by_position else -float(scores[i])
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((key, -len(left), -len(right), i, vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda r: r[:6])
    merges = [(left, right) for *_, left, right in ranked]
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _post_processor(tok: Tokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """BOS (and EOS) around a text, where the model wants them."""
    if bos is None and eos is None:
        return
    around = lambda seq, t: ([f"{tokens[bos]}:{t}"] if bos is not None else []) + [f"{seq}:{t}"] + (  # noqa: E731
        [f"{tokens[eos]}:{t}"] if eos is not None else [])
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(around("$A", 0)), pair=" ".join(around("$A", 0) + around("$B", 1)),
        special_tokens=list(dict.fromkeys((tokens[i], i) for i in (bos, eos) if i is not None)))


def _with_added_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> Tokenizer:
    """Control tokens as special and user-defined ones as plain added tokens, each under
    the id the file gives it."""
    added = [(i, t, ty == _CONTROL) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (_CONTROL, _USER_DEFINED)]
    if all(tok.token_to_id(t) == i for i, t, _ in added):  # the usual case: each text is its own vocabulary entry
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t, special in added if special])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for _, t, special in added if not special])
        return tok
    # add_tokens would give a text spelled otherwise in the vocabulary a new id: write them with theirs.
    data = json.loads(tok.to_str())
    data["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": special} for i, t, special in added]
    return Tokenizer.from_str(json.dumps(data))


@contextlib.contextmanager
def _no_panic(what: str):
    """A panic inside the tokenizers library (a model file's pre-tokenizer regex that hits
    the regex engine's limits, on some text) as a ModelError: pyo3 raises it as a
    BaseException, past every ``except Exception`` (a server's handler, a task group)."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise ModelError(f"the model's tokenizer failed to {what} this text: {str(exc)[:200]}") from None


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back bytes of an unfinished character.

    Each new piece is decoded after the piece sent before it, and only the text it adds
    is emitted: a SentencePiece decoder strips the space that starts a text, and would
    strip it from every piece decoded alone. The piece before always starts where a
    character does (it followed a clean cut), which byte-fallback decoding needs."""

    _MAX_HELD = 8  # a run of tokens this long that still ends in U+FFFD is real output

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._before: list[int] = []  # the last piece emitted
        self._pending: list[int] = []

    def _text(self) -> str:
        decode = lambda ids: self._tok.decode(ids, skip_special_tokens=self._skip)  # noqa: E731
        if not self._before:
            return decode(self._pending)
        full, head = decode(self._before + self._pending), decode(self._before)
        return full[len(head):] if full.startswith(head) else decode(self._pending)

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._text()
        if text.endswith("\ufffd") and len(self._pending) < self._MAX_HELD:
            return ""
        self._before, self._pending = self._pending, []
        return text

    def flush(self) -> str:
        text = self._text() if self._pending else ""
        if self._pending:
            self._before, self._pending = self._pending, []
        return text


class MeshTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 eos_ids: frozenset[int] = frozenset(), bos_id: int | None = None,
                 special_tokens: Mapping[str, str] | None = None, given_template: GivenTemplate | None = None):
        """``chat_template``: the model's own; ``given_template``: one the operator chose over it."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_id = bos_id
        # Every end-of-generation id: the config's, and any end-of-turn token the vocabulary has.
        ends = cast("set[int]", {tokenizer.token_to_id(t) for t in END_TOKENS} - {None})  # (None taken out)
        self.eos_ids = frozenset(eos_ids) | ends
        specials = dict(special_tokens or {})
        # (id_to_token is None only for an id past the vocabulary; a template reads it as a value)
        if "bos_token" not in specials and bos_id is not None:
            specials["bos_token"] = cast(str, tokenizer.id_to_token(bos_id))
        if "eos_token" not in specials and eos_ids:
            specials["eos_token"] = cast(str, tokenizer.id_to_token(min(eos_ids)))
        self.special_tokens = specials
        has_chatml = all(tokenizer.token_to_id(t) is not None for t in CHATML_MARKERS)
        self.template = pick_template(chat_template, given_template, has_chatml, specials)

    @classmethod
    def load(cls, model_dir: Path, given_template: GivenTemplate | None = None) -> MeshTokenizer:
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise ModelError(f"{model_dir} has no {TOKENIZER_FILE}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library's own (a file it cannot read): the model's fault
            raise ModelError(f"{path} does not load: {str(exc)[:300]}") from None
        manifest = Manifest.load(model_dir)
        c = manifest.config
        if tok.get_vocab_size() > c.vocab_size:
            raise ModelError(f"tokenizer has {tok.get_vocab_size()} tokens, the model only {c.vocab_size}")
        return cls(tok, manifest.chat_template, frozenset(c.eos_token_ids), c.bos_token_id, manifest.special_tokens,
                   given_template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (its spelling's length bounds
        it: a byte-level token spells each byte as one character, a byte-fallback token
        ``<0xNN>`` spells one byte with six); so a text of more than ``n`` times this has
        more than ``n`` tokens, whatever the tokenizer makes of it."""
        return max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in it are read as specials.
        ``add_special``: also what the tokenizer puts around a text (BOS where the model wants it)."""
        # encode_batch, unlike encode, lets go of the GIL while it works: a long prompt
        # tokenized on a worker thread then stalls nobody else (a 1 MiB one takes ~1 s).
        with _no_panic("encode"):
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special)[0].ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt as the model expects it: with BOS where the model wants one."""
        return self.encode(text, add_special=True)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        with _no_panic("decode"):
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self.tokenizer, skip_special)

    def render_chat(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                    add_generation_prompt: bool = True, max_chars: int | None = None, **extra) -> str:
        """The prompt text of a chat through its template (shards/chat.py's ``pick_template``),
        with ``tools`` where given and any variable the template reads (``enable_thinking``);
        rendered in a worker process within time, memory and ``max_chars`` bounds
        (shards/template_sandbox.py: TemplateLimit past one); ModelError where the model has none."""
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    max_chars=max_chars, **extra)

    def encode_chat(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                    max_chars: int | None = None, **extra) -> list[int]:
        """Token ids of a chat prompt; the template writes BOS itself where the model has one,
        so none is added (as transformers' apply_chat_template tokenizes)."""
        return self.encode(self.render_chat(messages, tools=tools, max_chars=max_chars, **extra))

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        """The prompt text for a chat of {role, content} messages (kept for callers of the first API)."""
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ModelError("each chat message needs a string role and content")
        return self.render_chat(messages)
