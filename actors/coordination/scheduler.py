"""The step scheduler: every request in flight advances by one machine iteration per step, and each
model worker gets ONE call per step carrying the work of every request.

A step (:meth:`Scheduler._step`):

1. admit waiting requests up to ``max_running`` (continuous batching: requests join and leave
   between steps; the waiting line is bounded, a full one is refused with
   :class:`OverloadedError`);
2. ask each running request's machine for its needs (:mod:`verifiers.machines`);
3. group the needs by model into one :class:`~actors.messages.WorkItem` list per worker and
   call each worker once (``run_step.options(num_returns=2)``). A ScoreVerify reads the proposal of
   a Sample on another worker: the proposing worker's call goes first and its payload ref is
   an argument of the verifying worker's call, so Ray runs the two back to back and the
   proposals' logits travel worker to worker, never through here. A model with nothing to
   propose for others gets all its items in that second call;
   A request whose prompt is longer than ``max_tokens_per_step`` is admitted in a prefill
   phase first: each step it sends a :class:`~actors.messages.Prefill` item to every model it
   uses (the first opens the session), and each worker feeds the next chunk of the prompt with
   what its step budget leaves after the running requests' rows; once every worker holds the
   whole prompt but its last token, the request's machine makes its first iteration (chunked
   prefill: running streams keep producing tokens while a long prompt arrives; the tokens are
   the same, no random draw happens during the prefill);
4. hand each request its results; its machine returns the tokens made final, which go through
   the request's :class:`~actors.coordination.output.OutputTracker` (EOS, stop strings, max_tokens) and out
   as a chunk on the request's queue.

Finished, failed and cancelled requests leave between steps; their sessions are released in the
next call to each worker (a cancelled request never cancels a Ray task, so no actor waits for a
call that will not come). A worker call that fails ends only the requests that had work in it.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections import deque
from typing import Any

from actors.worker.bursts import BurstRecord, FrozenStepCosts, burst_home, burstable
from actors.messages import UNAVAILABLE, Prefill, WorkItem
from actors.coordination.metrics import SchedulerMetrics
from actors.coordination.requests import RequestState
from actors.coordination.admission import Admission
from actors.coordination.cohorts import Cohort
from actors.coordination.policy import ALONE, StepDecision, StepPolicy
from actors.coordination.results import RequestResults
from actors.coordination.worker_calls import Placed, StepRun, WorkerCalls, call_report
from verifiers.machines import PreDraft, Sample, ScoreVerify

logger = logging.getLogger(__name__)


class Scheduler:
    """Runs the step loops over the workers of one model group (inside the coordinator's event
    loop). ``cohorts``: 1 (every running request in every step) or 2 (two alternating cohorts
    that keep the draft and the target busy at the same time)."""

    def __init__(self, workers: dict[str, Any], *, max_running: int, max_waiting: int, cohorts: int = 1,
                 request_timeout_s: float = 600.0, metrics: SchedulerMetrics | None = None, goodput: bool = True,
                 pre_drafting: int = 0, max_tokens_per_step: int | None = None, burst_s: float = 0.0):
        if cohorts not in (1, 2):
            raise ValueError(f"cohorts must be 1 or 2, got {cohorts}")
        self.calls = WorkerCalls(workers)
        self.cohorts = [Cohort(i) for i in range(cohorts)]
        self.steps = 0
        self.batch_sizes: deque[int] = deque(maxlen=256)
        self.step_seconds: deque[float] = deque(maxlen=256)
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self._wakeup: asyncio.Condition | None = None
        self._loop_tasks: list[asyncio.Task] = []
        self._notify_tasks: set[asyncio.Task] = set()
        self.policy = StepPolicy(goodput=goodput)
        self.results = RequestResults(self.metrics, self.policy.acceptance_board)
        self.admission = Admission(self.cohorts, policy=self.policy, results=self.results, metrics=self.metrics,
                                   release=self.calls.release, max_running=max_running, max_waiting=max_waiting,
                                   request_timeout_s=request_timeout_s, pre_drafting=pre_drafting,
                                   max_tokens_per_step=max_tokens_per_step)
        #: Solo bursts (``engine.burst_ms``, :mod:`actors.worker.bursts`): with one request running and
        #: none waiting, its target's worker runs its iterations for up to this long per call; 0: off.
        self.burst_s = float(burst_s)
        self.bursts = 0

    @property
    def running(self) -> list[RequestState]:
        """Every running request, all cohorts."""
        return self.admission.running

    @property
    def waiting(self) -> deque[RequestState]:
        return self.admission.waiting

    @property
    def max_running(self) -> int:
        return self.admission.max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        self.admission.max_running = int(value)

    def submit(self, request: RequestState) -> None:
        """Queue a request (raises OverloadedError when the waiting line is full)."""
        self.admission.queue(request)
        self._ensure_loops()
        self._notify()

    def cancel(self, request: RequestState) -> None:
        """The client went away: the request leaves at the next step boundary."""
        if self.admission.cancel(request):
            self._notify()

    def active_session_ids(self) -> list[str]:
        return self.admission.active_session_ids()

    # ------------------------------------------------------------------ loops
    def _ensure_loops(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Condition()
        loop = asyncio.get_running_loop()
        self._loop_tasks = [
            task if task is not None and not task.done() else loop.create_task(self._run(cohort))
            for cohort, task in zip(self.cohorts, self._loop_tasks or [None] * len(self.cohorts))
        ]

    async def close(self) -> None:
        """Stop the step loops (the coordinator's event loop is about to end)."""
        tasks = [*self._loop_tasks, *self._notify_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_tasks = []
        self._notify_tasks.clear()

    def _notify(self) -> None:
        if self._wakeup is None:
            return

        async def notify() -> None:
            async with self._wakeup:
                self._wakeup.notify_all()

        # Kept until done: the loop holds only weak references to tasks, and close() cancels
        # the ones still pending.
        task = asyncio.get_running_loop().create_task(notify())
        self._notify_tasks.add(task)
        task.add_done_callback(self._notify_tasks.discard)

    async def _run(self, cohort: Cohort) -> None:
        while True:
            self.admission.expire(cohort)
            if self.admission.drop_left(cohort):
                self._notify()  # an idle cohort may admit now
            self.admission.admit(cohort)
            if not cohort.running:
                await self.calls.flush_releases()
                async with self._wakeup:
                    if not self.admission.can_admit():
                        try:  # a submit, a cancel or a finished request wakes it; waiting ones can expire
                            await asyncio.wait_for(self._wakeup.wait(), timeout=self.admission.request_timeout_s / 4)
                        except asyncio.TimeoutError:
                            pass
                continue
            started = time.perf_counter()
            try:
                if self._can_burst(cohort):
                    await self._burst(cohort.running[0])
                else:
                    await self._step(cohort)
                    self._count_duration(time.perf_counter() - started)
            except Exception as error:
                logger.exception("scheduler step failed; failing the cohort's requests")
                for request in list(cohort.running):
                    self.results.fail(request, f"internal error: {type(error).__name__}")
            # Let the streams' readers run between steps: in-process workers answer at once, and a
            # loop that never yields would hold every chunk until it idles.
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ one step
    async def _step(self, cohort: Cohort) -> None:
        """Schedule (the policy's decision, each request's needs), run (one call per worker), post-process
        (outcomes to the requests, timings to the policy)."""
        started = time.perf_counter()
        decision = self._schedule(cohort)
        if not cohort.running:
            return
        self._count_step(len(cohort.running))
        run = await self.calls.run(cohort.running)
        self._post_process(cohort, decision, run, started)

    def _schedule(self, cohort: Cohort) -> StepDecision:
        """The policy's decision for the step, then each request's needs (a prefilling request's
        next prompt chunks); a request whose machine fails to plan leaves the cohort."""
        decision = self.policy.decide(cohort)
        for request in list(cohort.running):
            if request.prefilling:
                request.last_needs = [Prefill(model) for model in sorted(request.prefilling)]
            elif not self._plan_iteration(request):
                cohort.running.remove(request)
                self.calls.release(request)
        return decision

    def _post_process(self, cohort: Cohort, decision: StepDecision, run: StepRun, started: float) -> None:
        """Each request's outcomes through its machine and out as a chunk; the step's timings and
        yield to the policy (not when a worker was lost: its requests fail, the others' too)."""
        if not run.lost:
            self.policy.observe_step(len(cohort.running), run.needs, run.reports, run.wall_s)
        for request in list(self.running):  # every cohort: their sessions on a lost worker are gone too
            if run.lost & request.opened:  # its sessions died with the worker, whatever this step did
                self.results.fail(request, UNAVAILABLE.format(model=sorted(run.lost & request.opened)[0]),
                                  retryable=True)
        committed = cohort.committed()
        for request in list(cohort.running):
            self.results.advance(request, run.of(request))
        if not run.lost:  # what a step of this mode yields at this batch
            self.policy.observe_mode(decision, len(cohort.running), cohort.committed() - committed,
                                     time.perf_counter() - started)

    # ------------------------------------------------------------------ solo bursts
    def _can_burst(self, cohort: Cohort) -> bool:
        """One request running (in every cohort), none waiting, every session open and no prompt
        being prefilled, and a machine whose iterations a burst can run (:func:`actors.worker.bursts.burstable`)."""
        if self.burst_s <= 0 or len(cohort.running) != 1 or self.waiting or len(self.running) != 1:
            return False
        request = cohort.running[0]
        return (not request.opens and not request.prefilling and not request.cancelled and not request.finished
                and burstable(request.machine))

    async def _burst(self, request: RequestState) -> None:
        """Run ``request``'s iterations in its burst home's worker (:func:`actors.worker.bursts.burst_home`: its
        target's) for up to ``burst_s`` (:mod:`actors.worker.bursts`);
        each streamed iteration is replayed through the request's own machine as a step of its own."""
        machine = request.machine
        target = burst_home(machine, self.calls.hosts.get)
        live_costs = getattr(machine, "step_costs", None)
        if live_costs is not None:  # the worker's copy and the replay read the same costs, of a step alone
            machine.step_costs = FrozenStepCosts(self.policy.costs(machine, ALONE))
        try:
            blob = pickle.dumps(machine)
            peers = {name: self.calls.workers[name] for name in machine.streams() if name != target}
            releases, self.calls.releases[target] = self.calls.releases[target], []
            self.bursts += 1
            stream = self.calls.workers[target].burst.options(num_returns="streaming").remote(
                blob, request.session_id, peers, tuple(request.output.eos_token_ids), self.burst_s, releases,
                request.pre_drafted)
            try:
                async for ref in stream:
                    record = await ref
                    if request.finished or request.cancelled:
                        break  # the worker stops within its budget; the session is released next call
                    self._replay(request, record)
            except Exception as error:  # noqa: BLE001 - the burst failed: this request only
                self._burst_failed(request, target, error)
        finally:
            if live_costs is not None:
                machine.step_costs = live_costs

    def _burst_failed(self, request: RequestState, target: str, error: Exception) -> None:
        """A burst that raised: an exception of the burst's own code ends the request as an
        internal error; anything else (the worker died) as a lost worker call, retryable."""
        from ray.exceptions import RayTaskError

        if isinstance(error, RayTaskError) or not _is_ray_error(error):
            logger.error("request %s: the burst on %s failed: %s", request.session_id, target, error)
            self.results.fail(request, f"internal error: {type(error).__name__}")
            return
        logger.error("worker %s burst failed (%s); its sessions are lost", target, type(error).__name__)
        self.results.fail(request, UNAVAILABLE.format(model=target), retryable=True)

    def _replay(self, request: RequestState, record: BurstRecord) -> None:
        """One iteration of a burst, as a step of one request: the request's machine must ask for
        exactly the needs the worker's copy executed; then their outcomes go the usual way."""
        self._count_step(1)
        self._count_duration(record.wall_s)
        if not self._plan_iteration(request):
            return
        if tuple(request.last_needs) != record.needs:
            logger.error("request %s: a burst ran %s where the machine asks for %s", request.session_id,
                         record.needs, request.last_needs)
            self.results.fail(request, "internal error: a burst's iteration differs from the request's")
            return
        if any(isinstance(need, PreDraft) for need in request.last_needs):
            request.pre_drafted = record.pre_drafted  # the next iteration may verify one of its chains
        elif all(outcome.error is None for outcome in record.outcomes) and \
                all(isinstance(need, (Sample, ScoreVerify)) for need in record.needs):
            # like steps: not with a PreDraft, nor an ensemble's shapes
            self._observe_iteration_costs(request, record)
        self.results.advance(request, list(record.outcomes))

    def _observe_iteration_costs(self, request: RequestState, record: BurstRecord) -> None:
        """Feed a burst's iteration to the cost model as a step of one request (one call per model)."""
        entries = [Placed(request, i, WorkItem(request.session_id, need)) for i, need in enumerate(record.needs)]
        reports = [call_report(model, [e for e in entries if e.item.need.model == model],
                               [o for e, o in zip(entries, record.outcomes) if e.item.need.model == model])
                   for model in dict.fromkeys(need.model for need in record.needs)]
        speculative = any(isinstance(need, ScoreVerify) for need in record.needs)
        self.policy.cost_model.observe_step(1, reports, record.wall_s, speculative=speculative)

    def _count_step(self, batch: int) -> None:
        self.steps += 1
        self.batch_sizes.append(batch)
        self.metrics.step(batch)

    def _count_duration(self, seconds: float) -> None:
        self.step_seconds.append(seconds)
        self.metrics.step_duration(seconds)

    def _plan_iteration(self, request: RequestState) -> bool:
        """``request.last_needs`` from its machine; False (the request failed) when it raises."""
        try:
            request.last_needs = request.machine.needs()
            return True
        except Exception as error:
            logger.exception("request %s: strategy failed to plan its iteration", request.session_id)
            self.results.fail(request, f"{type(error).__name__}: {error}")
            return False

def _is_ray_error(error: Exception) -> bool:
    """Whether ``error`` is Ray's (an actor that died, an object lost), not the called code's."""
    from ray.exceptions import RayError

    return isinstance(error, RayError)
