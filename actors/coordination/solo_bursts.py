"""Solo bursts (``engine.burst_ms``, :mod:`actors.worker.bursts`): with one request running and
none waiting, its target's worker runs the request's iterations for up to ``burst_s`` per call,
streaming each back; the scheduler replays each iteration through the request's own machine as
a step of its own (the machine must ask for exactly the needs the worker's copy ran). A request
admitted alone starts in a burst: the burst opens its sessions (its prompt's prefill runs in the
first iteration), with no scheduler step and no round trip before it.

The stop signal: a request that arrives (or one that is cancelled) while a burst runs tells the
burst's worker to end it after its current iteration (:meth:`SoloBursts.stop`, the worker's
``stop_burst`` in its own concurrency group); so does a burst whose request ended in the
coordinator first (a stop string). A newcomer waits one iteration, not ``burst_s``, and the
budget can be long."""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from actors.coordination.admission import Admission
from actors.coordination.cohorts import Cohort
from actors.coordination.metrics import StepCounters
from actors.coordination.policy import ALONE, StepPolicy, costed_step, set_plain_tokens
from actors.coordination.request_state import RequestState
from actors.coordination.results import RequestResults
from actors.coordination.worker_calls import Placed, WorkerCalls, call_report
from actors.messages import UNAVAILABLE, OpenSession, WorkItem
from actors.worker.bursts import BURST_CONTROL_GROUP, BurstRecord, FrozenStepCosts, burstable
from verifiers.machines.needs import PreDraft

logger = logging.getLogger(__name__)


class RunningBurst:
    """A burst whose call is out: its worker's handle and the id a stop names (sent once)."""

    def __init__(self, worker: Any, burst_id: str):
        self.worker = worker
        self.burst_id = burst_id
        self.stopped = False

    def stop(self) -> None:
        """Tell the worker to end this burst after its current iteration (fire and forget: the
        burst's stream says when it ended)."""
        if not self.stopped:
            self.stopped = True
            self.worker.stop_burst.options(concurrency_group=BURST_CONTROL_GROUP).remote(self.burst_id)


