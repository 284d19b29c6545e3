"""lm-evaluation-harness against a real daemon, as a user measures a model's quality:
its ``local-completions`` model scores a small multiple-choice task
(tests/data/lm_eval_mc.jsonl, defined here as an lm-eval task) through meshd's
/v1/completions (prompt logprobs), and its ``hf`` model scores the same task on the
same float32 weights in transformers. Each item's choice log-likelihoods agree, and
the two pick the same answers (one item may differ, where two choices tie within
rounding), so the accuracy lm-eval reports for meshd is the model's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fixtures.daemon import http_get, running_daemon

DATA = Path(__file__).resolve().parent / "data" / "lm_eval_mc.jsonl"
TASK = "meshd_mc"
LOGLIK_TOLERANCE = 1e-3  # a continuation's summed log-probability (a few tokens, float32 both sides)

# lm-eval's own task format: one JSON line per item, a question and its choices, the
# answer an index. Each choice starts with its space, so nothing goes between them.
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm-eval-task")
    (out / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=DATA))
    return out


@pytest.fixture(scope="module")
def hf_tokenizer_dir(real_gguf_path, tmp_path_factory) -> Path:
    """The GGUF's tokenizer as transformers reads it, saved where lm-eval can load it by path."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf-tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(str(real_gguf_path.parent), gguf_file=real_gguf_path.name)
    tok.save_pretrained(out)
    return out


def by_item(results: dict) -> dict[int, list[float]]:
    """Per item (doc_id), the log-likelihood of each choice, in choice order."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"][TASK]}


def picked(lls: list[float]) -> int:
    return max(range(len(lls)), key=lls.__getitem__)


def test_lm_eval_local_completions_scores_what_its_hf_model_scores(real_fp32_dir, hf_tokenizer_dir, task_dir,
                                                                  tmp_path):
    import lm_eval
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from tests.test_parity_transformers import hf_model_from_shards

    items = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    tasks = TaskManager(include_path=str(task_dir))
    with running_daemon(real_fp32_dir, tmp_path / "state", tmp_path / "meshd.log") as served:
        models = json.loads(http_get(served.url + "/v1/models")[1])
        name = models["data"][0]["id"]
        api = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": served.url + "/v1/completions", "model": name,
                        "tokenizer_backend": "huggingface", "tokenizer": str(hf_tokenizer_dir),
                        "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1},
            tasks=[TASK], task_manager=tasks, log_samples=True)
    hf_model = hf_model_from_shards(real_fp32_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    with torch.inference_mode():
        hf = lm_eval.simple_evaluate(model=HFLM(pretrained=hf_model, tokenizer=tokenizer, batch_size=8),
                                     tasks=[TASK], task_manager=tasks, log_samples=True)

    ours, theirs = by_item(api), by_item(hf)
    assert sorted(ours) == sorted(theirs) == list(range(len(items)))
    for doc_id in ours:
        assert ours[doc_id] == pytest.approx(theirs[doc_id], abs=LOGLIK_TOLERANCE), (items[doc_id], ours[doc_id],
                                                                                     theirs[doc_id])
    differ = [d for d in ours if picked(ours[d]) != picked(theirs[d])]
    assert len(differ) <= 1, [(items[d], ours[d], theirs[d]) for d in differ]
    acc_api, acc_hf = api["results"][TASK]["acc,none"], hf["results"][TASK]["acc,none"]
    assert abs(acc_api - acc_hf) <= 1 / len(items) + 1e-9, (acc_api, acc_hf)
    worst = max(abs(a - b) for d in ours for a, b in zip(ours[d], theirs[d]))
    print(f"lm-eval acc: meshd {acc_api:.3f}, hf {acc_hf:.3f} over {len(items)} items; "
          f"largest log-likelihood difference {worst:.2e}")
    # The model answers more than chance would (a task that scores nothing proves nothing).
    assert acc_api > 0.5, acc_api
