"""Grammar requests that cannot buy minutes of the supernode (issue #32, item 5), on a real
``meshd run`` daemon with the real model (greedy, so answers are the model's own).

The attacker, a separate process, sends each of the issue's schemas and a few more,
over and over: ``minItems: 1000000000`` (it used to run to the end of the context, a
minute of CPU), the same through a forced tool call, a 120 KB regular expression (one
mask step of llguidance took 8 s on it), an enum whose grammar passes MAX_GRAMMAR_BYTES,
each a 400 naming the limit; a pattern whose lexer hits llguidance's own limit
mid-answer is a 400 naming it too (or, on a version that lexes it, a whole answer). ``^(a+)+$`` and ``a{1,100000}b{1,100000}`` are served, and what comes back
matches them. An honest client is served all the while, and the plan never changes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from shards import grammar
from tests.fixtures.daemon import running_daemon, status_json
from tests.honest import Honest
from tests.meshlab import http_json

pytestmark = pytest.mark.timeout(600)

ROUNDS = 3
CHAT = "/v1/chat/completions"


def schema_body(schema, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "Write some a and b letters."}], "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **extra}


HUGE_ITEMS = {"type": "array", "minItems": 1_000_000_000, "items": {"type": "integer"}}
# (name, body, the param the 400 names, words its message has); the attacker's requests.
REFUSED = [
    ("min_items", schema_body(HUGE_ITEMS, max_tokens=64), "response_format", ("2000000001", "max_tokens=64")),
    ("min_items_default_max", schema_body(HUGE_ITEMS), "response_format", ("minItems", "max_tokens=")),
    ("min_items_tool", {"messages": [{"role": "user", "content": "List numbers."}], "max_tokens": 64,
                        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                            "type": "object", "properties": {"xs": HUGE_ITEMS}, "required": ["xs"]}}}],
                        "tool_choice": "required"}, "tools", ("minItems", "max_tokens=64")),
    ("long_pattern", schema_body({"type": "string", "pattern": "^" + "(a|b)?" * 20000 + "$"}, max_tokens=16),
     "response_format", ("MAX_PATTERN_CHARS", "120002")),
    ("big_grammar", schema_body({"enum": [f"word{i}" for i in range(20000)]}, max_tokens=16),
     "response_format", ("MAX_GRAMMAR_BYTES",)),
]
# llguidance 1.9 stops lexing this one mid-answer ("too many expressions constructed"): a 400
# naming the limit, where it used to be a cut answer ('"'); another version may serve it.
LEXER_LIMIT = ("lexer_limit", schema_body({"type": "string", "pattern": "^" + "(a|b)?" * 340 + "$"}, max_tokens=16),
               r"(a|b)?" * 340)
SERVED = [
    ("redos", schema_body({"type": "string", "pattern": "^(a+)+$"}, max_tokens=32), r"(a+)+"),
    ("counted", schema_body({"type": "string", "pattern": "^a{1,100000}b{1,100000}$"}, max_tokens=32),
     r"a{1,100000}b{1,100000}"),
]

ATTACKER = r"""
import json, sys, urllib.request, urllib.error
url, rounds, bodies = sys.argv[1], int(sys.argv[2]), json.load(sys.stdin)
for _ in range(rounds):
    for name, body in bodies:
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, data = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            status, data = e.code, json.loads(e.read())
        print(json.dumps({"name": name, "status": status, "body": data}), flush=True)
"""


def honest_client(url: str) -> Honest:
    """A client with an ordinary schema: /healthz and a short constrained chat, over and over."""
    body = schema_body({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                       max_tokens=12)
    return Honest(lambda path, b: http_json(url + path, b, timeout=60), (("/healthz", None), (CHAT, body)),
                  join_s=120)


@pytest.fixture(scope="module")
def daemon(real_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("grammar-bounds")
    with running_daemon(real_model_dir, base / "state", base / "meshd.log", "--threads", "1") as served:
        yield served


def test_grammar_attacks_are_refused_or_served_while_an_honest_client_is_served(daemon):
    before = status_json(daemon.url)
    bodies = [(name, body) for name, body, *_ in REFUSED] + [(name, body) for name, body, _ in SERVED + [LEXER_LIMIT]]
    with honest_client(daemon.url) as honest:
        out = subprocess.run([sys.executable, "-c", ATTACKER, daemon.url + CHAT, str(ROUNDS)],
                             input=json.dumps(bodies), capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == ROUNDS * len(bodies)
    refused = {name: (param, words) for name, _, param, words in REFUSED}
    served = {name: pattern for name, _, pattern in SERVED + [LEXER_LIMIT]}
    for a in answers:
        if a["name"] == LEXER_LIMIT[0] and a["status"] == 400:
            err = a["body"]["error"]
            assert err["param"] == "response_format" and "limit" in err["message"], a
        elif a["name"] in refused:
            param, words = refused[a["name"]]
            err = a["body"].get("error", {})
            assert a["status"] == 400 and err.get("type") == "invalid_request_error", a
            assert err["param"] == param and all(w in err["message"] for w in words), a
        else:
            assert a["status"] == 200, a
            choice = a["body"]["choices"][0]
            text = json.loads(choice["message"]["content"])  # a JSON string, whole
            assert choice["finish_reason"] == "stop" and re.fullmatch(served[a["name"]], text), a
    honest.assert_live()
    after = status_json(daemon.url)
    assert after["term"] == before["term"] and after["plan"] == before["plan"]


def test_the_shortest_answer_bound_counts_what_a_schema_forces():
    """``min_json_chars`` is a lower bound: it never refuses what a model could write."""
    m = grammar.min_json_chars
    assert m(HUGE_ITEMS) == 2 + 1_000_000_000 + 999_999_999
    assert m({"type": "string", "minLength": 5}) == 7
    assert m({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}) == len('{"a":0}')
    assert m({"anyOf": [{"type": "string", "minLength": 100}, {"type": "integer"}]}) == 1
    assert m({"enum": ["abc", "z"]}) == 3 and m({"const": [1, 2]}) == 5
    for loose in ({}, True, {"$ref": "#/$defs/x"}, {"type": "string", "pattern": "^(a+)+$"}):
        assert m(loose) <= 2
    assert grammar.long_pattern({"properties": {"x": {"pattern": "a" * (grammar.MAX_PATTERN_CHARS + 1)}}}) \
        == (".properties.x.pattern", grammar.MAX_PATTERN_CHARS + 1)
    assert grammar.long_pattern({"pattern": "a" * grammar.MAX_PATTERN_CHARS}) is None
