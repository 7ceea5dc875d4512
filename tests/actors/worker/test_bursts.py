"""Solo bursts (actors/worker/bursts.py): a lone request's iterations run in its target's worker, and
change no token.

Through real Ray actors on the deterministic fake workers (tests/actors/fake_models.py): one
request at a time, so every iteration runs in a burst (the first opens the sessions), equals the
reference loop token for token for every burstable strategy and rule; gamma "auto" with measured (frozen) step costs keeps
the target's law (chi-square); a request cancelled mid-burst leaves no session behind; a request
that arrives during a long burst stops it (the stop signal) and starts before the burst would
have ended, with a draft on its own worker or hosted with the target. In process: the burst loop
stops where it must (done, EOS, a failed iteration, its time budget, the stop signal), a peer
that cannot be reached fails its needs as retryable, the scheduler refuses a replay whose needs
differ from the worker's, and a request arriving mid-burst is admitted after one iteration
through the real scheduler (and, as a control, waits for the whole burst without the signal).
"""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.worker.bursts import (
    BurstRecord,
    BurstStops,
    FrozenStepCosts,
    burstable,
    finish_needs,
    run_burst,
    submit_peer_calls,
)
from actors.messages import CallTiming, ItemOutcome
from actors.coordination.plan import DecodingDefaults
from cluster.serving.bringup import start_model_group
from tests.actors.fake_models import (CO_LOCATED, FAKE_MODELS, FunctionModelWorker, SlowFunctionModelWorker,
                                     fake_group_config)
from tests.verifiers.tiny_models import chi_square_pvalue, target_law
from verifiers.adaptive import AdaptiveGammaSettings, StepCosts
from verifiers.machines.autoregressive import AutoregressiveMachine
from verifiers.machines.needs import Sample, Sampled, ScoreVerify, Verified
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.reference import autoregressive_generate, speculative_generate

PROMPT = (1, 2, 3)
MAX_TOKENS = 14
CHI_SQUARE_SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def burst_group(ray_session):
    group = start_model_group(fake_group_config(overlap=False, burst_ms=5_000), worker_cls=FunctionModelWorker)
    yield group
    group.shutdown()


