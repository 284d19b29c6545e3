"""Speculative decoding with a draft model (``--draft-model``): a second tiny random model
sharing the tiny target's tokenizer drafts where prompt lookup has no guess; through a real
in-process node, greedy and seeded answers (logprobs too) are the same tokens as with no
drafts, and the draft model's drafts were checked. The target as its own draft model has
every drafted token taken: its draft cache follows each session exactly (a draft cache off
by one position would guess wrong), and a row's bits do not depend on the engine or the
step it runs in. A draft model with another tokenizer is refused."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from meshd.serving import drafter as drafter_module
from meshd.serving.served import KV_SHARE
from meshd.serving.drafter import DraftModel
from meshd.serving.scheduler import kv_bytes_per_token
from shards.convert import convert
from shards.errors import ModelError
from shards.manifest import Manifest
from shards.tiny import write_tiny_hf_model
from tests.fixtures.api import complete
from tests.fixtures.daemon import running_node

# Free text: words that do not repeat, so prompt lookup has nothing and every draft is the model's.
PROMPTS = ["the quick brown fox", "a small village by the sea", "once upon a time"]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Two layers of other random weights, the tiny target's tokenizer."""
    hf = write_tiny_hf_model(tmp_path_factory.mktemp("draft-hf") / "tiny-draft", seed=7, n_layers=2)
    return convert(hf, tmp_path_factory.mktemp("draft") / "tiny-draft", progress=False)


async def _drafting(served) -> DraftModel:
    """The draft model once loaded (off the loop, after the node serves; a loaded box is slow)."""
    for _ in range(1200):
        if served.node.scheduler.drafter is not None:
            return served.node.scheduler.drafter
        await asyncio.sleep(0.05)
    raise AssertionError("the draft model was not loaded in 60 s")


async def _off_then_on(client, served, body: dict) -> tuple[dict, dict, dict]:
    scheduler = served.node.scheduler
    scheduler.speculate = False
    try:
        off = await complete(client, served.url, body)
    finally:
        scheduler.speculate = True
    before = scheduler.speculation()
    on = await complete(client, served.url, body)
    after = scheduler.speculation()
    return off, on, {k: after[k] - before[k] for k in ("drafted", "accepted", "steps", "model_drafted",
                                                         "model_accepted")}


