"""The precision a worker's rows are computed in (actors.worker.rows, engine.sampling_precision):
every row a worker draws from or verifies against, through the served path."""

from __future__ import annotations

import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from actors.worker import rows
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FunctionModelWorker, fake_group_config, run_in_process
from verifiers.penalties import penalized_probs


def _precision_run(monkeypatch, precision: str, speculation: dict) -> tuple[set, list[int]]:
    """One seeded request through the in-process Coordinator and WorkerEngines over the fake
    models; returns (the dtypes of every row the workers computed, the tokens)."""
    config = fake_group_config(overlap=False, sampling_precision=precision)
    coordinator = Coordinator({m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}, config,
                              export_to_ray=False)
    seen: set = set()

    def recording(*args, **kwargs):
        rows = penalized_probs(*args, **kwargs)
        seen.add(rows.dtype)
        return rows

    monkeypatch.setattr(rows, "penalized_probs", recording)
    request = GenerationRequest(request_id="r", prompt_ids=[1, 2, 3], speculation=speculation,
                                sampling={"max_tokens": 12, "seed": 5, "temperature": 1.0})

    (chunks,) = run_in_process(coordinator, [request])
    assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    return seen, [t for chunk in chunks for t in chunk.token_ids]


@pytest.mark.parametrize("speculation", [{"strategy": "ar"}, {"strategy": "sd", "method": "block", "gamma": 3},
                                         {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 2}])
def test_workers_compute_rows_in_the_groups_precision(monkeypatch, speculation):
    """float32 (as a GPU worker is set by auto): every row a worker draws from or verifies against
    is float32; auto without GPUs: float64. The tokens are the same seeded (float32 rounding moves a
    draw only when a uniform lands within ~1e-7 of a CDF step)."""
    seen32, tokens32 = _precision_run(monkeypatch, "float32", speculation)
    seen_auto, tokens_auto = _precision_run(monkeypatch, "auto", speculation)
    assert seen32 == {torch.float32}
    assert seen_auto == {torch.float64}
    assert tokens32 == tokens_auto


def test_ensemble_member_draws_stay_float64(monkeypatch):
    """se: a member's proposal rows are recomputed on the coordinator in float64 to verify them, so
    the worker draws them in float64 whatever the precision."""
    seen, _ = _precision_run(monkeypatch, "float32", {"strategy": "se", "method": "block", "ensemble": "weighted",
                                                      "members": ["target", "partner"], "gammas": [2, 2]})
    assert seen == {torch.float64}