def _request(seed: int, speculation: dict, max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(request_id=f"burst-{seed}", prompt_ids=list(PROMPT),
                             sampling={"max_tokens": max_tokens, "seed": seed, "temperature": 1.0},
                             speculation=speculation)


async def _collect(coordinator, request: GenerationRequest) -> list:
    return [await ref async for ref in coordinator.generate.options(num_returns="streaming").remote(request)]


def _run_one_at_a_time(group, requests: list[GenerationRequest]) -> list[list]:
    async def run() -> list[list]:
        return [await _collect(group.coordinator, request) for request in requests]

    return asyncio.run(run())


def _tokens(chunks) -> list[int]:
    assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    return [t for chunk in chunks for t in chunk.token_ids]


def _bursts(group) -> int:
    import ray

    return ray.get(group.coordinator.engine_stats.remote())["bursts"]


def test_ar_in_bursts_equals_the_reference(burst_group):
    before = _bursts(burst_group)
    seeds = (0, 1, 2)
    results = _run_one_at_a_time(burst_group, [_request(seed, {"strategy": "ar"}) for seed in seeds])
    assert _bursts(burst_group) >= before + len(seeds)  # every request's iterations after its first
    for seed, chunks in zip(seeds, results):
        expected, _ = autoregressive_generate(FAKE_MODELS["target"], PROMPT, MAX_TOKENS,
                                              generator=torch.Generator().manual_seed(seed))
        assert _tokens(chunks) == expected
        assert chunks[-1].stats.target_calls == MAX_TOKENS


def test_pre_drafting_in_bursts_equals_the_reference(ray_session):
    """The PreDraft runs on the draft's worker while the target verifies, and the next iteration
    verifies its chain, inside a burst: the reference loop's tokens, with chains really reused."""
    group = start_model_group(fake_group_config(overlap=False, pre_drafting=2, burst_ms=5_000),
                              worker_cls=FunctionModelWorker)
    try:
        seeds = (0, 1, 2, 3)
        speculation = {"strategy": "sd", "method": "block", "gamma": 2}
        results = _run_one_at_a_time(group, [_request(seed, speculation, max_tokens=20) for seed in seeds])
        assert _bursts(group) >= len(seeds)
        import ray

        # Sample and PreDraft must run on the draft in the order sent: Ray calls, not the peer link.
        assert ray.get(group.workers["draft"].engine_stats.remote())["peer_link_calls"] == 0
    finally:
        group.shutdown()
    reused = 0
    for seed, chunks in zip(seeds, results):
        expected, stats = speculative_generate(FAKE_MODELS["draft"], FAKE_MODELS["target"], PROMPT, 20, gamma=2,
                                               method="block", generator=torch.Generator().manual_seed(seed),
                                               pre_drafting=2)
        assert _tokens(chunks) == expected
        assert chunks[-1].stats.pre_drafted == stats["pre_drafted"]
        reused += stats["pre_drafted"]
    assert reused > 0


@pytest.mark.parametrize("strategy,method,num_drafts,gamma", [
    ("sd", "token", 1, 3),
    ("sd", "block", 1, 3),
    ("sd", "greedy_block", 1, 3),
    ("sd", "block", 1, "auto"),
    ("multi_draft", "spectr", 2, 3),
    ("multi_draft", "sequential_gbv", 2, 2),
])
def test_speculation_in_bursts_equals_the_reference(burst_group, strategy, method, num_drafts, gamma):
    speculation = {"strategy": strategy, "method": method, "num_drafts": num_drafts, "gamma": gamma}
    adaptive = None
    if gamma == "auto":
        speculation["gamma_max"] = 5
        adaptive = AdaptiveGammaSettings(gamma_max=5, draft_cost_ratio=DecodingDefaults().draft_cost_ratio)
    before = _bursts(burst_group)
    seeds = (0, 1, 2)
    results = _run_one_at_a_time(burst_group, [_request(seed, speculation) for seed in seeds])
    assert _bursts(burst_group) >= before + len(seeds)
    for seed, chunks in zip(seeds, results):
        expected, stats = speculative_generate(
            FAKE_MODELS["draft"], FAKE_MODELS["target"], PROMPT, MAX_TOKENS, gamma=3 if gamma == "auto" else gamma,
            method=method, num_drafts=num_drafts, generator=torch.Generator().manual_seed(seed), adaptive=adaptive)
        assert _tokens(chunks) == expected
        assert chunks[-1].stats.accepted_lengths == stats["accepted"]
        assert chunks[-1].stats.target_calls == stats["target_calls"]


def test_bursts_call_the_draft_over_the_peer_link_and_keep_its_tokens(burst_group):
    """Workers of one node: a burst's draft calls go over the direct link (actors/worker/peer_link.py),
    not Ray calls, and the tokens stay the reference's."""
    import ray

    draft = burst_group.workers["draft"]
    before = ray.get(draft.engine_stats.remote())["peer_link_calls"]
    speculation = {"strategy": "sd", "method": "block", "num_drafts": 1, "gamma": 3}
    (chunks,) = _run_one_at_a_time(burst_group, [_request(5, speculation)])
    expected, stats = speculative_generate(FAKE_MODELS["draft"], FAKE_MODELS["target"], PROMPT, MAX_TOKENS, gamma=3,
                                           method="block", num_drafts=1, generator=torch.Generator().manual_seed(5))
    assert _tokens(chunks) == expected
    calls = ray.get(draft.engine_stats.remote())["peer_link_calls"] - before
    # one draft call per iteration over the link, the first included: the request starts in a
    # burst, which opens its sessions (no scheduler step before it)
    assert calls == stats["target_calls"]


def test_goodput_auto_in_bursts_keeps_the_target_law(ray_session):
    """gamma auto weighing measured step costs (frozen per burst; plain steps allowed): 300
    sequences of 3 tokens, one request at a time, fit the target's law."""
    group = start_model_group(fake_group_config(overlap=False, goodput_gamma=True, burst_ms=5_000),
                              worker_cls=FunctionModelWorker)
    try:
        length, count = 3, 300
        requests = [_request(seed, {"strategy": "sd", "method": "block", "gamma": "auto"}, max_tokens=length)
                    for seed in range(count)]
        sequences = [tuple(_tokens(chunks)) for chunks in _run_one_at_a_time(group, requests)]
        assert _bursts(group) > 0
    finally:
        group.shutdown()
    assert chi_square_pvalue(sequences, target_law(FAKE_MODELS["target"], PROMPT, length)) > CHI_SQUARE_SIGNIFICANCE


def test_a_request_cancelled_mid_burst_leaves_no_session(burst_group):
    import ray

    async def read_one_chunk_then_leave() -> None:
        stream = burst_group.coordinator.generate.options(num_returns="streaming").remote(
            _request(5, {"strategy": "sd", "method": "block", "gamma": 3}, max_tokens=50))
        async for ref in stream:
            await ref
            break
        ray.cancel(stream)  # what the ingress does when its client goes away

    asyncio.run(read_one_chunk_then_leave())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sessions = ray.get([worker.num_sessions.remote() for worker in burst_group.workers.values()])
        if not any(sessions) and not ray.get(burst_group.coordinator.describe.remote())["active_requests"]:
            break
        time.sleep(0.2)
    assert not any(sessions), sessions
    # The group still serves.
    assert _tokens(_run_one_at_a_time(burst_group, [_request(6, {"strategy": "ar"})])[0])


SLOW_FORWARD_S = 0.02
#: A request long enough that its burst (budget below) would run for a second or more, alone.
LONG = {"strategy": "sd", "method": "block", "gamma": 3}
LONG_TOKENS = 60
LONG_BURST_MS = 10_000


class SlowTargetWorker(SlowFunctionModelWorker):
    """The fake models, each forward of the target lasting ``SLOW_FORWARD_S`` more: a long burst
    takes long, so a request that waited for it would wait visibly."""

    forward_delay_s = SLOW_FORWARD_S
    slow_models = frozenset({"target"})


def _arrival_mid_burst(generate, close=None) -> list[tuple[str, object]]:
    """Request "a" (long) alone, then "b" as soon as "a"'s first chunk is out; every chunk as it
    reached its reader, in order. ``generate(request)``: an async iterator of the request's chunks;
    ``close``: a coroutine function awaited at the end, in the same event loop."""

    async def run() -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []

        async def collect(name: str, request: GenerationRequest) -> None:
            async for chunk in generate(request):
                events.append((name, chunk))

        first = asyncio.create_task(collect("a", _request(11, LONG, max_tokens=LONG_TOKENS)))
        while not events:
            await asyncio.sleep(0.001)
        second = asyncio.create_task(collect("b", _request(12, {"strategy": "ar"}, max_tokens=8)))
        try:
            await asyncio.wait_for(asyncio.gather(first, second), timeout=120)
        finally:
            if close is not None:
                await close()
        return events

    return asyncio.run(run())


def _check_arrival_tokens(events) -> tuple[int, int]:
    """Both requests' tokens equal the reference loop's; returns (index of b's first chunk, index
    of a's last)."""
    a_chunks = [chunk for name, chunk in events if name == "a"]
    b_chunks = [chunk for name, chunk in events if name == "b"]
    expected_a, _ = speculative_generate(FAKE_MODELS["draft"], FAKE_MODELS["target"], PROMPT, LONG_TOKENS, gamma=3,
                                         method="block", generator=torch.Generator().manual_seed(11))
    expected_b, _ = autoregressive_generate(FAKE_MODELS["target"], PROMPT, 8, generator=torch.Generator().manual_seed(12))
    assert _tokens(a_chunks) == expected_a
    assert _tokens(b_chunks) == expected_b
    names = [name for name, _ in events]
    return names.index("b"), len(names) - 1 - names[::-1].index("a")


@pytest.mark.parametrize("placement", ["separate", CO_LOCATED], ids=["separate", "co_located"])
def test_a_request_arriving_mid_burst_stops_it_and_starts_before_it_would_end(ray_session, placement):
    """A budget of ten seconds: the lone request's burst would run to its end; the request arriving
    meanwhile stops it after an iteration, both continue in batched steps, tokens unchanged."""
    import ray

    group = start_model_group(fake_group_config(overlap=False, burst_ms=LONG_BURST_MS, placement=placement),
                              worker_cls=SlowTargetWorker)
    try:
        async def generate(request):
            async for ref in group.coordinator.generate.options(num_returns="streaming").remote(request):
                yield await ref

        events = _arrival_mid_burst(generate)
        stats = ray.get(group.coordinator.engine_stats.remote())
    finally:
        group.shutdown()
    b_first, a_last = _check_arrival_tokens(events)
    assert b_first < a_last, [name for name, _ in events]
    assert stats["bursts"] >= 1 and 2 in stats["batch_sizes"], stats


# ------------------------------------------------------------------------------ in process
def _ar_step(tokens_per_call: list[list[int]]):
    """A local step that answers each Sample with the next list of tokens."""
    calls = iter(tokens_per_call)

    def local_step(items, sources):
        (item,) = items
        assert isinstance(item.need, Sample)
        tokens = next(calls)
        assert len(tokens) == item.need.count
        return [ItemOutcome(value=Sampled(torch.tensor([tokens])), timing=CallTiming(forward_calls=len(tokens)))], [None]

    return local_step


def _no_peer(model, items):
    raise AssertionError("ar makes no call to another worker")


def _fetch(refs):
    return list(refs)


def test_a_burst_stops_when_the_machine_is_done():
    machine = AutoregressiveMachine("target", max_new_tokens=10, tokens_per_iteration=4)
    records = list(run_burst(machine, "s", "target", _ar_step([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]]), _no_peer, _fetch,
                             budget_s=60))
    assert [len(record.outcomes[0].value.tokens[0]) for record in records] == [4, 4, 2]
    assert machine.done