class SoloBursts:
    """Runs a lone request's iterations as bursts in its target's worker (see the module doc);
    ``burst_s`` 0: off."""

    def __init__(self, burst_s: float, *, calls: WorkerCalls, policy: StepPolicy, results: RequestResults,
                 admission: Admission, counters: StepCounters):
        self.burst_s = float(burst_s)
        self.calls = calls
        self.policy = policy
        self.results = results
        self.admission = admission
        self.counters = counters
        self.running: list[RunningBurst] = []

    def stop(self) -> None:
        """End every running burst after its current iteration: a request arrived or left."""
        for burst in self.running:
            burst.stop()

    def can_burst(self, cohort: Cohort) -> bool:
        """One request running (in every cohort), none waiting, no prompt being prefilled in chunks
        nor scored for its log-probabilities, and a machine whose iterations a burst can run
        (:func:`actors.worker.bursts.burstable`)."""
        if self.burst_s <= 0 or len(cohort.running) != 1 or self.admission.waiting or len(self.admission.running) != 1:
            return False
        request = cohort.running[0]
        return (not request.prefilling and not request.cancelled and not request.finished
                and not any(spec.prompt_logits for spec in request.opens.values()) and burstable(request.machine))

    async def run(self, request: RequestState) -> None:
        """Run ``request``'s iterations in its target's worker for up to ``burst_s`` (:mod:`actors.worker.bursts`);
        each streamed iteration is replayed through the request's own machine as a step of its own.
        Sessions not open yet open in the burst; they count as opened from the call on, so they
        are released whatever becomes of the burst (releasing a session never opened is a no-op)."""
        machine = request.machine
        target = machine.target
        set_plain_tokens(machine, 1)  # alone: the worker's copy and the replay draw alike
        live_costs = getattr(machine, "step_costs", None)
        if live_costs is not None:  # the worker's copy and the replay read the same costs, of a step alone
            machine.step_costs = FrozenStepCosts(self.policy.costs(machine, ALONE))
        try:
            blob = pickle.dumps(machine)
            # A peer hosted with the target is called in its process: its name is enough (no handle to send).
            with_target = self.calls.co_hosted({target})
            peers = {name: None if name in with_target else self.calls.workers[name]
                     for name in machine.streams() if name != target}
            releases, self.calls.releases[target] = self.calls.releases[target], []
            opens = dict(request.opens)
            request.opened |= set(opens)
            self.counters.bursts += 1
            burst = RunningBurst(self.calls.workers[target], f"{request.session_id}/{self.counters.bursts}")
            stream = self.calls.workers[target].burst.options(num_returns="streaming").remote(
                blob, request.session_id, peers, tuple(request.output.eos_token_ids), self.budget_s(request), releases,
                request.pre_drafted, opens=opens, burst_id=burst.burst_id)
            self.running.append(burst)
            try:
                previous = None  # when the burst's previous record arrived
                async for ref in stream:
                    record = await ref
                    arrived = time.perf_counter()
                    if request.finished or request.cancelled:
                        burst.stop()  # ends after its current iteration; the session is released next call
                        break
                    self.replay(request, record, None if previous is None else arrived - previous)
                    previous = arrived
            except Exception as error:  # noqa: BLE001 - the burst failed: this request only
                self.failed(request, target, error)
            finally:
                self.running.remove(burst)
        finally:
            if live_costs is not None:
                machine.step_costs = live_costs

    def budget_s(self, request: RequestState) -> float:
        """The burst's time budget: ``burst_s``, cut to what is left of the request's
        ``limits.request_timeout_s`` (a burst never runs a request past its timeout; once it is
        past, the burst runs one iteration and the next step ends the request as timed out)."""
        left = request.submitted + self.admission.request_timeout_s - time.perf_counter()
        return max(0.0, min(self.burst_s, left))

    def failed(self, request: RequestState, target: str, error: Exception) -> None:
        """A burst that raised: an exception of the burst's own code ends the request as an
        internal error; anything else (the worker died) as a lost worker call, retryable."""
        from ray.exceptions import RayTaskError

        if isinstance(error, RayTaskError) or not _is_ray_error(error):
            logger.error("request %s: the burst on %s failed: %s", request.session_id, target, error)
            self.results.fail(request, f"internal error: {type(error).__name__}")
            return
        logger.error("worker %s burst failed (%s); its sessions are lost", target, type(error).__name__)
        self.results.fail(request, UNAVAILABLE.format(model=target), retryable=True)

    def replay(self, request: RequestState, record: BurstRecord, period_s: float | None = None) -> None:
        """One iteration of a burst, as a step of one request: the request's machine must ask for
        exactly the needs the worker's copy executed; then their outcomes go the usual way.
        ``period_s``: the time since the burst's previous record arrived (None: the first)."""
        self.counters.step(1)
        self.counters.duration(record.wall_s)
        if not self.results.plan_iteration(request):
            return
        if tuple(request.last_needs) != record.needs:
            logger.error("request %s: a burst ran %s where the machine asks for %s", request.session_id,
                         record.needs, request.last_needs)
            self.results.fail(request, "internal error: a burst's iteration differs from the request's")
            return
        opened = {model: request.opens.pop(model) for model in record.opened if model in request.opens}
        if any(isinstance(need, PreDraft) for need in request.last_needs):
            request.pre_drafted = record.pre_drafted  # the next iteration may verify one of its chains
        elif all(outcome.error is None for outcome in record.outcomes) and costed_step(list(record.needs)) is not None:
            self.observe_iteration_costs(request, record, opened, period_s)  # like steps: not with a PreDraft
        self.results.advance(request, list(record.outcomes))

    def observe_iteration_costs(self, request: RequestState, record: BurstRecord,
                                opened: dict[str, OpenSession] | None = None, period_s: float | None = None) -> None:
        """Feed a burst's iteration to the cost model as a step of one request (one call per model;
        a call that opened a session, with its prompt's prefill, is marked so, as in a step). The
        step's wall time is the iteration's period as records arrive (``period_s``), when longer
        than its time in the worker: an iteration also pays handing its record out (serialized,
        streamed) before the next one starts, ~1 ms served on this CPU, a fixed cost per
        iteration that its ``wall_s`` leaves out and that makes short blocks dearer."""
        opened = dict(opened or {})
        entries = [Placed(request, i, WorkItem(request.session_id, need, open=opened.pop(need.model, None)))
                   for i, need in enumerate(record.needs)]
        reports = [call_report(model, [e for e in entries if e.item.need.model == model],
                               [o for e, o in zip(entries, record.outcomes) if e.item.need.model == model])
                   for model in dict.fromkeys(need.model for need in record.needs)]
        wall_s = max(record.wall_s, period_s or 0.0)
        self.policy.cost_model.observe_step(1, reports, wall_s, speculative=costed_step(list(record.needs)))


def _is_ray_error(error: Exception) -> bool:
    """Whether ``error`` is Ray's (an actor that died, an object lost), not the called code's."""
    from ray.exceptions import RayError

    return isinstance(error, RayError)
