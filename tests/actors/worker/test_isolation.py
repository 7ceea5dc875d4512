"""Failures stay with their request (actors.worker.isolation.batched_then_alone): a batched call
that raises falls back to one call per request, and only the requests whose own work fails fail;
through the engine, a failing row, draw or verification spares its neighbours, which get the
tokens they get when nothing fails."""

from __future__ import annotations

import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from actors.messages import OpenSession, RowSampling, WorkItem
from actors.worker import step
from actors.worker.isolation import batched_then_alone
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FAKE_MODELS, POISON_PROMPT, FunctionModelWorker, fake_group_config, run_in_process
from verifiers.machines.needs import NextLogits


class _Calls:
    """Records what batched_then_alone ran; ``bad`` keys raise in their call alone."""

    def __init__(self, batched_raises: bool, bad: tuple[str, ...] = ()):
        self.batched_raises, self.bad = batched_raises, bad
        self.batched: list[list[str]] = []
        self.alone: list[str] = []
        self.used: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def run(self, keys: list[str]) -> None:
        batched_then_alone(keys, self._batched, self._alone, self.used.__setitem__,
                           lambda key, error: self.failed.__setitem__(key, str(error)), "a test call")

    def _batched(self, keys: list[str]) -> list[str]:
        self.batched.append(list(keys))
        if self.batched_raises:
            raise RuntimeError("batched")
        return [f"{key} together" for key in keys]

    def _alone(self, key: str) -> str:
        self.alone.append(key)
        if key in self.bad:
            raise RuntimeError(f"{key} fails")
        return f"{key} alone"


def test_a_batched_call_that_works_serves_every_key_and_nothing_runs_alone():
    calls = _Calls(batched_raises=False)
    calls.run(["a", "b", "c"])
    assert calls.batched == [["a", "b", "c"]] and calls.alone == [] and calls.failed == {}
    assert calls.used == {"a": "a together", "b": "b together", "c": "c together"}


def test_a_failed_batched_call_runs_each_alone_and_fails_only_the_keys_that_fail():
    calls = _Calls(batched_raises=True, bad=("b",))
    calls.run(["a", "b", "c"])
    assert calls.alone == ["a", "b", "c"]
    assert calls.used == {"a": "a alone", "c": "c alone"} and calls.failed == {"b": "b fails"}


def test_a_single_key_whose_call_fails_is_not_run_again():
    calls = _Calls(batched_raises=True)
    calls.run(["a"])
    assert calls.batched == [["a"]] and calls.alone == [] and calls.failed == {"a": "batched"}


def test_a_use_that_raises_fails_only_its_key():
    used: dict[str, int] = {}
    failed: list[str] = []

    def use(key: str, value: int) -> None:
        if key == "b":
            raise ValueError("bad value")
        used[key] = value

    batched_then_alone(["a", "b"], lambda keys: [1, 2], lambda key: 0, use, lambda key, error: failed.append(key))
    assert used == {"a": 1} and failed == ["b"]


def test_no_keys_no_calls():
    calls = _Calls(batched_raises=True)
    calls.run([])
    assert calls.batched == [] and calls.used == {} and calls.failed == {}


# --- Through the engine ------------------------------------------------------------------------


def test_a_row_that_fails_in_a_batched_forward_spares_the_others():
    """A poisoned prompt's row raises inside the batched forward: the forward is run row by row,
    the poisoned request fails and its session is freed, the other gets its exact logits."""
    worker = FunctionModelWorker(fake_group_config().models[0], 60.0)
    prompt = (1, 2, 3)
    items = [WorkItem(name, NextLogits("target", ()), open=OpenSession(ids, RowSampling(), {}))
             for name, ids in (("poisoned", POISON_PROMPT + (1, 2, 3)), ("fine", prompt))]
    outcomes, _ = worker.run_step(items)
    assert "PoisonError" in outcomes[0].error
    assert outcomes[1].error is None
    expected = torch.as_tensor(FAKE_MODELS["target"](prompt), dtype=torch.float64)
    assert torch.equal(outcomes[1].value, expected)
    assert worker.engine.sessions.ids() == ["fine"]


SPECULATIONS = [
    {"strategy": "ar"},
    {"strategy": "sd", "method": "token", "gamma": 3},
    {"strategy": "sd", "method": "block", "gamma": 2},
    {"strategy": "multi_draft", "method": "spectr", "gamma": 2, "num_drafts": 2},
]


def _tokens(speculation: dict) -> list[list[int]]:
    """Three seeded requests of ``speculation`` served together (their draws and verifications
    batched in the workers' steps); each one's tokens."""
    config = fake_group_config(overlap=False)
    workers = {m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}
    coordinator = Coordinator(workers, config, export_to_ray=False)
    requests = [GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3 + i], speculation=speculation,
                                  sampling={"max_tokens": 8, "seed": 11 + i, "temperature": 1.0}) for i in range(3)]
    results = run_in_process(coordinator, requests)
    for chunks in results:
        assert chunks[-1].error is None, chunks[-1].error
    return [[t for chunk in chunks for t in chunk.token_ids] for chunks in results]


@pytest.mark.parametrize("speculation", SPECULATIONS)
def test_batched_draws_and_verifications_that_fail_fall_back_to_the_same_tokens(monkeypatch, speculation):
    """With the batched draw and verifier calls failing every time, each request's draws and
    verification run alone, on the same streams: every token is the one the batched calls give."""
    batched = _tokens(speculation)
    calls = {"draw": 0, "verify": 0}

    def failing(kind: str):
        def call(*args, **kwargs):
            calls[kind] += 1
            raise RuntimeError(f"batched {kind} failed")
        return call

    monkeypatch.setattr(step, "categorical_together", failing("draw"))
    monkeypatch.setattr(step, "verify_together", failing("verify"))
    alone = _tokens(speculation)
    assert alone == batched and all(len(tokens) == 8 for tokens in alone)
    assert calls["draw"] > 0  # the fallback was exercised
    if speculation.get("method") in ("token", "block"):
        assert calls["verify"] > 0