def test_a_burst_stops_after_an_eos_token():
    machine = AutoregressiveMachine("target", max_new_tokens=40, tokens_per_iteration=4)
    records = list(run_burst(machine, "s", "target", _ar_step([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4]]), _no_peer,
                             _fetch, eos_token_ids=(9,), budget_s=60))
    assert len(records) == 2


def test_a_burst_stops_at_its_time_budget():
    machine = AutoregressiveMachine("target", max_new_tokens=400, tokens_per_iteration=4)
    inner = _ar_step([[1, 2, 3, 4]] * 100)

    def slow_step(items, sources):
        time.sleep(0.02)
        return inner(items, sources)

    records = list(run_burst(machine, "s", "target", slow_step, _no_peer, _fetch, budget_s=0.05))
    assert 2 <= len(records) <= 4


def test_a_burst_told_to_stop_ends_after_its_current_iteration():
    machine = AutoregressiveMachine("target", max_new_tokens=400, tokens_per_iteration=4)
    inner = _ar_step([[1, 2, 3, 4]] * 100)
    stops = BurstStops()
    calls = []

    def step(items, sources):
        calls.append(items)
        if len(calls) == 3:
            stops.stop("r/1")  # arrives while the third iteration runs
        return inner(items, sources)

    records = list(run_burst(machine, "s", "target", step, _no_peer, _fetch, budget_s=60,
                             stop=lambda: stops.stopped("r/1")))
    assert len(records) == 3 and len(calls) == 3
    assert not machine.done


