"""Models that share a device share a worker (actors/worker/device_worker.py): seeded tokens of every
strategy are identical with co-located and separate workers, step by step and in solo bursts
(whose hosted draft is called in-process, not over the peer link), one call per host and step,
and one KV budget split across the hosted models (fake workers through Ray: tests/actors/fake_models.py)."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.worker.device_worker import DeviceWorker, HostCall, HostedModel, shared_kv_slots
from actors.model.kv_budget import KVCacheBudgetError
from actors.messages import WorkItem
from cluster.serving.bringup import start_model_group
from cluster.config import ModelSpec
from tests.actors.fake_models import CO_LOCATED, FAKE_MODELS, FunctionModelWorker, fake_group_config
from tests.actors.coordination.test_coordinator_reference import _request, run_requests
from verifiers.reference import speculative_generate

ONE_DEVICE = {"target": 0, "draft": 0, "partner": 0, "partner2": 0}
SPECULATIONS = [
    {"strategy": "ar"},
    {"strategy": "sd", "method": "token", "gamma": 3},
    {"strategy": "sd", "method": "block", "gamma": "auto", "gamma_max": 5},
    {"strategy": "multi_draft", "method": "spectr", "num_drafts": 2, "gamma": 2},
    {"strategy": "ensemble", "members": ["target", "partner"]},
    {"strategy": "ensemble", "ensemble": "contrastive", "members": ["target", "partner"], "mu": 0.1},
    {"strategy": "se"},
    # the partner reads the draft's block from the draft's host: a call of its own for the draft
    {"strategy": "se", "proposer": "draft", "members": ["target", "partner"], "gamma": 3},
]


def _tokens(chunks) -> list[int]:
    assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    return [t for chunk in chunks for t in chunk.token_ids]


def _seeded_tokens(placement) -> list[list[int]]:
    """Every strategy's seeded tokens, several requests in flight at once (batched steps)."""
    group = start_model_group(fake_group_config(placement=placement), worker_cls=FunctionModelWorker)
    try:
        requests = [_request(seed, speculation, max_tokens=16) for seed in range(3) for speculation in SPECULATIONS]
        return [_tokens(chunks) for chunks in run_requests(group, requests)]
    finally:
        group.shutdown()


def test_every_strategy_has_the_same_tokens_co_located_and_separate(ray_session):
    separate = _seeded_tokens("separate")
    assert _seeded_tokens(ONE_DEVICE) == separate
    assert _seeded_tokens(CO_LOCATED) == separate


def test_a_solo_burst_calls_its_co_located_draft_in_process_with_the_reference_tokens(ray_session):
    group = start_model_group(fake_group_config(overlap=False, burst_ms=5_000, placement=CO_LOCATED),
                              worker_cls=FunctionModelWorker)
    try:
        assert isinstance(group.workers["draft"], HostedModel)
        speculation = {"strategy": "sd", "method": "block", "gamma": 3}
        prompt = (1, 2, 3)
        for seed in (0, 1):
            (chunks,) = run_requests(group, [_request(seed, speculation, max_tokens=14)])
            expected, _ = speculative_generate(FAKE_MODELS["draft"], FAKE_MODELS["target"], prompt, 14, gamma=3,
                                               method="block", generator=torch.Generator().manual_seed(seed))
            assert _tokens(chunks) == expected
        assert ray.get(group.coordinator.engine_stats.remote())["bursts"] >= 2
        assert ray.get(group.workers["draft"].engine_stats.remote())["peer_link_calls"] == 0
    finally:
        group.shutdown()


def _spec(name: str, path: str = "") -> ModelSpec:
    return ModelSpec(name=name, path=path or f"fake:{name}", role="target" if name == "target" else "draft",
                     num_gpus=0, num_cpus=0.1, torch_threads=1, resources={})


