"""Grammar-constrained generation: llguidance computes, at each step, which tokens keep
the output inside a grammar (a JSON schema, or a Lark grammar embedding JSON schemas for
tool calls); the sampler masks the others out.

Why llguidance (compared on this CPU with xgrammar and outlines-core): one abi3 wheel with
no Python dependencies; it reads the model's tokenizer.json as is (we have no transformers
tokenizer at run time); a matcher is built lazily in under a millisecond per request (no
up-front compilation of the whole schema, which outlines-core does per schema and xgrammar
per grammar), masks cost tens of microseconds a step; it takes JSON Schema with Lark
around it (``%json``), which tool calls in each family's own format need.

Bounds (issue #32): a client's grammar must not buy minutes of the supernode. llguidance's
own limits (``LIMITS``) bound each step's mask (lexer fuel, Earley items) and the lexer's
memory (states); meshd bounds what it cannot: the grammar's size (compiling costs about
1 µs a byte, in validation and again in the build, so ``MAX_GRAMMAR_BYTES`` caps it near
0.15 s), each regular expression's length (a step's lexer work grows with its square,
and no llguidance limit stops a 120 KB one before 8 s: ``MAX_PATTERN_CHARS``), and a
schema whose shortest answer cannot fit in max_tokens (``min_json_chars``:
``minItems: 1000000000`` used to run to the end of the context, a minute of CPU). A grammar
is compiled once, off the event loop, and each generation takes a copy (``compiled``).
A limit hit mid-answer (llguidance's "too many expressions constructed", say) stops the
matcher: the answer ends there, and the request is a 400 naming the limit
(``Constraint.error``; an error event when streamed).
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from shards.errors import InvalidParams

# Compact JSON: a small model given free whitespace may write newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}

# llguidance's limits, set here rather than left to its defaults (which may change):
# per-step work stays within a few milliseconds, a matcher's lexer within ~40 MB.
LIMIT_VALUES = {
    "max_items_in_row": 2000,  # branching of one grammar row
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes: ~50k/ms
    "step_lexer_fuel": 200_000,  # one mask's lexer work: ~14k/ms
    "step_max_items": 50_000,  # one mask's Earley items: ~20k/ms
    "max_lexer_states": 20_000,  # ~1-2 kB each
    "max_grammar_size": 200_000,  # symbols in the grammar's productions
}
MAX_GRAMMAR_BYTES = 128 << 10  # the grammar text llguidance compiles (a schema, tools)
MAX_PATTERN_CHARS = 2048  # one regular expression of a schema: ~5 ms a step at worst, measured
MAX_SCHEMA_DEPTH = 64
COMPILED_KEPT = 16

_tokenizers: dict[int, Any] = {}
_lock = threading.Lock()
_compiled: collections.OrderedDict[tuple[int, str], Any] = collections.OrderedDict()


def limits() -> Any:
    return _llg().LLParserLimits(**LIMIT_VALUES, verbose_errors=False)


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


def check_grammar(grammar: str, param: str, tokenizer=None) -> None:
    """Refuse a grammar llguidance cannot build (an unsupported schema keyword, say), or one
    past a limit; with ``tokenizer``, build it (``compiled``) so generations only copy it."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise InvalidParams(f"{param}: its grammar is {len(grammar)} bytes; meshd compiles at most "
                            f"{MAX_GRAMMAR_BYTES} (MAX_GRAMMAR_BYTES)", param=param)
    if tokenizer is not None:
        compiled(tokenizer, grammar, param)
        return
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, limits=limits())
    if failed:
        raise InvalidParams(f"{param}: {'; '.join(messages) or 'the grammar is not valid'}", param=param)


def compiled(tokenizer, grammar: str, param: str = "response_format") -> Any:
    """A fresh matcher for ``grammar``, built under LIMITS (a grammar over a limit, or not
    valid, is InvalidParams naming it) and kept: the next one for it is a copy. Costs up
    to ~0.15 s the first time: call it off the event loop."""
    llt = grammar_tokenizer(tokenizer)
    key = (id(llt), grammar)
    with _lock:
        base = _compiled.get(key)
        if base is not None:
            _compiled.move_to_end(key)
    if base is None:
        base = _llg().LLMatcher(llt, grammar, log_level=0, limits=limits())
        if base.is_error():
            raise InvalidParams(f"{param}: {base.get_error()}", param=param)
        with _lock:
            _compiled[key] = base
            while len(_compiled) > COMPILED_KEPT:
                _compiled.popitem(last=False)
    return base.deep_copy()


