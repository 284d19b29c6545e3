"""Sampling is distributed as without speculation: on the tiny model (a vocabulary of 300),
through a real in-process node, the joint distribution of the first two sampled tokens is
the same with every lookup match drafted as with none (a chi-square test over 1,600 draws
each, fixed seeds), where the second token is always checked against a draft. The same
test rejects two wrong acceptance rules put in place of the pipeline's: keeping the draft
unchecked, and drawing again from the full distribution when the first draw disagrees with
the draft (the draft then wins more often than the model gives it).

The prompt makes the draft certain: after ``L t1`` (t1 the first sampled token) the prompt
holds ``L t1`` once, followed by another token of the three the logit bias leaves in play.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
import pytest_asyncio

from meshd.serving import pipeline, scheduler as scheduler_module
from tests.fixtures.api import complete
from tests.fixtures.daemon import running_node

pytestmark = pytest.mark.asyncio(loop_scope="module")

A, B, C, L = 40, 41, 42, 43  # plain tokens of the tiny tokenizer (its specials are 0..3)
PROMPT = [L, A, B, L, B, C, L, C, A, L]  # whichever of A, B, C comes next, "L t1" was seen once
BIAS = {str(A): 100.0, str(B): 99.6, str(C): 99.2}  # only A, B and C keep any probability
REQUESTS, CHOICES = 200, 8  # 1,600 draws per rule
ALPHA = 1e-3


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_model_dir, tmp_path_factory):
    async with running_node(tiny_model_dir, tmp_path_factory.mktemp("spec-sampling"), speculate="always") as node:
        yield node


async def _draws(client, served, speculate: bool, seed0: int) -> Counter:
    """(t1, t2) of REQUESTS * CHOICES seeded samples, each choice with its own seed."""
    scheduler = served.node.scheduler
    scheduler.speculate = speculate

    async def one(i: int) -> list[tuple[int, int]]:
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 1.0, "n": CHOICES, "logit_bias": BIAS,
                "seed": seed0 + CHOICES * i}
        answer = await complete(client, served.url, body)
        assert all(len(c["token_ids"]) == 3 for c in answer["choices"]), answer
        return [(c["token_ids"][0], c["token_ids"][1]) for c in answer["choices"]]

    try:
        pairs = []
        for batch in range(0, REQUESTS, 10):
            for got in await asyncio.gather(*(one(i) for i in range(batch, min(REQUESTS, batch + 10)))):
                pairs += got
    finally:
        scheduler.speculate = True
    return Counter(pairs)


def _chi2_p_value(x: Counter, y: Counter) -> float:
    """The p-value of the two-sample chi-square test that x and y come from one distribution
    (bins empty in both dropped; an odd number of degrees of freedom rounded up, which only
    makes the test slower to reject)."""
    bins = sorted(set(x) | set(y))
    nx, ny = sum(x.values()), sum(y.values())
    stat = 0.0
    for b in bins:
        pooled = (x[b] + y[b]) / (nx + ny)
        stat += (x[b] - nx * pooled) ** 2 / (nx * pooled) + (y[b] - ny * pooled) ** 2 / (ny * pooled)
    k = (len(bins) - 1 + 1) // 2  # chi-square with 2k degrees of freedom has a closed-form tail
    half = stat / 2
    return math.exp(-half) * sum(half ** i / math.factorial(i) for i in range(k))


def _keep_draft_unchecked(pick, s, logits):
    """Wrong: the drafted tokens as they are, then the model's own."""
    if not s.draft:
        return pick(s, logits[0])
    out = list(s.draft)
    out.append(pick(s, logits[len(s.draft)], out))
    return out


def _draw_again_on_a_miss(pick, s, logits):
    """Wrong: a first draw that misses the draft gets a second, from the whole distribution
    (the right rule draws the rest from what is left once the draft is taken out)."""
    if not s.draft:
        return pick(s, logits[0])
    out: list[int] = []
    for i in range(len(s.draft) + 1):
        token = pick(s, logits[i], out)
        if i < len(s.draft) and token != s.draft[i]:
            token = pick(s, logits[i], out + [token])  # the next position's draw: an independent one
        out.append(token)
        if i == len(s.draft) or token != s.draft[i]:
            break
    return out


async def test_sampled_tokens_are_distributed_as_without_drafts_and_wrong_rules_are_caught(
        client, served, monkeypatch):
    scheduler = served.node.scheduler
    # Drafts in steps of any size: the scheduler drafts in small steps only, because that is
    # where they pay; what a draw gives does not depend on the step it is in (tests/test_rowops.py).
    monkeypatch.setattr(scheduler_module, "SPECULATE_UP_TO", 10 * CHOICES)
    off = await _draws(client, served, False, seed0=1_000_000)
    before = scheduler.speculation()
    on = await _draws(client, served, True, seed0=2_000_000)
    after = scheduler.speculation()
    drafted = after["drafted"] - before["drafted"]
    # Every second token was checked against a draft, and the draws disagreed with it often.
    assert drafted >= REQUESTS * CHOICES, (before, after)
    assert set(t for pair in off for t in pair) <= {A, B, C}, off
    follows = {A: B, B: C, C: A}  # the prompt's token after "L t1": the draft of t2
    hit = sum(n for (t1, t2), n in off.items() if t2 == follows[t1]) / sum(off.values())
    assert 0.1 < hit < 0.9, (hit, off)
    p_right = _chi2_p_value(off, on)
    assert p_right > ALPHA, (p_right, off, on)

    for wrong in (_keep_draft_unchecked, _draw_again_on_a_miss):
        with monkeypatch.context() as m:
            m.setattr(pipeline, "_verify", wrong)
            bad = await _draws(client, served, True, seed0=3_000_000)
        p_wrong = _chi2_p_value(off, bad)
        assert p_wrong < ALPHA, (wrong.__name__, p_wrong, off, bad)
