"""se with gamma "auto" choosing by measured goodput (actors/coordination/policy.py). The alternate
proposer: the step policy measures whole steps of proposals and of plain ensemble steps and the
requests follow the faster, probing the other. A draft proposer: its steps (the draft's call, the
members' scoring calls) feed the step-cost model, whose costs its blocks are chosen from. Whatever
is decided, the sampled law is the ensemble's (chi-square through an in-process coordinator on the
deterministic fake workers, tests/actors/fake_models.py; the exact enumerations with scripted
choice sequences are in tests/verifiers/test_ensemble.py and test_ensemble_draft.py)."""

from __future__ import annotations

import pytest

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FAKE_MODELS, FunctionModelWorker, fake_group_config, run_in_process
from tests.verifiers.tiny_models import chi_square_pvalue
from verifiers.reference.ensemble import ensemble_next_token_probs
from verifiers.reference.exact import sequence_law

PROMPT = (1, 2, 3)
CHI_SQUARE_SIGNIFICANCE = 1e-3
SPECULATION = {"strategy": "se", "proposer": "alternate", "gamma": "auto", "members": ["target", "partner"]}


LENGTH = 3


def _served(speculation: dict, count: int) -> tuple[Coordinator, list[tuple[int, ...]]]:
    """``count`` seeded 3-token requests served together by an in-process coordinator with
    goodput on; the coordinator and the sequences."""
    config = fake_group_config(overlap=False, goodput_gamma=True)
    workers = {m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}
    coordinator = Coordinator(workers, config, export_to_ray=False)
    requests = [GenerationRequest(request_id=f"r{i}", prompt_ids=list(PROMPT), speculation=speculation,
                                  sampling={"max_tokens": LENGTH, "seed": i, "temperature": 1.0})
                for i in range(count)]
    samples = []
    for chunks in run_in_process(coordinator, requests, timeout_s=300):
        assert chunks[-1].error is None, chunks[-1].error
        samples.append(tuple(t for chunk in chunks for t in chunk.token_ids))
    return coordinator, samples


def _ensemble_pvalue(samples) -> float:
    law = sequence_law(ensemble_next_token_probs([FAKE_MODELS["target"], FAKE_MODELS["partner"]]), PROMPT, LENGTH)
    return chi_square_pvalue(samples, law)


@pytest.mark.slow  # samples for a chi-square
def test_alternate_gamma_auto_measures_both_kinds_of_step_and_keeps_the_ensemble_law():
    coordinator, samples = _served(SPECULATION, 400)
    rates = coordinator.scheduler.policy.alternate_rates.steps
    assert set(rates) == {"plain", "speculative"}, rates  # both measured: each was tried
    assert _ensemble_pvalue(samples) > CHI_SQUARE_SIGNIFICANCE


def test_drafted_gamma_auto_learns_the_members_scoring_costs_and_keeps_the_ensemble_law():
    speculation = {"strategy": "se", "proposer": "draft", "gamma": "auto", "gamma_max": 3,
                   "members": ["target", "partner"]}
    coordinator, samples = _served(speculation, 400)
    policy = coordinator.scheduler.policy
    assert {"draft", "target", "partner"} <= set(policy.cost_model.forwards)  # the ScoreBlock calls were measured
    assert policy.cost_model.speculative_overhead.measured
    assert _ensemble_pvalue(samples) > CHI_SQUARE_SIGNIFICANCE
