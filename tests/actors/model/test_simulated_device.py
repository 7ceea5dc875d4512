"""The simulated device (engine.simulated_device, benchmarks only): every forward lasts as long
as the cost model says (a fake clock checks the waits), the worker's forward time reports it, and
it changes no token of any strategy."""

from __future__ import annotations


import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from actors.model.batch import linear_row
from actors.model.simulated_device import (
    SharedTimeline,
    SimulatedBackend,
    SimulatedDevice,
    on_simulated_device,
    simulated_device,
)
from benchmarks.served.runners import LocalActorHandle
from cluster.config import ConfigError, SimulatedDeviceArgs, parse_app_args
from tests.actors.fake_models import FAKE_MODELS, VOCAB, FunctionBackend, FunctionModelWorker, fake_group_config, run_in_process

PROMPT = (1, 2, 3)


class FakeClock:
    """Time moves only when the device sleeps, or when a test moves it (the real forward)."""

    def __init__(self):
        self.time = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.time += seconds


@pytest.mark.parametrize(("tokens", "real_ms", "expected_wait_ms"), [(1, 0.0, 40.1), (5, 10.0, 30.5), (9, 60.0, None)])
def test_a_forward_lasts_what_the_cost_model_says(tokens, real_ms, expected_wait_ms):
    clock = FakeClock()
    device = SimulatedDevice(fixed_ms=40.0, per_token_ms=0.1, clock=clock)
    started = clock.now()
    clock.time += real_ms / 1000  # the real forward
    device.finish(started, tokens)
    if expected_wait_ms is None:  # the real forward took longer than the model: no wait
        assert clock.sleeps == []
    else:
        assert clock.sleeps == [pytest.approx(expected_wait_ms / 1000)]
        assert clock.now() - started == pytest.approx(device.forward_seconds(tokens))


def test_the_wrapped_backend_waits_for_the_modelled_forward_of_every_row():
    """SimulatedBackend: the wrapped backend's own logits, returned once the modelled forward over
    the tokens of every row is over; everything else is the wrapped backend's."""
    clock = FakeClock()
    plain, inner = FunctionBackend(FAKE_MODELS["target"], VOCAB), FunctionBackend(FAKE_MODELS["target"], VOCAB)
    backend = SimulatedBackend(inner, SimulatedDevice(fixed_ms=40.0, per_token_ms=0.5, clock=clock))
    rows = []
    for fake in (plain, backend):
        rows = [linear_row(fake.allocate(), 0, list(PROMPT), 0, [2]), linear_row(fake.allocate(), 0, [4, 5], 0, [0, 1])]
    expected = plain.forward(rows)
    got = backend.forward(rows)
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == 2
    assert clock.sleeps == [pytest.approx((40.0 + 0.5 * 5) / 1000)]  # 3 + 2 tokens, one forward
    assert backend.max_slots == inner.max_slots and backend.free_slots() == inner.free_slots()


def test_a_worker_is_wrapped_only_on_a_simulated_device():
    spec = fake_group_config().models[0]
    backend = FunctionBackend(FAKE_MODELS["target"], VOCAB)
    assert on_simulated_device(backend, spec) is backend
    simulated = spec.model_copy(update={"simulated_device": SimulatedDeviceArgs(fixed_ms=1.0, per_token_ms=0.0)})
    wrapped = on_simulated_device(backend, simulated)
    assert isinstance(wrapped, SimulatedBackend) and wrapped.inner is backend
    assert isinstance(FunctionModelWorker(simulated, 60.0).backend, SimulatedBackend)


def test_models_on_one_shared_device_never_overlap(tmp_path):
    """Two models given one device id: the second forward, begun while the first is modelled to
    run, waits for it (time-slicing); a model with a device of its own does not."""
    clock = FakeClock()
    shared = [SimulatedDevice(fixed_ms=40.0, per_token_ms=0.0, clock=clock,
                              timeline=SharedTimeline("gpu0", directory=str(tmp_path))) for _ in range(2)]
    alone = SimulatedDevice(fixed_ms=40.0, per_token_ms=0.0, clock=clock)
    started = clock.now()
    assert shared[0].timeline.reserve(started, 0.040) == pytest.approx(started + 0.040)  # model A's forward
    shared[1].finish(started, 1)  # model B began at the same time: it ends after A's
    assert clock.now() - started == pytest.approx(0.080)
    later = clock.now()
    alone.finish(later - 0.040, 1)  # a device of its own: never queued behind A or B
    assert clock.now() == pytest.approx(later)
    other = SharedTimeline("gpu1", directory=str(tmp_path))  # another id: another device
    assert other.reserve(started, 0.040) == pytest.approx(started + 0.040)