def test_burst_stops_hold_a_stop_that_comes_first_and_forget_ended_bursts():
    stops = BurstStops(keep=2)
    stops.stop("early")  # before its burst started: the burst still sees it
    assert stops.stopped("early") and not stops.stopped("other") and not stops.stopped(None)
    stops.ended("early")
    assert not stops.stopped("early")
    for burst_id in ("x", "y", "z"):  # stops of bursts that had ended: only the last ``keep`` stay
        stops.stop(burst_id)
    assert [stops.stopped(b) for b in ("x", "y", "z")] == [False, True, True]


@pytest.mark.parametrize("signal", [True, False], ids=["stop_signal", "control_without_it"])
def test_a_request_arriving_mid_burst_is_admitted_after_an_iteration_in_process(monkeypatch, signal):
    """Through the real scheduler and workers in this process, a ten-second budget: with the stop
    signal the arriving request starts while the long one still runs (then both in steps, tokens
    unchanged); without it (the control) it waits for the whole burst."""
    from actors.coordination import solo_bursts
    from actors.coordination.coordinator import Coordinator
    from benchmarks.served.runners import LocalActorHandle

    if not signal:
        monkeypatch.setattr(solo_bursts.RunningBurst, "stop", lambda self: None)
    config = fake_group_config(overlap=False, burst_ms=LONG_BURST_MS)
    coordinator = Coordinator({m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}, config,
                              export_to_ray=False)

    events = _arrival_mid_burst(coordinator.generate, close=coordinator.scheduler.close)
    b_first, a_last = _check_arrival_tokens(events)
    assert coordinator.scheduler.bursts >= 1
    if signal:
        assert b_first < a_last and 2 in coordinator.scheduler.batch_sizes
    else:
        assert b_first > a_last and 2 not in coordinator.scheduler.batch_sizes


