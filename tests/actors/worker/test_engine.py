"""The worker engine's split of a step's rows into forwards (actors.worker.forward_plan.forward_groups):
the cheapest split under its cost model, checked against every split by brute force; and the
precision its rows are computed in (engine.sampling_precision)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from actors.worker import rows
from actors.api import GenerationRequest
from actors.model.batch import linear_row
from actors.coordination.coordinator import Coordinator
from actors.worker.forward_plan import forward_groups
from benchmarks.runners import LocalActorHandle
from tests.actors.fake_models import FunctionModelWorker, fake_group_config, run_in_process
from verifiers.penalties import penalized_probs


def _rows(lengths: list[int]) -> dict:
    return {i: linear_row(i, 0, [1] * n, 0, [n - 1]) for i, n in enumerate(lengths)}


def _cost(groups: list[dict], overhead: int) -> int:
    return sum(overhead + len(group) * max(len(row) for row in group.values()) for group in groups)


def _cheapest_split(lengths: list[int], overhead: int) -> int:
    """The least cost over every partition of the rows into forwards (brute force)."""
    best = None
    indices = list(range(len(lengths)))
    for labels in itertools.product(range(len(lengths)), repeat=len(lengths)):
        groups = {}
        for index, label in zip(indices, labels):
            groups.setdefault(label, []).append(lengths[index])
        cost = sum(overhead + len(group) * max(group) for group in groups.values())
        best = cost if best is None else min(best, cost)
    return best


def test_a_prefill_gets_its_own_forward_and_decode_rows_share_one():
    rows = _rows([1] * 15 + [131])
    groups = forward_groups(rows, overhead_tokens=8)
    assert [sorted(len(r) for r in g.values()) for g in groups] == [[131], [1] * 15]


def test_prompts_of_very_different_lengths_are_not_padded_to_the_longest():
    groups = forward_groups(_rows([60, 190, 64, 1, 1]), overhead_tokens=8)
    assert [sorted(len(r) for r in g.values()) for g in groups] == [[190], [60, 64], [1, 1]]


def test_a_large_overhead_keeps_everything_in_one_forward():
    groups = forward_groups(_rows([1, 5, 16, 40]), overhead_tokens=512)
    assert len(groups) == 1 and len(groups[0]) == 4


def test_every_row_lands_in_exactly_one_forward_of_least_cost():
    generator = random.Random(0)
    for _ in range(60):
        lengths = [generator.choice([1, 2, 5, 9, 16, 30, 131]) for _ in range(generator.randint(1, 6))]
        overhead = generator.choice([0, 4, 8, 64])
        groups = forward_groups(_rows(lengths), overhead_tokens=overhead)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert _cost(groups, overhead) == _cheapest_split(lengths, overhead)


def test_no_rows_no_forwards():
    assert forward_groups({}, overhead_tokens=8) == []


# --- The rows' precision (engine.sampling_precision) ------------------------------------------


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
