"""Pre-drafting served (engine.pre_drafting): the real Coordinator, Scheduler and WorkerEngine
(in-process workers over the fake models) reproduce the reference loop token for token with
pre-drafting on, for every single-draft rule, fixed and adaptive gamma, with and without
penalties; pre-drafted chains are really verified; the sampled law is the target's (chi-square); and
through real Ray actors (the carried chain is an object ref of the previous step's draft call).
The reference loop's law with pre-drafting is proven exact by enumeration in
tests/verifiers/test_pre_drafting.py."""

from __future__ import annotations


import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FAKE_MODELS, FunctionModelWorker, fake_group_config, run_in_process
from tests.verifiers.tiny_models import chi_square_pvalue, target_law
from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.penalties import Penalties
from verifiers.reference import speculative_generate

PROMPT = (1, 2, 3)
MAX_TOKENS = 20
GUESSES = 2
CHI_SQUARE_SIGNIFICANCE = 1e-3


def _coordinator(overlap: bool = False) -> Coordinator:
    config = fake_group_config(overlap=overlap, pre_drafting=GUESSES)
    workers = {m.name: LocalActorHandle(FunctionModelWorker(m, config.session_idle_timeout_s)) for m in config.models}
    return Coordinator(workers, config, export_to_ray=False)


def _run(coordinator: Coordinator, requests: list[GenerationRequest]) -> list[list]:
    return run_in_process(coordinator, requests)


def _request(seed: int, speculation: dict, max_tokens: int = MAX_TOKENS, **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=f"req-{seed}", prompt_ids=list(PROMPT), speculation=speculation,
                             sampling={"max_tokens": max_tokens, "seed": seed, "temperature": 1.0, **sampling})


def _tokens(chunks) -> list[int]:
    assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    return [t for chunk in chunks for t in chunk.token_ids]


CASES = [
    ("token", 3, {}),
    ("block", 3, {}),
    ("greedy_block", 2, {}),
    ("block", "auto", {}),
    ("token", 2, {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.4}),
]


@pytest.mark.parametrize(("method", "gamma", "penalties"), CASES)
def test_served_tokens_equal_the_reference_loop(method, gamma, penalties):
    speculation = {"strategy": "sd", "method": method, "gamma": gamma} | ({"gamma_max": 3} if gamma == "auto" else {})
    seeds = range(6)
    results = _run(_coordinator(), [_request(seed, speculation, **penalties) for seed in seeds])
    adaptive = AdaptiveGammaSettings(gamma_max=3) if gamma == "auto" else None
    reference_penalties = Penalties(presence=penalties.get("presence_penalty", 0.0),
                                    frequency=penalties.get("frequency_penalty", 0.0),
                                    repetition=penalties.get("repetition_penalty", 1.0))
    pre_drafted = 0
    for seed, chunks in zip(seeds, results):
        expected, stats = speculative_generate(
            FAKE_MODELS["draft"], FAKE_MODELS["target"], PROMPT, MAX_TOKENS, gamma=1 if gamma == "auto" else gamma,
            method=method, generator=torch.Generator().manual_seed(seed), adaptive=adaptive,
            penalties=reference_penalties, pre_drafting=GUESSES)
        assert _tokens(chunks) == expected
        final = chunks[-1].stats
        assert final.accepted_lengths == stats["accepted"] and final.draft_lengths == stats["draft_lengths"]
        assert final.pre_drafted == stats["pre_drafted"]
        pre_drafted += final.pre_drafted
    assert pre_drafted > 0


def test_two_cohorts_change_no_token():
    speculation = {"strategy": "sd", "method": "block", "gamma": 3}
    requests = [_request(seed, speculation) for seed in range(8)]
    one, two = (_run(_coordinator(overlap), requests) for overlap in (False, True))
    assert [_tokens(chunks) for chunks in one] == [_tokens(chunks) for chunks in two]


def test_sampled_law_with_pre_drafting_is_the_targets():
    """Chi-square of 4-token sequences against the target's exact law, through the served path."""
    length, count = 4, 600
    results = _run(_coordinator(), [_request(3000 + seed, {"strategy": "sd", "method": "block", "gamma": 1},
                                             max_tokens=length) for seed in range(count)])
    samples = [tuple(_tokens(chunks)) for chunks in results]
    assert sum(chunks[-1].stats.pre_drafted for chunks in results) > 0
    assert chi_square_pvalue(samples, target_law(FAKE_MODELS["target"], PROMPT, length)) > CHI_SQUARE_SIGNIFICANCE


def test_pre_drafted_chains_cross_ray_actors(ray_session):
    """The carried chain is an object ref from the previous step's draft call, passed to the
    target's next call: through real Ray actors the tokens still equal the reference loop's."""
    from cluster.serving.bringup import start_model_group
    from tests.actors.coordination.test_coordinator_reference import run_requests

    group = start_model_group(fake_group_config(overlap=False, pre_drafting=GUESSES), worker_cls=FunctionModelWorker)
    try:
        speculation = {"strategy": "sd", "method": "block", "gamma": 3}
        results = run_requests(group, [_request(seed, speculation) for seed in range(4)])
    finally:
        group.shutdown()
    for seed, chunks in enumerate(results):
        expected, stats = speculative_generate(FAKE_MODELS["draft"], FAKE_MODELS["target"], PROMPT, MAX_TOKENS,
                                               gamma=3, method="block", generator=torch.Generator().manual_seed(seed),
                                               pre_drafting=GUESSES)
        assert _tokens(chunks) == expected and chunks[-1].stats.pre_drafted == stats["pre_drafted"]
    assert sum(chunks[-1].stats.pre_drafted for chunks in results) > 0
