"""se with the alternate proposer and gamma "auto" (actors/coordination/policy.py): the step policy
measures whole steps of proposals and of plain ensemble steps and the requests follow the faster,
probing the other; whatever it decides, the sampled law is the ensemble's (chi-square through an
in-process coordinator on the deterministic fake workers, tests/actors/fake_models.py; the exact
enumeration with a scripted mode sequence is in tests/verifiers/test_ensemble.py)."""

from __future__ import annotations

from actors.api import GenerationRequest
from actors.coordination.coordinator import Coordinator
from benchmarks.runners import LocalActorHandle
from tests.actors.fake_models import FAKE_MODELS, FunctionModelWorker, fake_group_config, run_in_process
from tests.verifiers.tiny_models import chi_square_pvalue
from verifiers.reference.ensemble import ensemble_next_token_probs
from verifiers.reference.exact import sequence_law

PROMPT = (1, 2, 3)
CHI_SQUARE_SIGNIFICANCE = 1e-3
SPECULATION = {"strategy": "se", "proposer": "alternate", "gamma": "auto", "members": ["target", "partner"]}


def test_alternate_gamma_auto_measures_both_kinds_of_step_and_keeps_the_ensemble_law():
    length, count = 3, 400
    config = fake_group_config(overlap=False, goodput_gamma=True)
    workers = {m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}
    coordinator = Coordinator(workers, config, export_to_ray=False)
    requests = [GenerationRequest(request_id=f"r{i}", prompt_ids=list(PROMPT), speculation=SPECULATION,
                                  sampling={"max_tokens": length, "seed": i, "temperature": 1.0})
                for i in range(count)]
    results = run_in_process(coordinator, requests, timeout_s=300)
    samples = []
    for chunks in results:
        assert chunks[-1].error is None, chunks[-1].error
        samples.append(tuple(t for chunk in chunks for t in chunk.token_ids))
    rates = coordinator.scheduler.policy.alternate_rates.means
    assert set(rates) == {"plain", "speculative"}, rates  # both measured: each was tried
    law = sequence_law(ensemble_next_token_probs([FAKE_MODELS["target"], FAKE_MODELS["partner"]]), PROMPT, length)
    assert chi_square_pvalue(samples, law) > CHI_SQUARE_SIGNIFICANCE