def test_a_burst_stops_after_a_failed_iteration():
    machine = AutoregressiveMachine("target", max_new_tokens=40, tokens_per_iteration=4)

    def failing_step(items, sources):
        return [ItemOutcome(error="RuntimeError: boom")], [None]

    records = list(run_burst(machine, "s", "target", failing_step, _no_peer, _fetch, budget_s=60))
    assert len(records) == 1 and records[0].outcomes[0].error == "RuntimeError: boom"


def test_an_unreachable_draft_fails_its_iteration_as_retryable():
    machine = SpeculativeMachine("draft", "target", method="block", gamma=3, num_drafts=1, max_new_tokens=20)
    needs = machine.needs()

    def dead_peer(model, items):
        return "outcomes ref", "payloads ref"

    def fetch(refs):
        raise RuntimeError("the actor died")

    def local_step(items, sources):
        (item,) = items
        assert isinstance(item.need, ScoreVerify) and item.proposal_source == (0, 0)
        assert isinstance(sources[0][0], ItemOutcome) and sources[0][0].error is not None
        return [ItemOutcome(error="RuntimeError: the proposal failed")], [None]

    calls = submit_peer_calls(needs, "s", "target", dead_peer)
    outcomes, pre_drafted = finish_needs(needs, calls, "s", "target", local_step, fetch)
    assert pre_drafted is None
    assert outcomes[0].retryable and "draft" in outcomes[0].error
    assert outcomes[1].error is not None


def test_the_next_iterations_draft_call_goes_out_before_the_record_and_none_after_the_last():
    """The draft drafts the next block while the current record is streamed: its call is submitted
    before the record reaches the consumer; the last iteration submits nothing further."""
    machine = SpeculativeMachine("draft", "target", method="block", gamma=2, num_drafts=1, max_new_tokens=9)
    events: list[str] = []

    def draft_peer(model, items):
        (item,) = items
        assert model == "draft" and isinstance(item.need, Sample)
        events.append("draft call")
        sampled = Sampled(torch.tensor([[7] * item.need.count]), torch.zeros(1, item.need.count, 11))
        return [ItemOutcome(value=sampled)], [sampled]

    def local_step(items, sources):
        (item,) = items
        assert isinstance(item.need, ScoreVerify)
        return [ItemOutcome(value=Verified(emitted=[7, 7, 5], num_accepted=2))], [None]

    for record in run_burst(machine, "s", "target", local_step, draft_peer, _fetch, budget_s=60):
        events.append(f"record of {len(record.outcomes[1].value.emitted)} tokens")
    assert machine.done
    assert events == ["draft call", "draft call", "record of 3 tokens", "draft call", "record of 3 tokens",
                      "record of 3 tokens"]

    # A draft in this process (ahead=False): its call would run at once, so the record goes out first.
    machine = SpeculativeMachine("draft", "target", method="block", gamma=2, num_drafts=1, max_new_tokens=9)
    events.clear()
    for record in run_burst(machine, "s", "target", local_step, draft_peer, _fetch, budget_s=60, ahead=False):
        events.append(f"record of {len(record.outcomes[1].value.emitted)} tokens")
    assert machine.done
    assert events == ["draft call", "record of 3 tokens"] * 3