@pytest.mark.asyncio(loop_scope="module")
async def test_answers_are_the_same_with_a_draft_models_drafts_and_they_are_checked(client, tiny_model_dir, draft_dir,
                                                                                      tmp_path):
    async with running_node(tiny_model_dir, tmp_path / "state", speculate="always",
                            draft_model=str(draft_dir)) as served:
        drafter = await _drafting(served)
        assert drafter.name == "tiny-draft"
        # its caches sit on this peer too: a position of the KV budget costs both models' KV
        target, draft = Manifest.load(tiny_model_dir).config, drafter.engine.manifest.config
        memory = int(served.node.view.caps.mem_budget * KV_SHARE)
        alone = max(target.max_position, memory // kv_bytes_per_token(target, torch.float32))
        both = kv_bytes_per_token(target, torch.float32) + kv_bytes_per_token(draft, torch.float32)
        assert served.node.scheduler.kv_budget_tokens == max(target.max_position, memory // both) < alone
        for prompt in PROMPTS:
            for body in ({"prompt": prompt, "max_tokens": 24, "temperature": 0},
                         {"prompt": prompt, "max_tokens": 24, "temperature": 0.9, "seed": 5, "logprobs": 2}):
                off, on, spec = await _off_then_on(client, served, body)
                assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"], (prompt, body)
                assert on["choices"][0]["logprobs"] == off["choices"][0]["logprobs"]
                assert spec["model_drafted"] > 0, spec
        status = served.node.scheduler.speculation()
        assert status["draft_model"] == "tiny-draft" and status["model_drafted"] > 0
        for _ in range(100):  # every session's draft cache (warmed from its prompt) goes when it ends
            if drafter.engine.sessions == 0:
                break
            await asyncio.sleep(0.05)
        assert drafter.engine.sessions == 0 and not drafter._warming
        async with client.get(served.url + "/metrics") as r:
            metrics = await r.text()
        counted = [line for line in metrics.splitlines() if line.startswith("meshd_speculative_model_drafted_total ")]
        assert counted and float(counted[0].split()[1]) == status["model_drafted"], counted
    assert not served.node.scheduler.drafter.engine._pool._thread.is_alive()  # closed with the node


@pytest.mark.asyncio(loop_scope="module")
async def test_the_target_as_its_own_draft_model_has_every_draft_taken(client, tiny_model_dir, tmp_path):
    async with running_node(tiny_model_dir, tmp_path / "state", speculate="always",
                            draft_model=str(tiny_model_dir)) as served:
        await _drafting(served)
        for prompt in PROMPTS:
            off, on, spec = await _off_then_on(client, served, {"prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"]
            assert spec["model_drafted"] > 0 and spec["model_accepted"] == spec["model_drafted"], spec


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = convert(write_tiny_hf_model(tmp_path / "other-hf", vocab=200, n_layers=1), tmp_path / "other",
                    progress=False)
    with pytest.raises(ModelError, match="tokenizer"):
        DraftModel.load(other, Manifest.load(tiny_model_dir))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_draft_follows_its_session_as_a_fresh_one_would_and_skips_ids_it_does_not_know(tiny_model_dir,
                                                                                               draft_dir):
    """The draft cache fed only what a session gained (a drafted token taken, then another)
    guesses what a fresh session fed everything guesses; a token id past the draft model's
    vocabulary (a larger target's padding, a client's id) gets no draft, not an error."""
    drafter = DraftModel.load(draft_dir, Manifest.load(tiny_model_dir))
    try:
        assert await drafter.draft("s", [5, 6, drafter.vocab], 3) == []
        first = await drafter.draft("s", [5, 6, 7], 3)
        assert len(first) == 3 and all(0 <= t < drafter.vocab for t in first)
        for grown in ([5, 6, 7, first[0], 9], [5, 6, 7, first[0], first[1], first[2], 11], [5, 6, 12]):
            assert await drafter.draft("s", grown, 3) == await drafter.draft(f"fresh{len(grown)}{grown[-1]}", grown, 3)
    finally:
        drafter.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_prompt_warmed_beside_the_lanes_drafts_as_a_fresh_session_and_a_forgotten_one_leaves_nothing(
        tiny_model_dir, draft_dir, monkeypatch):
    """``warm`` feeds a session's prompt to its draft cache in chunks (three calls here), not
    ready to draft until it is through; its first draft then guesses what a session fed
    everything at once guesses. A session forgotten while its prompt feeds leaves no draft
    cache behind; one still feeding is not evicted for another's draft."""
    monkeypatch.setattr(drafter_module, "WARM_CHUNK", 4)
    drafter = DraftModel.load(draft_dir, Manifest.load(tiny_model_dir))
    tokens = list(range(5, 16))
    try:
        calls: list[int] = []
        feed = drafter._feed

        def counted(session, tokens, start, n):
            calls.append(n)
            return feed(session, tokens, start, n)
        drafter._feed = counted
        warming = drafter.warm("w", tokens)
        assert not drafter.ready("w")
        await warming
        drafter._feed = feed
        assert calls == [4, 4, 2]  # three calls: the tokens but the last, WARM_CHUNK at a time
        assert drafter.ready("w") and drafter.engine.cached_length("w") == len(tokens) - 1
        # its first draft feeds its last token and the guesses (1 + 3 - 1 rows), not the prompt
        guess, rows, _ = await drafter.engine.run(lambda: drafter._greedy("w", tokens, 3))
        assert rows == 3 and guess == await drafter.draft("fresh", tokens, 3)
        fed: list[int] = []

        def forgotten_after_the_first_chunk(session, tokens, start, n):
            feed(session, tokens, start, n)
            fed.append(drafter.engine.cached_length(session))
            if session == "gone" and len(fed) == 1:
                drafter.forget("gone")  # (the loop's call, between two of the engine's)
        drafter._feed = forgotten_after_the_first_chunk
        await drafter.warm("gone", tokens)
        assert fed == [4]  # one chunk fed, the rest not
        assert drafter.engine.cached_length("gone") == 0
        assert not drafter.warming("gone") and "gone" not in drafter._known
        # Another session's draft past MAX_SESSIONS between two of a warm's chunks evicts an
        # idle session's cache, never the one still feeding.
        monkeypatch.setattr(drafter_module, "MAX_SESSIONS", 1)

        def drafting_between_chunks(session, tokens, start, n):
            done = feed(session, tokens, start, n)
            if session == "busy" and start == 0:
                drafter._greedy("other", [5, 6, 7], 2)  # (on the engine's thread, as a draft runs)
            return done
        drafter._feed = drafting_between_chunks
        await drafter.warm("busy", tokens)
        assert drafter.ready("busy") and drafter.engine.cached_length("busy") == len(tokens) - 1
    finally:
        drafter.close()
