"""Admission: the waiting line and who runs. Requests wait in a bounded line (a full one is
refused with :class:`OverloadedError`) and are admitted into a cohort between steps while fewer
than ``max_running`` run and their KV blocks fit every worker's pool (continuous batching:
requests join and leave between steps); requests that finished, were cancelled or ran past the
request timeout leave between steps too.

Blocks: a request holding ``n`` tokens holds at most :meth:`actors.messages.KVPool.blocks_for`
``n`` blocks of each model's pool. When the running requests' blocks would no longer fit (they
grow by a few tokens a step), the newest running request of the cohort is *preempted*: it goes
back to the head of the waiting line, and its sessions stay open on the workers, which take its
blocks back when they need them (``actors.worker.engine``); resumed, it recomputes its context
and goes on with the same random streams, so its tokens are those it would have produced."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from actors.coordination.cohorts import Cohort, should_admit_into
from actors.coordination.metrics import SchedulerMetrics
from actors.coordination.policy import StepPolicy, target_verifies
from actors.coordination.request_state import RequestState
from actors.coordination.results import RequestResults
from actors.messages import KVPool

logger = logging.getLogger(__name__)


class OverloadedError(RuntimeError):
    """The scheduler's waiting line is full; retry later (HTTP 429 / RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))


class Admission:
    """The waiting line of one scheduler and its limits. ``release``: queues a leaving request's
    sessions for release (in the next call to each worker)."""

    def __init__(self, cohorts: list[Cohort], *, policy: StepPolicy, results: RequestResults,
                 metrics: SchedulerMetrics, release: Callable[[RequestState], None], max_running: int,
                 max_waiting: int, request_timeout_s: float, pre_drafting: int, max_tokens_per_step: int | None):
        self.cohorts = cohorts
        self.policy = policy
        self.results = results
        self.metrics = metrics
        self.release = release
        self.max_running = int(max_running)
        self.max_waiting = int(max_waiting)
        self.request_timeout_s = float(request_timeout_s)
        self.pre_drafting = int(pre_drafting)
        #: Prompts longer than this are prefilled in chunks before their first decoding step
        #: (the workers' step budget, ``engine.max_tokens_per_step``); None: never.
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[RequestState] = deque()
        #: Each model's KV block pool (``actors.messages.KVPool``); a model missing here is not counted.
        self.kv_pools: dict[str, KVPool] = {}
        self.preemptions = 0

    @property
    def running(self) -> list[RequestState]:
        """Every running request, all cohorts."""
        return [request for cohort in self.cohorts for request in cohort.running]

    def can_admit(self) -> bool:
        """Whether a request waits and there is room to run it (its KV blocks included)."""
        running = self.running
        return (bool(self.waiting) and len(running) < self.max_running
                and (not running or self.blocks_fit([*running, self.waiting[0]])))

    def queue(self, request: RequestState) -> None:
        """Queue a request (raises OverloadedError when the waiting line is full)."""
        running = len(self.running)
        if len(self.waiting) >= self.max_waiting and running >= self.max_running:
            self.metrics.refused(request.labels, "rejected")
            raise OverloadedError(
                f"server busy: {running} requests running (limit max_concurrent_requests="
                f"{self.max_running}) and {len(self.waiting)} waiting (limit max_queued_requests={self.max_waiting})"
            )
        self.waiting.append(request)

    def cancel(self, request: RequestState) -> bool:
        """The client went away: the request leaves at the next step boundary. False: it had ended."""
        if request.finished:
            return False
        request.cancelled = True
        self.metrics.ended(request.labels, request.clock, "cancelled", time.perf_counter(), request.submitted,
                           admitted=bool(request.started))
        logger.info("request %s cancelled", request.session_id)
        return True

    def active_session_ids(self) -> list[str]:
        return [r.session_id for r in self.running] + [r.session_id for r in self.waiting]

    def expire(self, cohort: Cohort) -> None:
        """End the requests (running in this cohort, or waiting) older than the request timeout."""
        now = time.perf_counter()
        message = f"the request ran past limits.request_timeout_s={self.request_timeout_s:g} s"
        for request in [*cohort.running, *self.waiting]:
            if not request.finished and now - request.submitted > self.request_timeout_s:
                self.results.fail(request, message, timed_out=True)
        for request in [r for r in self.waiting if r.finished]:
            self._leave_waiting(request)

    def drop_left(self, cohort: Cohort) -> bool:
        """Remove finished and cancelled requests; queue their sessions for release. True when
        some left while others wait (an idle cohort may admit now)."""
        left = [r for r in cohort.running if r.finished or r.cancelled]
        for request in left:
            cohort.running.remove(request)
            self.release(request)
        wake = bool(left) and bool(self.waiting)
        for request in [r for r in self.waiting if r.cancelled]:
            self._leave_waiting(request)
        return wake

    def _leave_waiting(self, request: RequestState) -> None:
        """``request`` leaves the waiting line; a preempted one's sessions are released."""
        self.waiting.remove(request)
        if request.preempted:
            self.release(request)

    def blocks_fit(self, requests: list[RequestState]) -> bool:
        """Whether ``requests`` together fit every model's KV block pool (see the module doc)."""
        for model, pool in self.kv_pools.items():
            tokens = [len(r.prompt_ids) + len(r.output.token_ids) for r in requests if model in r.opens or model in r.opened]
            if sum(pool.blocks_for(n) for n in tokens) > pool.blocks:
                return False
        return True

    def preempt(self, cohort: Cohort) -> None:
        """While the running requests' blocks do not fit, the newest running request of ``cohort``
        goes back to the head of the waiting line (never the last running one)."""
        while len(self.running) > 1 and cohort.running and not self.blocks_fit(self.running):
            request = max(cohort.running, key=lambda r: r.started)
            cohort.running.remove(request)
            self.waiting.appendleft(request)
            request.preempted += 1
            self.preemptions += 1
            logger.info("request %s preempted: the KV blocks of %d running requests would not fit",
                        request.session_id, len(self.running) + 1)

    def admit(self, cohort: Cohort) -> None:
        """Start waiting requests in ``cohort`` while the total is under ``max_running``, their KV
        blocks fit (a lone request always runs) and the cohort is not the larger one (the cohorts
        stay balanced). A preempted request resumes where it stopped."""
        while self.can_admit():
            if not should_admit_into(cohort, self.cohorts):
                return
            request = self.waiting.popleft()
            if request.preempted:
                cohort.running.append(request)
                continue
            request.started = time.perf_counter()
            self.policy.admit(request)
            if target_verifies(request.machine) and request.machine.num_drafts == 1:
                request.machine.pre_drafting = self.pre_drafting
            if self.max_tokens_per_step is not None and len(request.prompt_ids) > self.max_tokens_per_step:
                request.prefilling = set(request.opens)
            cohort.running.append(request)
            self.metrics.admitted(request.labels, request.clock, len(request.prompt_ids),
                                  request.started - request.submitted)
