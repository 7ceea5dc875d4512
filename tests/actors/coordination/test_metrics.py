"""Metrics recording (actors/coordination/metrics.py) and what the scheduler, the coordinator and the workers
record: a coordinator runs in this process over the deterministic fake workers (no Ray), so
the counters can be compared exactly with what the requests returned."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from actors.request_schema import GenerationRequest, InvalidRequestError
from actors.coordination.admission import OverloadedError
from actors.coordination.coordinator import Coordinator
from actors.coordination.metrics import (
    E2E_LATENCY,
    INTER_TOKEN_LATENCY,
    METRICS,
    REQUESTS,
    STEP_BATCH_SIZE,
    GroupIdentity,
    MetricsRecorder,
    RayMetricsExporter,
    RequestClock,
    SchedulerMetrics,
    group_snapshot,
)
from cluster.config.engine import EngineArgs
from actors.coordination.scheduler import Scheduler
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FunctionModelWorker, fake_group_config

PROMPT = [1, 2, 3]
MAX_TOKENS = 14
SPECULATIONS = {
    "ar": {"strategy": "ar"},
    "sd": {"strategy": "sd", "method": "block", "gamma": 3},
    "multi_draft": {"strategy": "multi_draft", "method": "spectr", "num_drafts": 3, "gamma": 2},
    "se": {"strategy": "se", "method": "token", "members": ["target", "partner"], "gammas": [2, 3]},
    "ensemble": {"strategy": "ensemble", "members": ["target", "partner"]},
}


# ------------------------------------------------------------------ recorder units
def test_histogram_buckets_follow_prometheus_le():
    recorder = MetricsRecorder()
    bounds = STEP_BATCH_SIZE.buckets
    for value in (1, bounds[1], bounds[1] + 0.5, 10_000):
        recorder.observe(STEP_BATCH_SIZE, (), value)
    ((key, buckets, total, count),) = recorder.snapshot()["histograms"][STEP_BATCH_SIZE.name]
    assert buckets[0] == 1 and buckets[1] == 1 and buckets[2] == 1  # value == bound: in that bound's bucket
    assert buckets[-1] == 1 and count == 4 and total == pytest.approx(1 + 2 * bounds[1] + 0.5 + 10_000)


def test_inter_token_latency_spreads_a_chunk_over_its_tokens():
    metrics = SchedulerMetrics()
    clock, labels = RequestClock(), ("sd", "block")
    metrics.tokens(labels, clock, 3, now=1.0, submitted=0.5)  # first chunk: TTFT 0.5 s
    metrics.tokens(labels, clock, 4, now=1.2, submitted=0.5)  # 4 tokens 0.2 s later: 4 x 0.05 s
    histograms = metrics.recorder.snapshot()["histograms"]
    ((_, _, itl_sum, itl_count),) = histograms[INTER_TOKEN_LATENCY.name]
    assert itl_count == 4 and itl_sum == pytest.approx(0.2)
    ((_, _, ttft_sum, ttft_count),) = histograms["specserve_time_to_first_token_seconds"]
    assert ttft_count == 1 and ttft_sum == pytest.approx(0.5)
    counters = dict(metrics.recorder.snapshot()["counters"]["specserve_generation_tokens"])
    assert counters[labels] == 7


def test_a_request_ends_once():
    metrics = SchedulerMetrics()
    clock = RequestClock()
    metrics.ended(("sd", "block"), clock, "cancelled", now=2.0, submitted=1.0)
    metrics.ended(("sd", "block"), clock, "timed_out", now=3.0, submitted=1.0)
    assert dict(metrics.recorder.snapshot()["counters"][REQUESTS.name]) == {("sd", "block", "cancelled"): 1}
    ((_, _, total, count),) = metrics.recorder.snapshot()["histograms"][E2E_LATENCY.name]
    assert (total, count) == (1.0, 1)


def test_verifications_count_drafts_tokens_and_positions():
    metrics = SchedulerMetrics()
    metrics.verified(("multi_draft", "spectr"), drafts=3, draft_tokens=12, accepted=2)
    metrics.verified(("multi_draft", "spectr"), drafts=3, draft_tokens=12, accepted=4)
    counters = {name: dict(samples) for name, samples in metrics.recorder.snapshot()["counters"].items()}
    labels = ("multi_draft", "spectr")
    assert counters["specserve_spec_decode_num_drafts"][labels] == 6
    assert counters["specserve_spec_decode_num_draft_tokens"][labels] == 24
    assert counters["specserve_spec_decode_num_accepted_tokens"][labels] == 6
    assert counters["specserve_spec_decode_num_verifications"][labels] == 2
    per_pos = counters["specserve_spec_decode_num_accepted_tokens_per_pos"]
    assert [per_pos[(*labels, str(i))] for i in range(4)] == [2, 2, 1, 1]


def test_a_full_waiting_line_counts_a_rejection():
    scheduler = Scheduler({}, max_running=0, max_waiting=0)
    with pytest.raises(OverloadedError):
        scheduler.submit(SimpleNamespace(labels=("sd", "block")))
    assert dict(scheduler.metrics.recorder.snapshot()["counters"][REQUESTS.name]) == {("sd", "block", "rejected"): 1}


# ------------------------------------------------------------------ Ray export
class _FakeMetric:
    def __init__(self, name, description="", tag_keys=(), boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tag_keys, boundaries
        self.calls: list[tuple[str, float, dict]] = []

    def inc(self, value, tags=None):
        self.calls.append(("inc", value, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def observe(self, value, tags=None):
        self.calls.append(("observe", value, tags))


class _FakeMetricsModule:
    """Stands in for ``ray.util.metrics``: records every metric object made and every call."""

    def __init__(self):
        self.created: dict[str, _FakeMetric] = {}

    def _make(self, name, **kwargs):
        metric = self.created[name] = _FakeMetric(name, **kwargs)
        return metric

    def Counter(self, name, **kwargs):  # noqa: N802 - named as in ray.util.metrics
        return self._make(name, **kwargs)

    def Gauge(self, name, **kwargs):  # noqa: N802
        return self._make(name, **kwargs)

    def Histogram(self, name, **kwargs):  # noqa: N802
        return self._make(name, **kwargs)


def test_ray_export_sends_deltas_observations_and_gauges():
    module = _FakeMetricsModule()
    identity = GroupIdentity("app", "r1")
    exporter = RayMetricsExporter(identity, metrics_module=module)
    metrics = SchedulerMetrics(MetricsRecorder(keep_pending=True))
    metrics.refused(("sd", "block"), "rejected")
    metrics.step(5)
    worker = {"draft": {"forward_seconds_total": 1.5, "step_seconds_total": 2.0, "steps": 3,
                        "forward_passes_total": 4, "sessions": 1}}
    exporter.export(group_snapshot(identity, metrics.recorder, 2, 1, worker, 0), metrics.recorder.take_pending())
    metrics.refused(("sd", "block"), "rejected")
    worker["draft"] = {**worker["draft"], "forward_seconds_total": 0.25}  # the worker restarted
    exporter.export(group_snapshot(identity, metrics.recorder, 2, 1, worker, 0), metrics.recorder.take_pending())

    requests = module.created[REQUESTS.name]
    assert requests.tag_keys == ("model_group", "replica", "strategy", "method", "status")
    tags = {"model_group": "app", "replica": "r1", "strategy": "sd", "method": "block", "status": "rejected"}
    assert requests.calls == [("inc", 1.0, tags), ("inc", 1.0, tags)]
    forward = module.created["specserve_worker_forward_seconds"].calls
    assert [value for _, value, _ in forward] == [1.5, 0.25]
    assert module.created[STEP_BATCH_SIZE.name].calls == [("observe", 5, {"model_group": "app", "replica": "r1"})]
    assert module.created[STEP_BATCH_SIZE.name].boundaries == list(STEP_BATCH_SIZE.buckets)
    running = module.created["specserve_num_requests_running"].calls
    assert running[-1] == ("set", 2.0, {"model_group": "app", "replica": "r1"})


# ------------------------------------------------------------------ through a coordinator
@pytest.fixture
def local_coordinator():
    config = fake_group_config().model_copy(update={"max_concurrent_requests": 8})
    workers = {m.name: FunctionModelWorker(m, 60.0, max_sessions=24) for m in config.models}
    coordinator = Coordinator({name: LocalActorHandle(w) for name, w in workers.items()}, config,
                              identity=GroupIdentity("fake", "replica-a"), export_to_ray=False)
    loop = asyncio.new_event_loop()
    yield SimpleNamespace(coordinator=coordinator, workers=workers, loop=loop)
    loop.run_until_complete(coordinator.scheduler.close())
    loop.close()


def _request(name: str, seed: int) -> GenerationRequest:
    return GenerationRequest(request_id=f"{name}-{seed}", prompt_ids=PROMPT, speculation=SPECULATIONS[name],
                             sampling={"max_tokens": MAX_TOKENS, "seed": seed, "ignore_eos": True})


async def _chunks(coordinator, request):
    return [chunk async for chunk in coordinator.generate(request)]


def _families(snapshot) -> dict[str, dict]:
    flat = {name: dict(samples) for name, samples in snapshot["counters"].items()}
    flat.update({name: dict(samples) for name, samples in snapshot["gauges"].items()})
    flat.update({name: {key: (buckets, total, count) for key, buckets, total, count in samples}
                 for name, samples in snapshot["histograms"].items()})
    return flat


def test_counters_match_what_the_requests_returned(local_coordinator):
    coordinator, loop = local_coordinator.coordinator, local_coordinator.loop
    requests = [_request(name, seed) for name in SPECULATIONS for seed in (1, 2)]

    async def run():
        return await asyncio.gather(*(_chunks(coordinator, request) for request in requests))

    results = loop.run_until_complete(run())
    snapshot = loop.run_until_complete(coordinator.metrics_snapshot())
    assert snapshot["identity"] == {"model_group": "fake", "replica": "replica-a"}
    families = _families(snapshot)
    for name in SPECULATIONS:
        chunks = [chunks for request, chunks in zip(requests, results) if request.request_id.startswith(name + "-")]
        stats = [c[-1].stats for c in chunks]
        labels = (stats[0].strategy, stats[0].method or "none")
        assert families["specserve_requests"][(*labels, "length")] == 2
        assert families["specserve_generation_tokens"][labels] == sum(s.completion_tokens for s in stats) == 2 * MAX_TOKENS
        assert families["specserve_prompt_tokens"][labels] == sum(s.prompt_tokens for s in stats)
        assert families["specserve_time_to_first_token_seconds"][labels][2] == 2
        assert families["specserve_e2e_request_latency_seconds"][labels][2] == 2
        # Every token after each request's first scheduler chunk is one ITL observation (ar: its first
        # iteration's draws, 1 alone, engine.first_step_tokens in a step of several requests).
        itl_count = families["specserve_inter_token_latency_seconds"].get(labels, (None, 0, 0))[2]
        firsts = [len(next(chunk for chunk in request_chunks if chunk.token_ids).token_ids) for request_chunks in chunks]
        assert itl_count == sum(MAX_TOKENS - first for first in firsts) if name == "ar" else 0 < itl_count <= 2 * (MAX_TOKENS - 1)
        if name == "ar":
            first_step = EngineArgs.model_fields["first_step_tokens"].default
            assert set(firsts) <= {1, first_step}  # alone: the first token on its own
        accepted_lengths = [a for s in stats for a in s.accepted_lengths]
        if name in ("ar", "ensemble"):
            assert labels not in families.get("specserve_spec_decode_num_drafts", {})
            continue
        verifications = families["specserve_spec_decode_num_verifications"][labels]
        accepted = families["specserve_spec_decode_num_accepted_tokens"].get(labels, 0)
        draft_tokens = families["specserve_spec_decode_num_draft_tokens"][labels]
        assert verifications == len(accepted_lengths) and accepted == sum(accepted_lengths)
        assert accepted <= draft_tokens
        per_pos = families["specserve_spec_decode_num_accepted_tokens_per_pos"]
        counts = [per_pos.get((*labels, str(i)), 0) for i in range(max(accepted_lengths) + 1)]
        assert counts == sorted(counts, reverse=True) and sum(counts) == accepted
        if name == "multi_draft":
            assert families["specserve_spec_decode_num_drafts"][labels] == 3 * verifications
            assert draft_tokens == 3 * 2 * verifications
        if name == "sd":
            assert draft_tokens == 3 * verifications
    assert families["specserve_num_requests_running"][()] == 0 and families["specserve_num_requests_waiting"][()] == 0
    assert families["specserve_scheduler_steps"][()] == families[STEP_BATCH_SIZE.name][()][2]
    assert set(families["specserve_worker_forward_seconds"]) == {(name,) for name in local_coordinator.workers}


def test_invalid_requests_are_counted(local_coordinator):
    coordinator, loop = local_coordinator.coordinator, local_coordinator.loop
    bad = GenerationRequest(request_id="bad", prompt_ids=[10**6], speculation=SPECULATIONS["sd"])
    with pytest.raises(InvalidRequestError):
        loop.run_until_complete(_chunks(coordinator, bad))
    coordinator.count_invalid()  # what the ingress reports for its own 400s
    requests = _families(loop.run_until_complete(coordinator.metrics_snapshot()))["specserve_requests"]
    assert requests[("sd", "block", "invalid")] == 1
    assert requests[("none", "none", "invalid")] == 1


def test_prompt_scoring_requests_are_counted(local_coordinator):
    """``max_tokens: 0`` (the prompt scored, nothing decoded) never reaches the scheduler and is
    counted as it counts a request: admitted with its prompt tokens, ended ``length``."""
    coordinator, loop = local_coordinator.coordinator, local_coordinator.loop
    request = GenerationRequest(request_id="score", prompt_ids=PROMPT, speculation=SPECULATIONS["sd"],
                                sampling={"max_tokens": 0, "prompt_logprobs": 1})
    (chunk,) = loop.run_until_complete(_chunks(coordinator, request))
    assert chunk.finished and chunk.prompt_logprobs and chunk.stats.prompt_tokens == len(PROMPT)
    families = _families(loop.run_until_complete(coordinator.metrics_snapshot()))
    labels = ("sd", "block")
    assert families["specserve_requests"] == {(*labels, "length"): 1}
    assert families["specserve_prompt_tokens"] == {labels: len(PROMPT)}
    assert families["specserve_request_queue_time_seconds"][labels][2] == 1
    assert families["specserve_e2e_request_latency_seconds"][labels][2] == 1
    assert labels not in families.get("specserve_generation_tokens", {})
    assert coordinator.scheduler.steps == 0


def test_a_cancelled_request_is_counted_once():
    scheduler = Scheduler({}, max_running=1, max_waiting=1)
    request = SimpleNamespace(labels=("ar", "none"), clock=RequestClock(), finished=False, cancelled=False,
                              submitted=0.0, started=0.0, session_id="s")
    scheduler.cancel(request)
    scheduler.cancel(request)
    assert request.cancelled
    assert dict(scheduler.metrics.recorder.snapshot()["counters"][REQUESTS.name]) == {("ar", "none", "cancelled"): 1}
    assert E2E_LATENCY.name not in scheduler.metrics.recorder.snapshot()["histograms"]  # never admitted


def test_worker_seconds_are_cumulative_and_exact(local_coordinator):
    coordinator, loop, workers = local_coordinator.coordinator, local_coordinator.loop, local_coordinator.workers
    engine = workers["target"].engine
    step_forward_s: list[float] = []
    original = engine.run_step

    def recording_step(items, releases=(), source_payloads=()):
        outcomes, payloads = original(items, releases, source_payloads)
        step_forward_s.append(max((o.timing.forward_s for o in outcomes), default=0.0))
        return outcomes, payloads

    engine.run_step = recording_step
    first = engine.metrics()
    loop.run_until_complete(_chunks(coordinator, _request("sd", 3)))
    middle = engine.metrics()
    loop.run_until_complete(_chunks(coordinator, _request("ar", 4)))
    last = engine.metrics()
    assert first["forward_seconds_total"] == 0.0 and first["steps"] == 0
    assert 0 < middle["forward_seconds_total"] < last["forward_seconds_total"]
    assert last["forward_seconds_total"] == pytest.approx(sum(step_forward_s), rel=1e-9)
    assert last["forward_seconds_total"] <= last["step_seconds_total"]
    assert last["steps"] == len(step_forward_s) and last["forward_passes_total"] >= last["steps"] - 2


def test_every_snapshot_family_is_declared(local_coordinator):
    snapshot = local_coordinator.loop.run_until_complete(local_coordinator.coordinator.metrics_snapshot())
    names = set(snapshot["counters"]) | set(snapshot["gauges"]) | set(snapshot["histograms"])
    assert names <= set(METRICS)
    for name, samples in snapshot["counters"].items():
        assert all(len(key) == len(METRICS[name].labels) for key, _ in samples)