def test_a_shared_device_id_comes_from_the_config():
    args = {"models": {"target": {"path": "embedded:target", "role": "target"},
                       "partner": {"path": "embedded:partner", "role": "member"}},
            "defaults": {"strategy": "ensemble", "members": ["target", "partner"]}}
    engine = {"simulated_device": {name: {"fixed_ms": 40, "per_token_ms": 0.1, "device": "gpu0"}
                                   for name in ("target", "partner")}}
    models = parse_app_args(args | {"engine": engine}).freeze().models
    assert {model.simulated_device.device for model in models} == {"gpu0"}
    assert simulated_device(models[0]).timeline.path == simulated_device(models[1]).timeline.path
    with pytest.raises(ConfigError, match="device"):
        parse_app_args(args | {"engine": {"simulated_device": {"target": {"fixed_ms": 1, "per_token_ms": 0, "device": ""}}}})


def test_bad_cost_models_are_refused_naming_the_field():
    args = {"models": {"target": {"path": "embedded:target", "role": "target"}}, "defaults": {"strategy": "ar"}}
    with pytest.raises(ConfigError, match="per_token_ms"):
        parse_app_args(args | {"engine": {"simulated_device": {"target": {"fixed_ms": 1, "per_token_ms": -1}}}})
    with pytest.raises(ConfigError, match="engine.simulated_device: unknown models \\['draft'\\]"):
        parse_app_args(args | {"engine": {"simulated_device": {"draft": {"fixed_ms": 1, "per_token_ms": 0}}}})
    frozen = parse_app_args(args | {"engine": {"simulated_device": {"target": {"fixed_ms": 4, "per_token_ms": 0.02}}}})
    assert frozen.freeze().models[0].simulated_device.fixed_ms == 4


def _coordinator(simulated: bool) -> Coordinator:
    config = fake_group_config(overlap=False)
    if simulated:
        costs = {"fixed_ms": 2.0, "per_token_ms": 0.05}
        models = tuple(m.model_copy(update={"simulated_device": SimulatedDeviceArgs(**costs)}) for m in config.models)
        config = config.model_copy(update={"models": models})
    workers = {m.name: LocalActorHandle(FunctionModelWorker(m, config.session_idle_timeout_s)) for m in config.models}
    return Coordinator(workers, config, export_to_ray=False)


SPECULATIONS = [
    {"strategy": "ar"},
    {"strategy": "sd", "method": "token", "gamma": 3},
    {"strategy": "sd", "method": "block", "gamma": 3},
    {"strategy": "sd", "method": "greedy_block", "gamma": 2},
    {"strategy": "multi_draft", "method": "spectr", "gamma": 2, "num_drafts": 2},
    {"strategy": "ensemble", "ensemble": "weighted", "members": ["target", "partner"], "weights": [0.5, 0.5]},
    {"strategy": "se", "method": "block", "ensemble": "weighted", "members": ["target", "partner"],
     "weights": [0.5, 0.5], "gammas": [1, 2]},
]


def _run(coordinator: Coordinator) -> list[list]:
    requests = [GenerationRequest(request_id=f"r{i}", prompt_ids=list(PROMPT), speculation=speculation,
                                  sampling={"max_tokens": 8, "seed": i, "temperature": 1.0})
                for i, speculation in enumerate(SPECULATIONS)]
    return run_in_process(coordinator, requests)


def test_the_simulated_device_changes_no_token_and_reports_its_time():
    plain, simulated = _run(_coordinator(False)), _run(_coordinator(True))
    for speculation, real, modelled in zip(SPECULATIONS, plain, simulated):
        assert modelled[-1].error is None, modelled[-1].error
        tokens = [[t for chunk in chunks for t in chunk.token_ids] for chunks in (real, modelled)]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 8, speculation
        # every forward lasted at least the fixed 2 ms: the time split reports the modelled device
        stats = modelled[-1].stats
        assert stats.target_calls > 0 and stats.time_draft_s + stats.time_target_s >= 0.002 * stats.target_calls