def test_a_burst_opens_each_session_with_its_models_first_need_once():
    """A request that starts in a burst: the first iteration's draft and target items carry their
    model's OpenSession (the prompt's prefill), later ones none, and each record names what it opened."""
    from actors.messages import OpenSession, RowSampling

    machine = SpeculativeMachine("draft", "target", method="block", gamma=2, num_drafts=1, max_new_tokens=6)
    opens = {model: OpenSession(PROMPT, RowSampling(vocab_limit=11), {"own": index})
             for index, model in enumerate(("draft", "target"))}
    sent: list[tuple[str, object]] = []

    def draft_peer(model, items):
        (item,) = items
        sent.append((model, item.open))
        sampled = Sampled(torch.tensor([[7] * item.need.count]), torch.zeros(1, item.need.count, 11))
        return [ItemOutcome(value=sampled)], [sampled]

    def local_step(items, sources):
        (item,) = items
        sent.append(("target", item.open))
        return [ItemOutcome(value=Verified(emitted=[7, 7, 5], num_accepted=2))], [None]

    records = list(run_burst(machine, "s", "target", local_step, draft_peer, _fetch, budget_s=60, opens=opens))
    assert [record.opened for record in records] == [("draft", "target"), ()]
    assert sent == [("draft", opens["draft"]), ("target", opens["target"]), ("draft", None), ("target", None)]


def test_ar_sd_and_multi_draft_burst_the_ensembles_do_not():
    from verifiers.machines.ensemble import EnsembleMachine
    from verifiers.randomness import TorchRandomSource

    assert burstable(AutoregressiveMachine("target", max_new_tokens=4))
    assert burstable(SpeculativeMachine("draft", "target", method="block", gamma=3, num_drafts=1, max_new_tokens=4,
                                        pre_drafting=2))
    ensemble = EnsembleMachine(["target", "partner"], ensemble="weighted", weights=None, mu=0.1, temperature=1.0,
                               top_k=0, top_p=1.0, own_source=TorchRandomSource(torch.Generator()), max_new_tokens=4)
    assert not burstable(ensemble)


def test_frozen_step_costs_pickle_with_the_machine():
    machine = SpeculativeMachine("draft", "target", method="block", gamma=3, num_drafts=1, max_new_tokens=4,
                                 adaptive=AdaptiveGammaSettings(gamma_max=8))
    costs = StepCosts(draft_s=0.001, verify_s=(0.01,) * 8, overhead_s=0.002, plain_s=0.008, plain_overhead_s=0.001,
                      plain_tokens=4)
    machine.step_costs = FrozenStepCosts(costs)
    copy = pickle.loads(pickle.dumps(machine))
    assert copy.step_costs() == costs
    assert copy.needs() == machine.needs()


def _ar_plan():
    from actors.coordination.plan import DecodingPlan

    return DecodingPlan(strategy="ar", method=None, target="target", draft=None, gamma=1, num_drafts=1, ensemble=None,
                        members=(), weights=None, mu=0.0, gammas=())


def test_the_scheduler_refuses_a_replay_that_differs():
    from actors.coordination.output import OutputTracker
    from actors.coordination.request_state import RequestState
    from actors.coordination.scheduler import Scheduler

    scheduler = Scheduler({"target": None}, max_running=1, max_waiting=1)
    machine = AutoregressiveMachine("target", max_new_tokens=8, tokens_per_iteration=4)
    request = RequestState(request_id="r", session_id="r/1", plan=_ar_plan(),
                           machine=machine, output=OutputTracker(None, max_tokens=8), prompt_ids=[1], opens={},
                           vocab_limit=6)
    wrong = BurstRecord(needs=(Sample("target", (), 2),), outcomes=(ItemOutcome(value=Sampled(torch.tensor([[1, 2]]))),),
                        wall_s=0.01)
    scheduler.solo_bursts.replay(request, wrong)
    chunk = request.chunks.get_nowait()
    assert chunk.finished and "differs" in chunk.error