def test_run_steps_runs_the_calls_in_order_and_returns_only_the_payloads_read_elsewhere():
    """A draft Sample and the target's ScoreVerify reading it in-process, in one call; the draft's
    payloads stay in the process, the verifier's are not asked for either."""
    from actors.messages import OpenSession, RowSampling
    from verifiers.machines.needs import Sample, ScoreVerify

    host = DeviceWorker([_spec("target"), _spec("draft")], worker_cls=FunctionModelWorker)
    opened = OpenSession((1, 2, 3), RowSampling(), {"sample": 1, "verify": 2})
    sample = Sample("draft", (), 3, return_logits=True)
    verify = ScoreVerify("target", (), draft_need=0, method="token")
    calls = [HostCall("draft", (WorkItem("s", sample, open=opened),)),
             HostCall("target", (WorkItem("s", verify, open=opened, proposal_source=(0, 0)),), (("local", 0),))]
    draft_outcomes, draft_payloads, target_outcomes, target_payloads = host.run_steps(calls)
    assert draft_payloads is None and target_payloads is None
    assert draft_outcomes[0].error is None and target_outcomes[0].error is None, (draft_outcomes, target_outcomes)
    assert target_outcomes[0].value.num_accepted >= 0
    assert host.num_sessions(model="draft") == host.num_sessions(model="target") == 1
    host.run_steps([], releases={"draft": ["s"], "target": ["s"]})
    assert host.num_sessions(model="draft") == host.num_sessions(model="target") == 0
    with pytest.raises(ValueError, match="name the model"):
        host.info()


def test_one_kv_budget_is_split_by_what_a_request_holds_on_each_model(tiny_checkpoints):
    threads = torch.get_num_threads()
    try:
        specs = [_spec("target", str(tiny_checkpoints["target"])), _spec("draft", str(tiny_checkpoints["draft"]))]
        probe = DeviceWorker(specs, max_sessions=1, max_model_len=100)
        per_request = sum(worker.backend.slot_bytes for worker in probe.models.values())
        host = DeviceWorker(specs, max_sessions=64, max_model_len=100, kv_cache_memory=3 * per_request + 7)
        for worker in host.models.values():
            cache = worker.backend.cache
            assert worker.backend.max_slots == cache.num_slots == worker.info().kv_slots == 3
            assert worker.info().forward_path == "the lean decoder (llama)"  # the tiny models are Llamas
            assert cache.pool_bytes == 3 * worker.backend.slot_bytes
        with pytest.raises(KVCacheBudgetError, match="one slot in each model"):
            DeviceWorker(specs, max_model_len=100, kv_cache_memory=per_request - 1)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("budget,slot_bytes,slots", [
    (1000, {"target": 300, "draft": 100}, 2),
    (399, {"target": 300, "draft": 100}, None),
    (10**9, {"a": 7}, 10**9 // 7),
])
def test_shared_kv_slots(budget, slot_bytes, slots):
    if slots is None:
        with pytest.raises(KVCacheBudgetError, match="400"):
            shared_kv_slots(budget, slot_bytes, "w")
    else:
        assert shared_kv_slots(budget, slot_bytes, "w") == slots


def test_a_hosted_model_forwards_calls_with_its_name():
    class Recorder:
        def __getattr__(self, name):
            return Method(name)

    class Method:
        def __init__(self, name, options=None):
            self.name, self.opts = name, options or {}

        def options(self, **options):
            return Method(self.name, options)

        def remote(self, *args, **kwargs):
            return self.name, self.opts, args, kwargs

    handle = HostedModel(Recorder(), "draft", "worker0")
    assert handle.run_step.options(num_returns=2).remote([1], releases=[]) == (
        "run_step", {"num_returns": 2}, ([1],), {"releases": [], "model": "draft"})
    with pytest.raises(AttributeError):
        handle._private  # noqa: B018 - pickling probes dunder/private names: they must not forward


def test_run_steps_reads_another_workers_payloads_as_arguments():
    """A source of another worker (``("arg", i)``) is resolved like a ModelWorker's source."""
    from actors.messages import OpenSession, RowSampling
    from verifiers.machines.needs import Sample, ScoreVerify

    drafts = DeviceWorker([_spec("draft")], worker_cls=FunctionModelWorker)
    targets = DeviceWorker([_spec("target")], worker_cls=FunctionModelWorker)
    opened = OpenSession((1, 2, 3), RowSampling(), {"sample": 1, "verify": 2})
    sample = WorkItem("s", Sample("draft", (), 2, return_logits=True), open=opened)
    (draft_out, draft_payloads) = drafts.run_steps([HostCall("draft", (sample,), keep_payloads=True)])
    assert draft_payloads is not None
    verify = WorkItem("s", ScoreVerify("target", (), draft_need=0, method="block"), open=opened, proposal_source=(0, 0))
    (target_out, _) = targets.run_steps([HostCall("target", (verify,), (("arg", 0),))], source_payloads=[draft_payloads])
    assert target_out[0].error is None, target_out
