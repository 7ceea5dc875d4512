"""lm-evaluation-harness scores the served model: its ``local-completions`` model against the
session's Serve application, on two small local tasks (``tests/cluster/lm_eval_tasks``), run
to the end.

- multiple choice (loglikelihood requests: ``echo`` + ``logprobs`` + ``max_tokens: 1``): every
  choice's log-likelihood equals the tiny target's own (a transformers forward over the same
  tokens), and the accuracy equals the one those log-likelihoods give;
- generate_until (greedy, cut at a newline): every answer is the target's greedy continuation.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# after the offline settings above, which it reads at import; the `eval` extra (not in `test`)
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the `eval` extra: pip install -e '.[eval]'")

TASKS = pathlib.Path(__file__).parent / "lm_eval_tasks"
TOLERANCE = 1e-4  # float32: the served forward vs one transformers forward


def _task(name: str) -> dict:
    """The task's config with its data file's absolute path."""
    config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {split: str(TASKS / path) for split, path in files.items()}
    return config


def _evaluate(serve_app, tiny_checkpoints, *names: str) -> dict:
    model_args = {
        "base_url": f"{serve_app.http_url}/v1/completions",
        "model": serve_app.model,
        "tokenizer": str(tiny_checkpoints["target"]),
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
        "max_length": 512,
    }
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                   tasks=[_task(name) for name in names], log_samples=True, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def _loglikelihood(greedy_reference, context: str, continuation: str) -> float:
    """The continuation's log-likelihood under the tiny target, tokenized as lm-eval does
    (trailing spaces of the context move to the continuation; the whole text, split where the
    context's tokens end)."""
    torch = greedy_reference._torch
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = greedy_reference.encode(context)
    whole = greedy_reference.encode(context + continuation)
    continuation_ids = whole[len(context_ids):]
    ids = context_ids + continuation_ids
    with torch.inference_mode():
        logits = greedy_reference.model(torch.tensor([ids])).logits[0].float()  # [L, V]
    rows = torch.log_softmax(logits[len(context_ids) - 1: -1], dim=-1)  # [C, V]
    return float(rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum())


def test_lm_eval_scores_multiple_choice_and_generation_like_the_model(serve_app, tiny_checkpoints, greedy_reference):
    results = _evaluate(serve_app, tiny_checkpoints, "specserve_mc", "specserve_gen")
    samples = results["samples"]

    choice_samples = samples["specserve_mc"]
    assert len(choice_samples) == 5
    correct = 0
    for sample in choice_samples:
        served = [float(resp[0][0]) for resp in sample["resps"]]
        expected = [_loglikelihood(greedy_reference, context, continuation)
                    for context, continuation in sample["arguments"]]  # one (context, choice) per choice
        assert max(abs(a - b) for a, b in zip(served, expected)) < TOLERANCE
        correct += int(max(range(len(expected)), key=expected.__getitem__) == sample["target"])
    assert results["results"]["specserve_mc"]["acc,none"] == pytest.approx(correct / len(choice_samples))

    generation_samples = samples["specserve_gen"]
    assert len(generation_samples) == 3
    for sample in generation_samples:
        prompt = sample["arguments"][0][0]  # (context, generation kwargs)
        greedy = greedy_reference.decode(greedy_reference.continuation(greedy_reference.encode(prompt), 8))
        assert sample["resps"][0][0] == greedy.split("\n")[0].split("<|endoftext|>")[0]
    exact = sum(s["resps"][0][0] == s["target"] for s in generation_samples) / len(generation_samples)
    assert results["results"]["specserve_gen"]["exact_match,none"] == pytest.approx(exact)
