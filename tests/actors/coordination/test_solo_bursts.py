"""What a solo burst's iterations teach the step cost model (actors/coordination/solo_bursts.py);
the bursts' tokens and replay are tested in tests/actors/worker/test_bursts.py."""

from __future__ import annotations

import pytest

from actors.coordination.output import OutputTracker
from actors.coordination.plan import DecodingPlan
from actors.coordination.request_state import RequestState
from actors.coordination.scheduler import Scheduler
from actors.messages import CallTiming, ItemOutcome
from actors.worker.bursts import BurstRecord
from verifiers.machines.speculative import SpeculativeMachine

DRAFT_CALL_S, VERIFY_CALL_S, WALL_S = 0.003, 0.005, 0.0085


def _scheduler_and_request() -> tuple[Scheduler, RequestState]:
    scheduler = Scheduler({"draft": None, "target": None}, max_running=1, max_waiting=1)
    plan = DecodingPlan(strategy="sd", method="block", target="target", draft="draft", gamma=4, num_drafts=1,
                        ensemble=None, members=(), weights=None, mu=0.0, gammas=())
    machine = SpeculativeMachine("draft", "target", method="block", gamma=4, num_drafts=1, max_new_tokens=32)
    request = RequestState(request_id="r", session_id="r/1", plan=plan, machine=machine,
                           output=OutputTracker(None, max_tokens=32), prompt_ids=[1], opens={}, vocab_limit=6)
    return scheduler, request


def _record(request: RequestState) -> BurstRecord:
    """An iteration of a block of 4: the draft's call then the target's, ``WALL_S`` in the worker."""
    draft, verify = request.machine.needs()
    timings = (CallTiming(forward_s=0.002, forward_calls=4, tokens_fed=4, call_s=DRAFT_CALL_S, first_round_s=0.0012),
               CallTiming(forward_s=0.004, forward_calls=1, tokens_fed=5, call_s=VERIFY_CALL_S, first_round_s=0.005))
    return BurstRecord(needs=(draft, verify), outcomes=tuple(ItemOutcome(value=None, timing=t) for t in timings),
                       wall_s=WALL_S)


@pytest.mark.parametrize("period_s,overhead_s", [
    (None, WALL_S - DRAFT_CALL_S - VERIFY_CALL_S),  # a burst's first record: its time in the worker
    (0.0105, 0.0105 - DRAFT_CALL_S - VERIFY_CALL_S),  # handing the record out took 2 ms more
    (0.001, WALL_S - DRAFT_CALL_S - VERIFY_CALL_S),  # arrived right after the last (the worker ran ahead)
])
def test_a_burst_iteration_costs_its_period_as_records_arrive(period_s, overhead_s):
    """An iteration's step overhead is its period between records, when longer than its time in
    the worker: handing a record out before the next iteration starts is paid per iteration."""
    scheduler, request = _scheduler_and_request()
    scheduler.solo_bursts.observe_iteration_costs(request, _record(request), {}, period_s)
    model = scheduler.policy.cost_model
    assert model.speculative_overhead.estimate(1) == pytest.approx(overhead_s)
    costs = model.costs("draft", "target", batch=1, gamma_max=4)
    assert costs.draft_first_s == pytest.approx(0.0012)
    assert costs.draft_s == pytest.approx((DRAFT_CALL_S - 0.0012) / 3)


@pytest.mark.parametrize("age_s,budget_s", [
    (0.0, 1.0),  # a new request: the whole burst budget
    (9.5, 0.5),  # half a second left before its timeout: the burst ends by then
    (12.0, 0.0),  # past its timeout: one iteration, then the next step ends it as timed out
])
def test_a_burst_never_runs_a_request_past_its_timeout(age_s, budget_s):
    """A burst's budget is ``burst_s`` cut to what is left of ``limits.request_timeout_s``: a request
    that starts a burst late in its life (after sharing steps with others) still times out on time."""
    scheduler = Scheduler({"draft": None, "target": None}, max_running=1, max_waiting=1, burst_s=1.0,
                          request_timeout_s=10.0)
    _, request = _scheduler_and_request()
    request.submitted -= age_s
    assert scheduler.solo_bursts.budget_s(request) == pytest.approx(budget_s, abs=0.01)
