"""Sampling: greedy, temperature, nucleus, seeds; stop strings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shards.errors import InvalidParams
from shards.sampling import Sampler, SamplingParams, find_stop, stop_holdback


def test_greedy_is_argmax_and_ties_go_low():
    s = Sampler(SamplingParams(temperature=0.0))
    assert s.next(torch.tensor([0.1, 3.0, -1.0, 2.9])) == 1
    assert s.next(torch.tensor([1.0, 5.0, 2.0, 5.0, 5.0])) == 1
    assert s.next(torch.tensor([[0.0, 0.0, 7.0]], dtype=torch.bfloat16)) == 2


def _draw(params, logits, n):
    s = Sampler(params)
    return [s.next(logits) for _ in range(n)]


def test_same_seed_same_tokens_other_seed_differs():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    a = _draw(SamplingParams(temperature=1.0, seed=42), logits, 50)
    assert a == _draw(SamplingParams(temperature=1.0, seed=42), logits, 50)
    assert a != _draw(SamplingParams(temperature=1.0, seed=43), logits, 50)
    assert len(set(a)) > 10


def test_temperature_follows_softmax():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    draws = torch.tensor(_draw(SamplingParams(temperature=1.0, seed=0), logits, 6000))
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03), freq
    # A low temperature sharpens towards the top token.
    cold = _draw(SamplingParams(temperature=0.1, seed=0), logits, 500)
    assert cold.count(0) > 480


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(_draw(SamplingParams(top_p=0.6, seed=1), logits, 2000)) == {0, 1}
    assert set(_draw(SamplingParams(top_p=0.5, seed=1), logits, 500)) == {0}
    assert set(_draw(SamplingParams(top_p=0.01, seed=1), logits, 200)) == {0}
    assert set(_draw(SamplingParams(top_p=1.0, seed=1), logits, 3000)) == {0, 1, 2, 3}


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
                                    {"max_tokens": -1}, {"stop": ("",)}])
def test_bad_params_refused(kwargs):
    with pytest.raises(InvalidParams):
        SamplingParams(**kwargs)


def test_find_stop_and_holdback():
    assert find_stop("hello world. bye", ["bye", "."]) == 11
    assert find_stop("hello", ["x"]) is None
    assert stop_holdback("the end is nea", ["near"]) == 3
    assert stop_holdback("abc<", ["<|im_end|>", "</s>"]) == 1
    assert stop_holdback("abc", ["xyz"]) == 0
    assert stop_holdback("", ["xyz"]) == 0


words = st.text(alphabet="ab<|>", max_size=12)


@given(words, st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_helpers_match_brute_force(text, stops):
    starts = [i for i in range(len(text)) for s in stops if text.startswith(s, i)]
    assert find_stop(text, stops) == (min(starts) if starts else None)
    want = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    assert stop_holdback(text, stops) == want


# -- logit processors and logprobs ------------------------------------------------------------


def test_logit_bias_bans_and_forces():
    logits = torch.tensor([0.0, 5.0, 1.0, 0.5])
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((1, -100.0),))).next(logits) == 2
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((3, 100.0),))).next(logits) == 3


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, 1.9, -1.0, 0.0])
    history = [5, 0, 0]  # prompt [5]; generated twice token 0
    # frequency: 2 x 0.1 pushes 0 under 1; presence once by 0.05 does not.
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.1))
    assert s.next(logits, 0, history, 1) == 1
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=0.05)).next(logits, 0, history, 1) == 0
    # repetition (CTRL): a positive logit divided, a negative one multiplied, prompt tokens included.
    x = Sampler(SamplingParams(repetition_penalty=2.0)).process(logits, [0, 2], 1)
    assert x.tolist() == pytest.approx([1.0, 1.9, -2.0, 0.0])


def test_top_k_and_min_p_truncate():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert set(_draw(SamplingParams(top_k=2, seed=3), logits, 400)) == {0, 1}
    assert set(_draw(SamplingParams(min_p=0.6, seed=3), logits, 400)) == {0, 1}  # >= 0.6 x 0.4


def test_logprobs_are_of_the_processed_distribution():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    s = Sampler(SamplingParams(temperature=0.0, logprobs=2))
    assert s.next(logits) == 0
    assert s.last.token == 0 and s.last.logprob == pytest.approx(math.log(0.5))
    assert [t for t, _ in s.last.top] == [0, 1] and s.last.top[1][1] == pytest.approx(math.log(0.25))
    s = Sampler(SamplingParams(temperature=0.0, logprobs=0, logit_bias=((0, -100.0),)))
    assert s.next(logits) == 1 and s.last.top == () and s.last.logprob == pytest.approx(math.log(0.5), abs=1e-3)
