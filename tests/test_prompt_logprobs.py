"""Prompt logprobs on /v1/completions (``echo`` with ``logprobs``, and ``max_tokens: 0``), as
evaluation harnesses read them (lm-evaluation-harness's ``local-completions`` sums
``token_logprobs`` over a continuation): they must be the model's own log-softmax of the
prompt, row by row, as transformers computes it on the same float32 weights, on one node and
through a mesh whose head runs on the supernode after the other peer's span.

The prompt is longer than a step's chunk (PREFILL_CHUNK) and than the head's slice
(HEAD_ROWS), so it is scored in several bounded passes; over two stages it goes as a
pipelined prefill (the wavefront), scored chunk by chunk behind it.
"""

from __future__ import annotations

import json
import urllib.request

import aiohttp
import pytest
import torch

from meshd.serving.pipeline import PREFILL_CHUNK
from shards.engine import HEAD_ROWS
from shards.tokenizer import MeshTokenizer
from tests.fixtures.api import complete
from tests.fixtures.daemon import running_node

transformers = pytest.importorskip("transformers")

# Public domain (Jerome K. Jerome, Three Men in a Boat, 1889).
TEXT = (
    "There were four of us - George, and William Samuel Harris, and myself, and Montmorency. We were sitting "
    "in my room, smoking, and talking about how bad we were - bad from a medical point of view I mean, of "
    "course. We were all feeling seedy, and we were getting quite nervous about it. Harris said he felt such "
    "extraordinary fits of giddiness come over him at times, that he hardly knew what he was doing; and then "
    "George said that he had fits of giddiness too, and hardly knew what he was doing. With me, it was my "
    "liver that was out of order. I knew it was my liver that was out of order, because I had just been "
    "reading a patent liver-pill circular, in which were detailed the various symptoms by which a man could "
    "tell when his liver was out of order. I had them all. It is a most extraordinary thing, but I never read "
    "a patent medicine advertisement without being impelled to the conclusion that I am suffering from the "
    "particular disease therein dealt with in its most virulent form. The diagnosis seems in every case to "
    "correspond exactly with all the sensations that I have ever felt. I remember going to the British Museum "
    "one day to read up the treatment for some slight ailment of which I had a touch - hay fever, I fancy it "
    "was. I got down the book, and read all I came to read; and then, in an unthinking moment, I idly turned "
    "the leaves, and began to indolently study diseases, generally."
)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(real_fp32_dir):
    """The prompt's ids and transformers' log-softmax of every row [T, V], float32."""
    from tests.test_parity_transformers import hf_model_from_shards

    ids = MeshTokenizer.load(real_fp32_dir).encode_prompt(TEXT)
    assert len(ids) > PREFILL_CHUNK and len(ids) > HEAD_ROWS, len(ids)
    model = hf_model_from_shards(real_fp32_dir)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(choice: dict, ids: list[int], want: torch.Tensor, k: int) -> float:
    """The choice's first len(ids) logprob entries against the reference; the worst error."""
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) >= n and len(lp["token_logprobs"]) == len(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    expect = want[torch.arange(n - 1), torch.tensor(ids[1:])]  # row p scores token p + 1
    got = torch.tensor(lp["token_logprobs"][1:n], dtype=torch.float32)
    worst = float((got - expect).abs().max())
    assert worst < TOLERANCE, worst
    tops = want[: n - 1].topk(k).values
    for p in range(1, n):
        top = lp["top_logprobs"][p]
        assert len(top) == k
        assert abs(max(top.values()) - float(tops[p - 1, 0])) < TOLERANCE
        # the top k's values as transformers ranks them (a tie may swap which token shows)
        assert sorted(top.values(), reverse=True) == pytest.approx(tops[p - 1].tolist(), abs=TOLERANCE)
    return worst


@pytest.mark.real_model
@pytest.mark.timeout(900)
@pytest.mark.asyncio(loop_scope="module")
async def test_prompt_logprobs_equal_transformers_on_one_node(real_fp32_dir, reference, tmp_path):
    ids, want = reference
    async with running_node(real_fp32_dir, tmp_path / "state") as served, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        # max_tokens 0: the prompt alone, scored
        data = await complete(http, served.url, {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 0,
                                                 "temperature": 0})
        [choice] = data["choices"]
        assert choice["text"] == TEXT and choice["token_ids"] == [] and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        worst = check_prompt_logprobs(choice, ids, want, 2)
        print(f"\none node: {len(ids)} prompt tokens, worst |logprob - transformers'| {worst:.2e}")

        # with a completion after it: text is prompt + completion, the entries run on
        data = await complete(http, served.url, {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3,
                                                 "temperature": 0})
        [choice] = data["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3 and len(choice["token_ids"]) == 3
        assert choice["text"].startswith(TEXT) and len(choice["text"]) > len(TEXT)
        check_prompt_logprobs(choice, ids, want, 1)
        first = float(want[-1, choice["token_ids"][0]])  # greedy: the first token's logprob, the last row's max
        assert abs(lp["token_logprobs"][len(ids)] - first) < TOLERANCE
        assert lp["text_offset"][len(ids)] == sum(len(t) for t in lp["tokens"][: len(ids)])

        # the same streamed: the first event carries the echo and the prompt's entries
        async with http.post(served.url + "/v1/completions", json={
                "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "stream": True}) as r:
            raw = (await r.read()).decode()
        events = [json.loads(b.removeprefix("data: ")) for b in raw.split("\n\n") if b.startswith("data: {")]
        streamed = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=TOLERANCE)
        assert events[0]["choices"][0]["text"].startswith(TEXT)


@pytest.mark.netns
@pytest.mark.real_model
@pytest.mark.timeout(900)
def test_prompt_logprobs_equal_transformers_through_a_two_peer_mesh(meshlab, real_fp32_dir, reference):
    ids, want = reference
    hosts = [meshlab.lab.add_host() for _ in range(2)]
    daemons = [meshlab.start(h, model=str(real_fp32_dir), vram=(2 - i) * 10**9, layer_delay_ms=2.0)
               for i, h in enumerate(hosts)]
    view = meshlab.wait_converged(daemons, n_stages=2, timeout=240)
    assert len({a["node"] for a in view["plan"]}) == 2, view["plan"]
    entry = next(d for d in daemons if d.node_id != view["supernode"])  # proxied to the supernode
    body = json.dumps({"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(entry.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        data = json.loads(resp.read())
    [choice] = data["choices"]
    assert choice["text"].startswith(TEXT) and len(choice["logprobs"]["tokens"]) == len(ids) + 2
    worst = check_prompt_logprobs(choice, ids, want, 1)
    print(f"\n2-peer mesh: {len(ids)} prompt tokens, worst |logprob - transformers'| {worst:.2e}")


@pytest.mark.asyncio(loop_scope="module")
async def test_echo_with_max_tokens_0_is_the_prompt_back(tiny_node, client):
    """Without logprobs nothing runs: the prompt is the answer (bad values: test_api_validation.py)."""
    data = await complete(client, tiny_node.url, {"prompt": "hi there", "echo": True, "max_tokens": 0})
    [choice] = data["choices"]
    assert choice["text"] == "hi there" and choice["logprobs"] is None and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_lm_eval_local_completions_payload_scores_each_choice(tiny_node, client):
    """What lm-evaluation-harness's ``local-completions`` sends for a multiple-choice item: one
    request, the context followed by each choice as token-id lists, ``echo``, ``logprobs: 1``,
    ``max_tokens: 1``; it reads ``token_logprobs[ctxlen:-1]`` of each choice (in prompt order)
    and whether each was the top token. The context's own entries are alike in every choice, and
    a choice's sum is what the same prompt scored alone (``max_tokens: 0``) gives."""
    context = [10, 20, 30, 40, 50, 60, 70]
    choices = [[11, 12], [21, 22, 23], [31]]
    prompts = [context + c for c in choices]
    data = await complete(client, tiny_node.url, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                                  "temperature": 0, "seed": 1234})
    got = sorted(data["choices"], key=lambda c: c["index"])
    assert len(got) == len(prompts)
    for prompt, choice in zip(prompts, got):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1  # the prompt, then the one generated token
        part = lp["token_logprobs"][len(context):-1]
        assert len(part) == len(prompt) - len(context) and all(v <= 0 for v in part)
        # the top token's logprob is at least the prompt token's (lm-eval's is_greedy compares them)
        assert all(max(top.values()) >= v - 1e-6 for v, top in zip(part, lp["top_logprobs"][len(context):-1]))
        assert lp["token_logprobs"][1:len(context)] == pytest.approx(got[0]["logprobs"]["token_logprobs"][1:len(context)],
                                                                     abs=1e-5)
        alone = await complete(client, tiny_node.url, {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0})
        assert sum(alone["choices"][0]["logprobs"]["token_logprobs"][len(context):]) == pytest.approx(sum(part), abs=1e-4)
