"""A choice's tokens into chunks (meshd/serving/output.py), on the tiny model's real
tokenizer: the text a client is sent is the decoded tokens, cut before a stop string and
never showing a stop string's beginning that the next tokens complete; every token id and
its logprobs reach the client in the same chunk; a resumed choice goes on where it stopped."""

from __future__ import annotations

import pytest

from meshd.serving.output import ChoiceOutput
from shards.sampling import SamplingParams, TokenLogprobs
from shards.tokenizer import MeshTokenizer

TEXT = "the cat sat on the mat and the dog sat on the rug"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return MeshTokenizer.load(tiny_model_dir)


def run(tokenizer, ids, params, resumed=(), finish="length"):
    """Every chunk of ``ids`` pushed one at a time (each with a logprob naming its token),
    then the last one."""
    out = ChoiceOutput(tokenizer, params, resumed)
    chunks = []
    for t in ids:
        if (c := out.push(t, TokenLogprobs(t, -float(t)))) is not None:
            chunks.append(c)
        if out.finish is not None:
            break
    chunks.append(out.end(out.finish or finish))
    return chunks


def test_text_is_the_decoded_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    chunks = run(tokenizer, ids, SamplingParams(max_tokens=len(ids)))
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids)
    assert [t for c in chunks for t in c.token_ids] == ids
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    for c in chunks:  # each token's logprobs travel with it
        assert [lp.token for lp in c.logprobs] == list(c.token_ids)


def test_stop_string_cuts_and_is_never_sent_in_part(tokenizer):
    ids = tokenizer.encode(TEXT)
    chunks = run(tokenizer, ids, SamplingParams(max_tokens=len(ids), stop=("dog sat",)))
    whole = tokenizer.decode(ids)
    assert "".join(c.text for c in chunks) == whole[:whole.index("dog sat")]
    assert chunks[-1].finish_reason == "stop"
    # what was sent before the end never held the stop string's start ("dog"), which the
    # next tokens turned into the stop string
    assert "dog" not in "".join(c.text for c in chunks[:-1])
    sent = [t for c in chunks for t in c.token_ids]
    assert sent == ids[:len(sent)] and tokenizer.decode(sent).endswith("dog sat")


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    cut = run(tokenizer, ids, SamplingParams(max_tokens=len(ids), stop=("cat",)))
    assert cut[-1].finish_reason == "stop"
    late = run(tokenizer, ids, SamplingParams(max_tokens=len(ids), stop=("cat",), min_tokens=len(ids) - 1))
    assert late[-1].finish_reason == "length" and "".join(c.text for c in late) == tokenizer.decode(ids)


def test_resumed_choice_goes_on_where_it_stopped(tokenizer):
    ids = tokenizer.encode(TEXT)
    whole = "".join(c.text for c in run(tokenizer, ids, SamplingParams(max_tokens=len(ids))))
    k = len(ids) // 2
    head = "".join(c.text for c in run(tokenizer, ids[:k], SamplingParams(max_tokens=k)))
    rest = run(tokenizer, ids[k:], SamplingParams(max_tokens=len(ids)), resumed=ids[:k])
    assert head + "".join(c.text for c in rest) == whole
    assert [t for c in rest for t in c.token_ids] == ids[k:]


def test_prompt_logprobs_go_with_the_first_chunk_only(tokenizer):
    ids = tokenizer.encode(TEXT)[:3]
    out = ChoiceOutput(tokenizer, SamplingParams(max_tokens=3))
    out.prompt_logprobs = (TokenLogprobs(1, -0.5),)
    chunks = [out.push(t) for t in ids] + [out.end("length")]
    assert [c.prompt_logprobs for c in chunks if c is not None] == [(TokenLogprobs(1, -0.5),), (), (), ()]
