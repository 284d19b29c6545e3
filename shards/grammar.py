"""Grammar-constrained generation: llguidance computes, at each step, which tokens keep
the output inside a grammar (a JSON schema, or a Lark grammar embedding JSON schemas for
tool calls); the sampler masks the others out.

Why llguidance (compared on this CPU with xgrammar and outlines-core): one abi3 wheel with
no Python dependencies; it reads the model's tokenizer.json as is (we have no transformers
tokenizer at run time); a matcher is built lazily in under a millisecond per request (no
up-front compilation of the whole schema, which outlines-core does per schema and xgrammar
per grammar), masks cost tens of microseconds a step; it takes JSON Schema with Lark
around it (``%json``), which tool calls in each family's own format need.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from shards.errors import InvalidParams

# Compact JSON: a small model given free whitespace may write newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}

_tokenizers: dict[int, Any] = {}
_lock = threading.Lock()


def _llg():
    import llguidance  # imported on first use: a daemon that never constrains output never loads it

    return llguidance


def grammar_tokenizer(tokenizer) -> Any:
    """llguidance's view of a MeshTokenizer (built once, ~1 s, then cached)."""
    with _lock:
        cached = _tokenizers.get(id(tokenizer))
        if cached is None or cached[0] is not tokenizer:
            llt = _llg().LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=sorted(tokenizer.eos_ids) or None)
            cached = _tokenizers[id(tokenizer)] = (tokenizer, llt)
        return cached[1]


def json_schema_grammar(schema: dict | bool, param: str) -> str:
    """A grammar for JSON text matching ``schema``."""
    try:
        return _llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidParams(f"{param}: the schema is not usable: {exc}", param=param) from None


def lark_grammar(source: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(source)


def check_grammar(grammar: str, param: str) -> None:
    """Refuse a grammar llguidance cannot build (an unsupported schema keyword, say)."""
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise InvalidParams(f"{param}: {'; '.join(messages) or 'the grammar is not valid'}", param=param)


def json_lark(schema: dict) -> str:
    """A schema inside a Lark grammar (``%json``), compact like JSON_OPTIONS."""
    return "%json " + json.dumps(dict(schema, **{"x-guidance": JSON_OPTIONS}))


def lark_string(text: str) -> str:
    return json.dumps(text)


class Constraint:
    """One generation's grammar state: the allowed-token mask, advanced token by token."""

    def __init__(self, tokenizer, grammar: str):
        llg = _llg()
        self.matcher = llg.LLMatcher(grammar_tokenizer(tokenizer), grammar)
        if self.matcher.is_error():
            raise InvalidParams(f"grammar: {self.matcher.get_error()}", param="response_format")
        self.eos = sorted(tokenizer.eos_ids)

    def allowed(self, vocab: int) -> Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        mask = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.size)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if self.matcher.is_accepting() or self.matcher.is_stopped() or not mask.any():
            # Any end-of-turn ends a finished answer (and one the grammar cannot go on with).
            mask[[t for t in self.eos if t < vocab]] = True
        return mask

    def accept(self, token: int) -> None:
        """Advance past a sampled token. Runs on the engine's thread inside a batched step, so
        it never raises: a refused token (impossible under the mask) leaves the matcher stopped."""
        self.matcher.consume_token(token)

    def replay(self, tokens) -> None:
        """Bring the state past tokens generated before (a resumed generation)."""
        for t in tokens:
            if t not in self.eos:
                self.accept(t)


def token_bytes(tokenizer, token: int) -> bytes:
    """The raw bytes of one token (a byte-level piece may be part of a character)."""
    return bytes(grammar_tokenizer(tokenizer).decode_bytes([token]))
