"""The coordinator on real transformers models (tiny random Llamas) through Ray.

At temperature 0 every lossless strategy must produce the deterministic output of the law it
samples: ``ar`` / ``sd`` / ``multi_draft`` the target's greedy continuation, ``ensemble`` /
``se`` the argmax of the ensemble law at every step. The expected outputs are computed here
from scratch (full forward passes, no cache) with the same checkpoints. All requests of the
module run concurrently through one model group.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.request_schema import GenerationRequest
from cluster.serving.bringup import start_model_group
from verifiers.ensemble import make_ensemble, shared_vocab_logits

PROMPT = "def main(argv):\n    "
MAX_TOKENS = 24

GREEDY_CASES = {
    "ar": {"strategy": "ar"},
    "sd-token": {"strategy": "sd", "method": "token", "gamma": 4},
    "sd-block": {"strategy": "sd", "method": "block", "gamma": 5},
    "sd-greedy_block": {"strategy": "sd", "method": "greedy_block", "gamma": 3},
    "multi_draft-spectr": {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 3},
    "multi_draft-spectr_gbv": {"strategy": "multi_draft", "method": "spectr_gbv", "gamma": 4, "num_drafts": 2},
    "multi_draft-sequential_gbv": {"strategy": "multi_draft", "method": "sequential_gbv", "gamma": 3, "num_drafts": 2},
    "ensemble-weighted": {"strategy": "ensemble", "ensemble": "weighted", "members": ["target", "partner"]},
    "ensemble-contrastive": {"strategy": "ensemble", "ensemble": "contrastive", "members": ["target", "partner2"], "mu": 0.5},
    "se-weighted-token": {"strategy": "se", "method": "token", "ensemble": "weighted", "members": ["target", "partner"],
                          "gammas": [3, 2]},
    "se-weighted-block-3": {"strategy": "se", "method": "block", "ensemble": "weighted",
                            "members": ["target", "partner", "partner2"], "weights": [0.5, 0.3, 0.2],
                            "gammas": [2, 4, 3]},
    "se-contrastive-token": {"strategy": "se", "method": "token", "ensemble": "contrastive",
                             "members": ["target", "partner2"], "mu": 0.5, "gammas": [2, 3]},
}


@pytest.fixture(scope="module")
def model_group(ray_session, tiny_app_args):
    group = start_model_group(tiny_app_args)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoints["target"])


@pytest.fixture(scope="module")
def hf_models(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path).eval() for name, path in tiny_checkpoints.items()}


async def _collect(coordinator, request):
    return [await ref async for ref in coordinator.generate.options(num_returns="streaming").remote(request)]


def _run(group, requests):
    async def run_all():
        return await asyncio.gather(*(_collect(group.coordinator, r) for r in requests))

    return asyncio.run(run_all())


@pytest.fixture(scope="module")
def greedy_results(model_group):
    """Every greedy case, run concurrently (also a concurrency test: 12 requests at once)."""
    requests = [
        GenerationRequest(
            request_id=name,
            prompt=PROMPT,
            sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
            speculation=speculation,
        )
        for name, speculation in GREEDY_CASES.items()
    ]
    return dict(zip(GREEDY_CASES, _run(model_group, requests)))


@torch.inference_mode()
def _greedy(member_models, prompt_ids, steps, combine=None):
    """Argmax continuation with full (uncached) forwards; ``combine`` maps member logits
    ``[n, V]`` to the ensemble logits ``[V]``."""
    context = list(prompt_ids)
    for _ in range(steps):
        logits = [model(torch.tensor([context])).logits[0, -1].double() for model in member_models]
        row = shared_vocab_logits(logits)[0] if combine is None else combine(shared_vocab_logits(logits))
        context.append(int(torch.argmax(row)))
    return context[len(prompt_ids):]


def _expected(case, hf_models, prompt_ids):
    speculation = GREEDY_CASES[case]
    if speculation["strategy"] in ("ar", "sd", "multi_draft"):
        return _greedy([hf_models["target"]], prompt_ids, MAX_TOKENS)
    members = speculation["members"]
    function = make_ensemble(
        speculation["ensemble"], len(members), weights=speculation.get("weights"), mu=speculation.get("mu", 0.1)
    )
    return _greedy([hf_models[m] for m in members], prompt_ids, MAX_TOKENS, combine=function.logits)


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_output_equals_the_law_argmax(case, greedy_results, hf_models, tokenizer):
    chunks = greedy_results[case]
    final = chunks[-1]
    assert final.finished and final.error is None, final.error
    assert final.finish_reason == "length"
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert tokens == _expected(case, hf_models, prompt_ids)
    assert len(chunks) > 2  # streamed as accepted, not in one piece at the end
    # Streamed text deltas add up to the decoded output.
    text = "".join(chunk.text for chunk in chunks)
    assert text == tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stats = final.stats
    assert stats.completion_tokens == MAX_TOKENS
    assert stats.target_calls >= 1 and stats.block_efficiency == pytest.approx(MAX_TOKENS / stats.target_calls)


def test_speculation_needs_fewer_target_calls_than_ar(greedy_results):
    """The draft is a perturbed copy of the target, so blocks are mostly accepted."""
    ar_calls = greedy_results["ar"][-1].stats.target_calls
    sd_stats = greedy_results["sd-token"][-1].stats
    assert ar_calls == MAX_TOKENS
    assert sd_stats.target_calls < ar_calls
    assert sd_stats.model_calls["draft"] > 0 and sd_stats.bytes_moved > 0


def test_stop_string_cuts_text_and_finishes_with_stop(model_group, greedy_results, tokenizer):
    reference_text = "".join(chunk.text for chunk in greedy_results["sd-token"])
    start = next(i for i in range(4, len(reference_text) - 3) if "\ufffd" not in reference_text[i : i + 3])
    stop = reference_text[start : start + 3]
    request = GenerationRequest(
        request_id="stop",
        prompt=PROMPT,
        sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "stop": [stop], "ignore_eos": True},
        speculation={"strategy": "sd", "method": "token", "gamma": 4},
    )
    (chunks,) = _run(model_group, [request])
    text = "".join(chunk.text for chunk in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert text == reference_text[: reference_text.index(stop)]


def test_eos_ends_the_request_unless_ignored(model_group, greedy_results):
    """A second coordinator over the same workers treats a token of the greedy continuation as
    EOS: generation stops before it (EOS is not part of the output) unless ignore_eos."""
    import ray

    from actors.coordination.coordinator import Coordinator

    greedy = [t for chunk in greedy_results["ar"] for t in chunk.token_ids]
    position = next(k for k in range(3, len(greedy)) if greedy[k] not in greedy[:k])
    coordinator = ray.remote(Coordinator).remote(model_group.workers, model_group.config, eos_token_ids=[greedy[position]])
    try:
        for ignore_eos, expected, reason in [(False, greedy[:position], "stop"), (True, greedy, "length")]:
            request = GenerationRequest(
                request_id=f"eos-{ignore_eos}",
                prompt=PROMPT,
                sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": ignore_eos},
                speculation={"strategy": "sd", "method": "token", "gamma": 4},
            )
            chunks = asyncio.run(_collect(coordinator, request))
            assert [t for chunk in chunks for t in chunk.token_ids] == expected
            assert chunks[-1].finish_reason == reason
        # This coordinator releases its requests' sessions after their last chunks; killed
        # before that, it would leave them open on the shared workers.
        assert not any(_open_sessions_after_release(model_group))
    finally:
        ray.kill(coordinator)


def _open_sessions_after_release(model_group, timeout_s: float = 20.0) -> list[int]:
    """Every worker's open sessions, polled until none is left or ``timeout_s`` passes: a
    finished request's sessions are released by its coordinator's next worker call, which
    follows the request's last chunk."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        counts = [ray.get(worker.num_sessions.remote()) for worker in model_group.workers.values()]
        if not any(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_sessions_are_released_after_requests(model_group, greedy_results):
    assert not any(_open_sessions_after_release(model_group))


@pytest.mark.parametrize("speculation", [{"strategy": "sd", "method": "greedy_block", "gamma": 6},
                                         {"strategy": "sd", "method": "greedy_block", "gamma": "auto"}])
def test_greedy_block_fills_the_context_on_real_models(model_group, tokenizer, speculation):
    """Sampled greedy_block with max_tokens filling the 256-token context exactly: the last
    blocks draft past the context end (scratch columns) rather than below the pending
    modification, and every request completes."""
    from tests.conftest import TINY_CONTEXT

    max_tokens = TINY_CONTEXT - len(tokenizer(PROMPT)["input_ids"])
    requests = [
        GenerationRequest(request_id=f"fill-{seed}", prompt=PROMPT, speculation=speculation,
                          sampling={"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, "seed": seed})
        for seed in range(3)
    ]
    for chunks in _run(model_group, requests):
        final = chunks[-1]
        assert final.finished and final.error is None, final.error
        assert final.stats.completion_tokens == max_tokens