def min_json_chars(schema: Any, depth: int = 0) -> int:
    """A lower bound on the characters of any compact JSON text ``schema`` accepts (0 when
    it cannot tell: ``$ref``, nesting past MAX_SCHEMA_DEPTH). Counts what a schema forces:
    minItems, minLength, minProperties, required properties, const and enum."""
    if not isinstance(schema, dict):
        return 1  # true: any value ("0"); false refuses everything, which llguidance reports
    if depth > MAX_SCHEMA_DEPTH or "$ref" in schema:
        return 0
    compact = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)
    if "const" in schema:
        return len(compact(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(len(compact(v)) for v in schema["enum"])
    bound = 1
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            bound = max(bound, min(min_json_chars(s, depth + 1) for s in schema[key]))
    if isinstance(schema.get("allOf"), list):
        bound = max([bound, *(min_json_chars(s, depth + 1) for s in schema["allOf"])])
    kinds = schema.get("type")
    if isinstance(kinds, str):
        kinds = [kinds]
    elif not isinstance(kinds, list) or not kinds:
        kinds = [k for k, words in (("array", ("minItems", "items", "prefixItems")), ("string", ("minLength",)),
                                    ("object", ("properties", "required", "minProperties")))
                 if any(w in schema for w in words)]
        if len(kinds) != 1:
            return bound
    return max(bound, min(_min_of_type(schema, k, depth) for k in kinds))


def _count(schema: dict, key: str) -> int:
    value = schema.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _min_of_type(schema: dict, kind: Any, depth: int) -> int:
    if kind == "string":
        return 2 + _count(schema, "minLength")
    if kind == "array":
        prefix_items = schema.get("prefixItems")
        prefix = prefix_items if isinstance(prefix_items, list) else []
        n = _count(schema, "minItems")
        forced = [min_json_chars(s, depth + 1) for s in prefix[:n]]
        rest = max(0, n - len(prefix))
        item = min_json_chars(schema.get("items", {}), depth + 1) if rest else 0
        return 2 + sum(forced) + rest * item + max(0, n - 1)
    if kind == "object":
        properties = schema.get("properties")
        props = properties if isinstance(properties, dict) else {}
        required = [k for k in schema.get("required", []) if isinstance(k, str)] \
            if isinstance(schema.get("required"), list) else []
        members = [len(json.dumps(k, ensure_ascii=False)) + 1 + min_json_chars(props.get(k, {}), depth + 1)
                   for k in dict.fromkeys(required)]
        n = max(len(members), _count(schema, "minProperties"))
        return 2 + sum(members) + (n - len(members)) * 4 + max(0, n - 1)  # '"":0' at least per extra one
    if kind in ("boolean", "null"):
        return 4
    return 1


def long_pattern(schema: Any) -> tuple[str, int] | None:
    """The first regular expression in ``schema`` (``pattern``, a ``patternProperties``
    key) longer than MAX_PATTERN_CHARS: (where, its length), or None."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("pattern"), str) and len(node["pattern"]) > MAX_PATTERN_CHARS:
            return f"{where}.pattern", len(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            for k in node["patternProperties"]:
                if len(k) > MAX_PATTERN_CHARS:
                    return f"{where}.patternProperties", len(k)
        stack.extend((v, f"{where}.{k}") for k, v in node.items() if isinstance(v, (dict, list)))
    return None


def check_patterns(schema: Any, param: str) -> None:
    """Refuse a regular expression longer than MAX_PATTERN_CHARS: llguidance's lexer work
    per step grows with its square (6 KB took 15 ms a step, 30 KB 0.5 s, 120 KB 8 s),
    past any of its fuel limits."""
    if (found := long_pattern(schema)) is not None:
        where, n = found
        raise InvalidParams(f"{param}: the regular expression at {where or '.'} is {n} characters; meshd takes "
                            f"at most {MAX_PATTERN_CHARS} (MAX_PATTERN_CHARS)", param=param)


def check_fits(schema: Any, param: str, max_tokens: int, max_token_chars: int, key: str = "max_tokens") -> None:
    """Refuse a schema whose shortest answer is longer than ``max_tokens`` tokens could
    spell: the generation could only run to max_tokens and end unfinished."""
    need = min_json_chars(schema)
    room = max_tokens * max_token_chars
    if need > room:
        raise InvalidParams(f"{param}: the shortest JSON this schema allows is {need} characters (its minItems, "
                            f"minLength, minProperties or required members), more than {key}={max_tokens} tokens "
                            f"can hold (at most {room} characters)", param=param)


def json_lark(schema: dict) -> str:
    """A schema inside a Lark grammar (``%json``), compact like JSON_OPTIONS."""
    return "%json " + json.dumps(dict(schema, **{"x-guidance": JSON_OPTIONS}))


def lark_string(text: str) -> str:
    return json.dumps(text)


class Constraint:
    """One generation's grammar state: the allowed-token mask, advanced token by token."""

    def __init__(self, tokenizer, grammar: str):
        self.matcher = compiled(tokenizer, grammar)  # a copy, when the request's check built it
        self.eos = sorted(tokenizer.eos_ids)
        self.error: str | None = None  # a limit llguidance hit mid-answer (which then ended)

    def allowed(self, vocab: int) -> Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        mask = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.size)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if self.error is None and self.matcher.is_error():
            self.error = self.matcher.get_error().replace("<non-verbose/>", "").strip()
        if self.matcher.is_accepting() or self.matcher.is_stopped() or not mask.any():
            # Any end-of-turn ends a finished answer (and one the grammar cannot go on with).
            mask[[t for t in self.eos if t < vocab]] = True
        return mask

    def accept(self, token: int) -> None:
        """Advance past a sampled token. Runs on the engine's thread inside a batched step, so
        it never raises: a refused token (impossible under the mask) leaves the matcher stopped."""
        self.matcher.consume_token(token)

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the grammar would take in turn (its state
        unchanged): a draft is cut there, so no row checks a token the mask would refuse."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def replay(self, tokens) -> None:
        """Bring the state past tokens generated before (a resumed generation)."""
        for t in tokens:
            if t not in self.eos:
                self.accept(t)


def token_bytes(tokenizer, token: int) -> bytes:
    """The raw bytes of one token (a byte-level piece may be part of a character)."""
    return bytes(grammar_tokenizer(tokenizer).decode_bytes([token]))
