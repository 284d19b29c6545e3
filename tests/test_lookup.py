"""Prompt lookup (meshd/serving/lookup.py): what it drafts from a session's own tokens, how
it learns how often its drafts are taken, and the draft length that pays on a peer whose
extra rows are dear (a CPU) or nearly free (a GPU)."""

from __future__ import annotations

import random

from meshd.serving.lookup import MAX_DRAFT, PROBE_AFTER, MatchRates, PromptLookup, StepCost


def test_lookup_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    look = PromptLookup()
    assert look.draft([1, 2, 3, 4], 8) == []  # nothing recurs
    tokens = [7, 1, 2, 3, 9, 1, 2, 5, 6, 1, 2]
    assert look.draft(tokens, 8) == [5, 6, 1, 2]  # (1, 2) last followed by 5 (the later match)
    assert look.draft(tokens + [3], 8) == [9, 1, 2, 5, 6, 1, 2, 3]  # (1, 2, 3): only the first occurrence
    assert look.draft(tokens + [3], 2) == [9, 1]  # no more than room allows
    assert look.draft(tokens + [3], 0) == []


def test_the_rate_follows_the_recent_drafts():
    rates = MatchRates()
    assert rates.rate(4) == 0.5  # a prior of one taken, one missed
    for _ in range(10):
        rates.taken(4, 4, 4)
    assert rates.rate(4) > 0.95
    for _ in range(20):
        rates.taken(4, 4, 0)
    assert rates.rate(4) < 0.1
    for _ in range(10):
        rates.held_back(4, 5, 5)  # drafts not sent still teach
    assert rates.rate(4) > 0.7


def test_a_draft_is_worth_what_drafts_matching_as_long_a_suffix_were():
    """A session copying a document matches 4 tokens and drafts in full from its first draft
    where such drafts have been taken (a CPU's costs: 10.7 ms a step, 4.2 ms a drafted row);
    free text's 2-token matches, mostly missed, draft nothing, and do not shorten the long
    matches' drafts; the suffix a draft matched is the lookup's ``matched``."""
    cost = StepCost()
    cost.plain, cost.row = 0.0107, 0.0042
    rates = MatchRates()
    for _ in range(6):
        rates.taken(4, 8, 8)
        rates.taken(2, 4, 0)
    assert cost.best_draft(rates.rate(4), MAX_DRAFT) == MAX_DRAFT
    assert cost.best_draft(rates.rate(2), MAX_DRAFT) == 0
    look = PromptLookup()
    tokens = [7, 1, 2, 3, 9, 1, 2, 5, 6, 1, 2]
    assert look.draft(tokens, 8) and look.matched == 2
    assert look.draft(tokens + [3], 8) and look.matched == 3


def test_a_row_cost_learned_while_the_box_was_busy_is_measured_again():
    """Drafted steps timed while another process held the core (a drafted row 30 ms where it
    costs 4) stop drafts even on a copied document; with nothing drafted, nothing measured
    that again, and drafts stayed off for the daemon's life (seen in a bench run: 2 peers
    drafted 225 tokens where other runs drafted 720). After PROBE_AFTER plain steps, one
    drafted row is tried; at its true cost drafts come back after a few probes, and at a
    still-high one they stay off."""
    def busy_then(row_s: float) -> tuple[StepCost, int]:
        cost = StepCost()
        for _ in range(5):
            cost.ran(0.0107, 0)
        for _ in range(10):
            cost.ran(0.0107 + 4 * 0.030, 4)
        assert cost.best_draft(0.95, MAX_DRAFT) == 0
        for probes in range(1, 13):
            for _ in range(PROBE_AFTER - 1):
                cost.ran(0.0107, 0)
                assert cost.best_draft(0.95, MAX_DRAFT) == 0  # no probe before its time
            cost.ran(0.0107, 0)
            assert cost.best_draft(0.1, MAX_DRAFT) == 0  # (a probe only where one would pay)
            assert cost.best_draft(0.95, MAX_DRAFT) == 1  # the probe
            cost.ran(0.0107 + row_s, 1)
            assert cost.undrafted == 0
            if cost.best_draft(0.95, MAX_DRAFT) > 0:  # drafts back, probe or not
                return cost, probes
        return cost, 0
    free, probes = busy_then(0.004)  # the core free again
    assert 1 < probes <= 8  # (one lucky probe is not enough)
    for _ in range(10):  # drafting again, its cost learned down to the true one
        free.ran(0.0107 + 4 * 0.004, 4)
    assert free.best_draft(0.95, MAX_DRAFT) >= 4
    still, probes = busy_then(0.030)  # still busy
    assert probes == 0 and still.best_draft(0.95, MAX_DRAFT) == 0


def test_a_draft_is_as_long_as_pays_on_the_measured_step_costs():
    cost = StepCost()
    assert cost.best_draft(0.99, 8) == 0  # no step timed yet: no draft
    for _ in range(20):
        cost.ran(0.0075, 0)  # a decode row alone: 7.5 ms
    cpu = StepCost()
    cpu.plain = cost.plain
    for _ in range(20):
        cpu.ran(0.0075 + 4 * 0.004, 4)  # each drafted row 4 ms more: a CPU
    assert abs(cpu.row - 0.004) < 1e-4
    assert cpu.best_draft(0.3, 8) == 0  # free text: drafts do not pay here
    assert 1 <= cpu.best_draft(0.8, 8) < MAX_DRAFT  # extraction: some do
    assert cpu.best_draft(0.8, 2) <= 2  # never past the draft found
    gpu = StepCost()
    gpu.plain = cost.plain
    gpu.ran(0.0075 + 8 * 0.0001, 8)  # each drafted row nearly free: a GPU
    assert gpu.best_draft(0.3, 8) >= 1 and gpu.best_draft(0.8, 8) == MAX_DRAFT
    # A draft model's guesses cost its forwards: at 2 ms a token, drafts still pay on the GPU
    # where they are taken often, at 10 ms not even there.
    assert 1 <= gpu.best_draft(0.9, 4, guess=0.002) <= 4 and gpu.best_draft(0.9, 4, guess=0.010) == 0


def test_peek_is_what_draft_would_give_for_longer_tokens_and_indexes_nothing():
    """The pipeline's look-ahead asks what a session's next draft will be once its tokens grow
    by a guess (``peek``); the answer must be the draft the scheduler then makes from those
    tokens, and asking must leave the session's own index as it was."""
    rng = random.Random(7)
    for _ in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(3, 40))]
        grown = tokens + [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
        look, fresh = PromptLookup(), PromptLookup()
        look.draft(tokens, MAX_DRAFT)
        before = dict(look._after), look._indexed
        most = rng.randrange(0, MAX_DRAFT + 1)
        assert look.peek(grown, most) == fresh.draft(grown, most)
        assert (dict(look._after), look._indexed) == before
        assert look.draft(grown, most) == fresh.draft(grown, most)
