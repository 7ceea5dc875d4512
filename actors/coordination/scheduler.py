"""The step scheduler: every request in flight advances by one machine iteration per step, and each
model worker gets ONE call per step carrying the work of every request.

Each cohort's step loop (:meth:`Scheduler._run`): requests join and leave between steps
(:mod:`actors.coordination.admission`: the bounded waiting line, continuous batching up to
``max_running``, timeouts, cancellations); a lone request may run as a solo burst in its
target's worker (:mod:`actors.coordination.solo_bursts`); else a step (:meth:`Scheduler._step`):

1. schedule: the step policy decides what the cohort's gamma-auto requests do
   (:mod:`actors.coordination.policy`), a plain iteration draws ``engine.step_tokens`` (at most
   ``engine.first_step_tokens`` in a step that gives a request its first token: a newcomer waits
   for few forwards, not a whole multi-token step), then each request's machine says its needs
   (:mod:`verifiers.machines`). A request whose prompt is longer than ``max_tokens_per_step``
   is admitted in a prefill phase first: each step it sends a :class:`~actors.messages.Prefill`
   item to every model it uses, and each worker feeds the next chunk of the prompt with what its
   step budget leaves after the running requests' rows (chunked prefill: running streams keep
   producing tokens while a long prompt arrives; the tokens are the same, no random draw
   happens during the prefill);
2. run: the needs grouped by model, one call per worker (:mod:`actors.coordination.worker_calls`:
   proposals travel worker to worker, never through here);
3. post-process: each request's outcomes through its machine, the tokens made final through its
   output and out as a chunk on its queue (:mod:`actors.coordination.results`); the step's
   timings and yield to the policy.

Finished, failed and cancelled requests leave between steps; their sessions are released in the
next call to each worker (a cancelled request never cancels a Ray task, so no actor waits for a
call that will not come). A worker call that fails ends only the requests that had work in it
(and every request with a session on a worker that died).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any

from actors.coordination.admission import Admission
from actors.coordination.cohorts import Cohort
from actors.coordination.metrics import SchedulerMetrics, StepCounters
from actors.coordination.policy import COHORT_PLAIN_TOKENS, StepDecision, StepPolicy, first_token_due, set_plain_tokens
from actors.coordination.request_state import RequestState
from actors.coordination.results import RequestResults
from actors.coordination.solo_bursts import SoloBursts
from actors.coordination.worker_calls import StepRun, WorkerCalls
from actors.messages import UNAVAILABLE, Prefill

logger = logging.getLogger(__name__)



def background_task(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """``coroutine`` as a task of the running loop that belongs to no request.

    A task copies its creator's context, and in an async actor Ray keeps the current task's id
    there: a loop started inside a request's ``generate`` call would submit its worker calls as
    that request's children, and ``ray.cancel`` (recursive), which the ingress calls when the
    request's client goes away, would cancel them, failing every request of the step. A fresh
    context leaves them to the actor."""
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())

class Scheduler:
    """Runs the step loops over the workers of one model group (inside the coordinator's event
    loop). ``cohorts``: 1 (every running request in every step) or 2 (two alternating cohorts
    that keep the draft and the target busy at the same time)."""

    def __init__(self, workers: dict[str, Any], *, max_running: int, max_waiting: int, cohorts: int = 1,
                 request_timeout_s: float = 600.0, metrics: SchedulerMetrics | None = None, goodput: bool = True,
                 pre_drafting: int = 0, max_tokens_per_step: int | None = None, burst_s: float = 0.0,
                 step_tokens: int = COHORT_PLAIN_TOKENS, first_step_tokens: int | None = None):
        if cohorts not in (1, 2):
            raise ValueError(f"cohorts must be 1 or 2, got {cohorts}")
        self.calls = WorkerCalls(workers)
        self.cohorts = [Cohort(i) for i in range(cohorts)]
        self.metrics = metrics if metrics is not None else SchedulerMetrics()
        self.counters = StepCounters(self.metrics)
        self._wakeup: asyncio.Condition | None = None
        self._loop_tasks: list[asyncio.Task] = []
        self._notify_tasks: set[asyncio.Task] = set()
        self.policy = StepPolicy(goodput=goodput, step_tokens=step_tokens)
        #: A plain iteration's draws in a step that gives a request its first token (engine.first_step_tokens).
        self.first_step_tokens = step_tokens if first_step_tokens is None else min(step_tokens, int(first_step_tokens))
        self.results = RequestResults(self.metrics, self.policy.acceptance_board)
        self.admission = Admission(self.cohorts, policy=self.policy, results=self.results, metrics=self.metrics,
                                   release=self.calls.release, max_running=max_running, max_waiting=max_waiting,
                                   request_timeout_s=request_timeout_s, pre_drafting=pre_drafting,
                                   max_tokens_per_step=max_tokens_per_step)
        self.solo_bursts = SoloBursts(burst_s, calls=self.calls, policy=self.policy, results=self.results,
                                      admission=self.admission, counters=self.counters)

    @property
    def running(self) -> list[RequestState]:
        """Every running request, all cohorts."""
        return self.admission.running

    @property
    def steps(self) -> int:
        return self.counters.steps

    @property
    def bursts(self) -> int:
        return self.counters.bursts

    @property
    def batch_sizes(self) -> deque[int]:
        return self.counters.batch_sizes

    @property
    def step_seconds(self) -> deque[float]:
        return self.counters.step_seconds

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
        self.solo_bursts.stop()  # a running burst ends after its current iteration: this one is admitted
        self._ensure_loops()
        self._notify()

    def cancel(self, request: RequestState) -> None:
        """The client went away: the request leaves at the next step boundary."""
        if self.admission.cancel(request):
            self.solo_bursts.stop()
            self._notify()

    def active_session_ids(self) -> list[str]:
        return self.admission.active_session_ids()

    # ------------------------------------------------------------------ loops
    def _ensure_loops(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Condition()
        self._loop_tasks = [
            task if task is not None and not task.done() else background_task(self._run(cohort))
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
            self.admission.preempt(cohort)
            self.admission.admit(cohort)
            if not cohort.running:
                await self.calls.flush_releases()
                async with self._wakeup:
                    if not self.admission.can_admit():
                        # A submit, a cancel or a finished request wakes it; waiting ones can expire. (Not
                        # wait_for: on Python 3.11 it drops a cancel that comes as the wait ends, and
                        # close() then waits out the whole timeout.)
                        try:
                            async with asyncio.timeout(self.admission.request_timeout_s / 4):
                                await self._wakeup.wait()
                        except TimeoutError:
                            pass
                continue
            started = time.perf_counter()
            try:
                if self.solo_bursts.can_burst(cohort):
                    await self.solo_bursts.run(cohort.running[0])
                else:
                    await self._step(cohort)
                    self.counters.duration(time.perf_counter() - started)
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
        self.counters.step(len(cohort.running))
        run = await self.calls.run(cohort.running)
        self._post_process(cohort, decision, run, started)

    def _schedule(self, cohort: Cohort) -> StepDecision:
        """The policy's decision for the step, then each request's needs (a prefilling request's
        next prompt chunks); a request whose machine fails to plan leaves the cohort."""
        decision = self.policy.decide(cohort)
        tokens = self.policy.step_tokens
        if any(first_token_due(request) for request in cohort.running) and self.first_step_tokens < tokens:
            # A newcomer's first chunk sooner. The step's yield still stands for its mode: under
            # arrivals most steps carry a newcomer (at 16 clients nearly every one), so the steps
            # without one measured speculation ~15% above what whole runs of it served.
            tokens = self.first_step_tokens
        for request in list(cohort.running):
            set_plain_tokens(request.machine, len(cohort.running), tokens)
            if request.prefilling:
                request.last_needs = [Prefill(model) for model in sorted(request.prefilling)]
            elif not self.results.plan_iteration(request):
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
