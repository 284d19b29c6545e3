"""Speculative decoding by prompt lookup: drafts from a session's own tokens, checked in the
step it runs anyway, give the same tokens as one row at a time. On the real default model
(SmolLM2 Q4_1 kept quantized) through a real in-process node: greedy, seeded sampling with
logprobs, penalties, several choices, stop strings and a json_schema grammar, each with
speculation on and off; the node's counters show drafts were taken (a test whose prompts
never drafted would prove nothing). Gemma 3 is checked in tests/test_gemma3_real.py, the
mesh (three namespaced peers) in tests/test_quant_mesh.py."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio

from meshd.serving import pipeline
from tests.fixtures.api import EXTRACT, RECORD, complete
from tests.fixtures.daemon import running_node

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.real_model]

CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\n# The same two functions again, unchanged:\n")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(real_model_dir, tmp_path_factory):
    # Every lookup match drafted in full: how many pay (measured step costs, which a loaded box
    # moves) is tests/test_lookup.py's, and bench/bench_speculative.py's to measure.
    async with running_node(real_model_dir, tmp_path_factory.mktemp("spec-state"), speculate="always") as node:
        yield node


async def _both(client, served, body: dict, path: str = "/v1/completions") -> tuple[dict, dict, dict]:
    """The answer with speculation off, then on; and the drafts the second one checked."""
    scheduler = served.node.scheduler
    scheduler.speculate = False
    try:
        off = await complete(client, served.url, body, path)
    finally:
        scheduler.speculate = True
    before = scheduler.speculation()
    on = await complete(client, served.url, body, path)
    after = scheduler.speculation()
    return off, on, {k: after[k] - before[k] for k in ("drafted", "accepted", "steps")}


def _tokens(answer: dict) -> list[list[int]]:
    return [c["token_ids"] for c in answer["choices"]]


@pytest.mark.parametrize("prompt", [EXTRACT, CODE], ids=["json", "code"])
async def test_greedy_tokens_are_the_same_with_drafts_and_drafts_are_taken(client, served, prompt):
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0}
    off, on, spec = await _both(client, served, body)
    assert _tokens(on) == _tokens(off) and on["choices"][0]["text"] == off["choices"][0]["text"]
    assert spec["accepted"] > 0 and spec["steps"] < 48, spec  # fewer steps than tokens: drafts were kept


async def test_seeded_sampling_penalties_logprobs_and_choices_are_the_same_with_drafts(client, served):
    body = {"prompt": EXTRACT, "max_tokens": 40, "temperature": 0.7, "seed": 11, "n": 2, "logprobs": 3,
            "presence_penalty": 0.3, "frequency_penalty": 0.2}
    off, on, spec = await _both(client, served, body)
    assert _tokens(on) == _tokens(off)
    for a, b in zip(on["choices"], off["choices"]):
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
        assert a["logprobs"]["top_logprobs"] == b["logprobs"]["top_logprobs"]
    assert spec["drafted"] > 0, spec


async def test_a_stop_string_inside_a_taken_draft_ends_the_text_where_it_would(client, served):
    body = {"prompt": CODE, "max_tokens": 48, "temperature": 0, "stop": ["perimeter"]}
    off, on, spec = await _both(client, served, body)
    assert on["choices"][0]["text"] == off["choices"][0]["text"] and on["choices"][0]["finish_reason"] == "stop"
    assert "perimeter" not in on["choices"][0]["text"]


async def test_chat_and_its_usage_are_the_same_with_drafts(client, served):
    body = {"messages": [{"role": "user", "content": EXTRACT}], "max_tokens": 40, "temperature": 0}
    off, on, spec = await _both(client, served, body, "/v1/chat/completions")
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    assert on["usage"] == off["usage"]


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "born", "city"]}


async def test_a_json_schema_answer_is_the_same_with_drafts(client, served):
    """A grammar's matcher takes each pick in turn; the picks of a checked draft are the
    tokens kept, so a constrained answer drafts too and is unchanged."""
    schema = PERSON
    # The grammar writes JSON without spaces: so does this prompt, for the answer to repeat it.
    compact = EXTRACT.replace(json.dumps(RECORD), json.dumps(RECORD, separators=(",", ":")))
    body = {"messages": [{"role": "user", "content": compact}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
    off, on, spec = await _both(client, served, body, "/v1/chat/completions")
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    assert spec["accepted"] > 0, spec


async def test_a_constrained_session_drafts_only_tokens_its_grammar_allows(client, served, monkeypatch):
    """The prompt's JSON has spaces after its colons and commas, the grammar's has none: a
    draft taken from the prompt is cut before the first token the grammar would refuse (a
    row checking it would be wasted), and the answer is the same as without drafts."""
    drafts: list[tuple[int, int]] = []  # (drafted, of which the grammar allows from the first)
    verify = pipeline._verify

    def watched(pick, s, logits):
        if s.draft and s.sampler.mask is not None:  # the grammar still as it was before this step's picks
            drafts.append((len(s.draft), s.sampler.mask.allows(s.draft)))
        return verify(pick, s, logits)

    monkeypatch.setattr(pipeline, "_verify", watched)
    body = {"messages": [{"role": "user", "content": EXTRACT}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    off, on, spec = await _both(client, served, body, "/v1/chat/completions")
    assert on["choices"][0]["message"] == off["choices"][0]["message"]
    assert drafts and all(n == allowed for n, allowed in drafts), drafts
