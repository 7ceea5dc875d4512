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
from dataclasses import dataclass
from typing import Any

from actors.worker.bursts import BurstRecord, FrozenStepCosts, burst_home, burstable
from actors.worker.device_worker import HostCall, host_of
from actors.messages import UNAVAILABLE, ItemOutcome, Prefill, WorkItem
from actors.coordination.metrics import SchedulerMetrics
from actors.coordination.requests import RequestState
from actors.coordination.admission import Admission
from actors.coordination.cohorts import Cohort
from actors.coordination.policy import ALONE, StepPolicy
from actors.coordination.results import RequestResults
from actors.coordination.step_costs import CallReport
from verifiers.machines import (
    MODEL_FREE,
    PRE_DRAFTED,
    PreDraft,
    Sample,
    ScoreBlock,
    ScoreVerify,
)

logger = logging.getLogger(__name__)

@dataclass
class _Placed:
    """A need of a request placed in a worker call."""

    request: RequestState
    need_index: int
    item: WorkItem
    carried: tuple[Any, int] | None = None  # a ScoreVerify of a pre-drafted block: where the block is


class Scheduler:
    """Runs the step loops over the workers of one model group (inside the coordinator's event
    loop). ``cohorts``: 1 (every running request in every step) or 2 (two alternating cohorts
    that keep the draft and the target busy at the same time)."""

    def __init__(self, workers: dict[str, Any], *, max_running: int, max_waiting: int, cohorts: int = 1,
                 request_timeout_s: float = 600.0, metrics: SchedulerMetrics | None = None, goodput: bool = True,
                 pre_drafting: int = 0, max_tokens_per_step: int | None = None, burst_s: float = 0.0):
        if cohorts not in (1, 2):
            raise ValueError(f"cohorts must be 1 or 2, got {cohorts}")
        self.workers = dict(workers)
        #: model -> the id of the worker hosting it with others (actors.worker.device_worker); None: its own worker
        self.hosts: dict[str, str | None] = {name: host_of(handle) for name, handle in self.workers.items()}
        self.cohorts = [Cohort(i) for i in range(cohorts)]
        self.releases: dict[str, list[str]] = {name: [] for name in self.workers}
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
                                   release=self._release, max_running=max_running, max_waiting=max_waiting,
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
                await self._flush_releases()
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

    def _release(self, request: RequestState) -> None:
        for model in request.opened:
            self.releases[model].append(request.session_id)
        request.opened = set()

    async def _flush_releases(self) -> None:
        calls = [self._call(model, []) for model, ids in self.releases.items() if ids]
        for outcomes_ref, _ in calls:
            try:
                await outcomes_ref
            except Exception as error:  # noqa: BLE001 - a dead worker has nothing left to free
                logger.warning("releasing sessions failed: %s", error)

    # ------------------------------------------------------------------ one step
    async def _step(self, cohort: Cohort) -> None:
        step_started = time.perf_counter()
        decision = self.policy.decide(cohort)
        for request in list(cohort.running):
            if request.prefilling:
                request.last_needs = [Prefill(model) for model in sorted(request.prefilling)]
                continue
            if not self._plan_iteration(request):
                cohort.running.remove(request)
                self._release(request)
        if not cohort.running:
            return
        placed = self._place([(request, request.last_needs) for request in cohort.running])
        self._count_step(len(cohort.running))
        per_request: dict[int, dict[int, ItemOutcome]] = {id(r): {} for r in cohort.running}
        lost: set[str] = set()
        reports: list[CallReport] = []
        started = time.perf_counter()
        for (model, _), (ref, entries) in self._call_workers(placed).items():
            try:
                outcomes = await ref
            except Exception as error:  # noqa: BLE001 - the worker call failed: its requests fail
                logger.error("worker %s call failed (%s); its sessions are lost", model, type(error).__name__)
                lost.add(model)
                outcomes = [ItemOutcome(error=UNAVAILABLE.format(model=model))] * len(entries)
            for entry, outcome in zip(entries, outcomes):
                per_request[id(entry.request)][entry.need_index] = outcome
            if entries:
                reports.append(call_report(model, entries, outcomes))
        lost |= self._co_hosted(lost)  # a worker that died took every model it hosted
        if not lost:
            needs = [entry.item.need for phases in placed.values() for phase in phases for entry in phase]
            self.policy.observe_step(len(cohort.running), needs, reports, time.perf_counter() - started)
        for request in list(self.running):  # every cohort: their sessions on a lost worker are gone too
            if lost & request.opened:  # its sessions died with the worker, whatever this step did
                self.results.fail(request, UNAVAILABLE.format(model=sorted(lost & request.opened)[0]), retryable=True)
        committed = cohort.committed()
        for request in list(cohort.running):
            outcomes = per_request[id(request)]
            self.results.advance(request, [outcomes[i] for i in range(len(request.last_needs))])
        if not lost:  # what a step of this mode yields at this batch
            self.policy.observe_mode(decision, len(cohort.running), cohort.committed() - committed,
                                     time.perf_counter() - step_started)

    def _co_hosted(self, models: set[str]) -> set[str]:
        """The models hosted by the same workers as ``models`` (:mod:`actors.worker.device_worker`)."""
        hosts = {self.hosts[m] for m in models} - {None}
        return {m for m, host in self.hosts.items() if host in hosts}

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
        target = burst_home(machine, self.hosts.get)
        live_costs = getattr(machine, "step_costs", None)
        if live_costs is not None:  # the worker's copy and the replay read the same costs, of a step alone
            machine.step_costs = FrozenStepCosts(self.policy.costs(machine, ALONE))
        try:
            blob = pickle.dumps(machine)
            peers = {name: self.workers[name] for name in machine.streams() if name != target}
            releases, self.releases[target] = self.releases[target], []
            self.bursts += 1
            stream = self.workers[target].burst.options(num_returns="streaming").remote(
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
        entries = [_Placed(request, i, WorkItem(request.session_id, need)) for i, need in enumerate(record.needs)]
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

    def _place(self, work: list[tuple[RequestState, list]]) -> dict[str, list[list[_Placed]]]:
        """Group needs into per-model item lists for phase 0 (proposers) and phase 1 (verifiers
        and everything on a model no one waits for)."""
        verifying = {need.model for _, needs in work for need in needs if isinstance(need, (ScoreVerify, ScoreBlock))}
        sources = {needs[need.draft_need].model for _, needs in work for need in needs
                   if isinstance(need, (ScoreVerify, ScoreBlock)) and need.draft_need >= 0}
        placed: dict[str, list[list[_Placed]]] = {name: [[], []] for name in self.workers}
        for request, needs in work:
            positions: dict[int, tuple[str, int, int]] = {}
            for index, need in enumerate(needs):
                phase = 1 if (isinstance(need, (ScoreVerify, ScoreBlock, PreDraft))
                              or (need.model in verifying and need.model not in sources)) else 0
                open_spec = request.opens.pop(need.model, None)
                if open_spec is not None:
                    request.opened.add(need.model)
                source, carried = None, None
                if isinstance(need, ScoreVerify) and need.draft_need == PRE_DRAFTED:
                    carried = request.pre_drafted  # the previous step's PreDraft: see _call_workers
                    if carried is None:
                        raise RuntimeError("a pre-drafted block to verify, but no PreDraft ran")
                elif isinstance(need, (ScoreVerify, ScoreBlock)) and need.draft_need != MODEL_FREE:
                    source = positions[need.draft_need]
                item = WorkItem(session_id=request.session_id, need=need, open=open_spec,
                                proposal_source=None if source is None else (source[0], source[2]))
                slot_list = placed[need.model][phase]
                positions[index] = (need.model, phase, len(slot_list))
                slot_list.append(_Placed(request, index, item, carried))
        return placed

    def _call_workers(self, placed: dict[str, list[list[_Placed]]]) -> dict[tuple[str, int], tuple[Any, list[_Placed]]]:
        """Submit the step's calls: ``(model, phase) -> (outcomes ref, entries)``. Models with a worker
        of their own get one call per phase; models hosted together (:mod:`actors.worker.device_worker`) get
        one call per host, their proposers first, when every proposal the host verifies this step is
        its own (else one call per phase). Calls that others read go out first."""
        calls: dict[tuple[str, int], tuple[Any, list[_Placed]]] = {}
        payload_refs: dict[str, Any] = {}
        hosts = self._hosted(placed)
        whole = {host for host, models in hosts.items() if self._host_self_contained(models, placed)}
        for model, (phase0, _) in placed.items():
            if phase0 and self.hosts[model] is None:
                outcomes_ref, payloads_ref = self._call(model, [e.item for e in phase0])
                calls[(model, 0)] = (outcomes_ref, phase0)
                payload_refs[model] = payloads_ref
        for host, models in hosts.items():
            phases = (0, 1) if host in whole else (0,)
            self._call_host(models, [(m, p) for p in phases for m in models if placed[m][p]], placed, calls, payload_refs)
        for model, (_, phase1) in placed.items():
            if not phase1 or self.hosts[model] is not None:
                continue
            source_models = sorted({e.item.proposal_source[0] for e in phase1 if e.item.proposal_source})
            sources = [payload_refs[name] for name in source_models]  # refs nested: see ModelWorker.run_step
            index_of: dict[Any, int] = {name: i for i, name in enumerate(source_models)}
            items = [self._phase1_item(e, index_of, sources) for e in phase1]
            outcomes_ref, payloads_ref = self._call(model, items, sources)
            calls[(model, 1)] = (outcomes_ref, phase1)
            for position, entry in enumerate(phase1):
                if isinstance(entry.item.need, PreDraft):  # the next step may verify one of its chains
                    entry.request.pre_drafted = (payloads_ref, position)
        for host, models in hosts.items():
            if host not in whole:
                self._call_host(models, [(m, 1) for m in models if placed[m][1]], placed, calls, payload_refs)
        for model, ids in self.releases.items():
            if ids and not any(key[0] == model for key in calls):
                calls[(model, 0)] = (self._call(model, [])[0], [])
        return calls

    def _hosted(self, placed: dict[str, list[list[_Placed]]]) -> dict[str, list[str]]:
        """host id -> its models with work this step (in the order of ``placed``)."""
        hosts: dict[str, list[str]] = {}
        for model, phases in placed.items():
            host = self.hosts[model]
            if host is not None and (phases[0] or phases[1]):
                hosts.setdefault(host, []).append(model)
        return hosts

    def _host_self_contained(self, models: list[str], placed: dict[str, list[list[_Placed]]]) -> bool:
        """Whether every proposal the host's models verify this step comes from the same host, and
        no other worker reads one of its proposals (that worker would wait for the whole call's
        end, the host's verification included, instead of the proposal's: the drafted ensemble's
        members on workers of their own)."""
        host = self.hosts[models[0]]
        reads = [(m, e.item.proposal_source[0]) for m, phases in placed.items() for e in phases[1]
                 if e.item.proposal_source]
        return all(self.hosts[source] == host for m, source in reads if self.hosts[m] == host) and \
            not any(self.hosts[source] == host and self.hosts[m] != host for m, source in reads)

    def _call_host(self, models: list[str], parts: list[tuple[str, int]], placed: dict[str, list[list[_Placed]]],
                   calls: dict[tuple[str, int], tuple[Any, list[_Placed]]], payload_refs: dict[str, Any]) -> None:
        """One :meth:`actors.worker.device_worker.DeviceWorker.run_steps` call for ``parts`` (model, phase) of
        one host, in that order: a verifier reads a proposer of the same call in the host's process;
        only payloads read outside the call come back."""
        if not parts:
            return
        host = self.hosts[parts[0][0]]
        read_elsewhere = {e.item.proposal_source[0] for m, (_, phase1) in placed.items() for e in phase1
                          if e.item.proposal_source and (m, 1) not in parts}
        host_calls: list[HostCall] = []
        external: list[Any] = []
        local_index: dict[str, int] = {}
        for model, phase in parts:
            entries = placed[model][phase]
            sources: list[tuple[str, int]] = []
            index_of: dict[Any, int] = {}
            items = [self._host_item(e, local_index, payload_refs, sources, external, index_of) for e in entries]
            keep = (model in read_elsewhere if phase == 0
                    else any(isinstance(e.item.need, PreDraft) for e in entries))
            if phase == 0:
                local_index[model] = len(host_calls)
            host_calls.append(HostCall(model, tuple(items), tuple(sources), keep))
        releases = {}
        for model in self.hosts:
            if self.hosts[model] == host and self.releases[model]:
                releases[model], self.releases[model] = self.releases[model], []
        refs = self.workers[parts[0][0]].host.run_steps.options(num_returns=2 * len(host_calls)).remote(
            host_calls, source_payloads=external, releases=releases)
        for position, (model, phase) in enumerate(parts):
            entries = placed[model][phase]
            outcomes_ref, payloads_ref = refs[2 * position], refs[2 * position + 1]
            calls[(model, phase)] = (outcomes_ref, entries)
            if phase == 0:
                payload_refs[model] = payloads_ref
            for index, entry in enumerate(entries):
                if isinstance(entry.item.need, PreDraft):
                    entry.request.pre_drafted = (payloads_ref, index)

    @staticmethod
    def _host_item(entry: _Placed, local_index: dict[str, int], payload_refs: dict[str, Any],
                   sources: list[tuple[str, int]], external: list[Any], index_of: dict[Any, int]) -> WorkItem:
        """``entry``'s item for a host call: its proposal source as an index into the call's
        ``sources``, each ``("local", call)`` (a proposer of the same host call) or ``("arg", i)``
        (``external[i]``: another worker's payloads, or an earlier step's pre-drafted chains)."""
        item = entry.item
        if entry.carried is not None:
            key, position = id(entry.carried[0]), entry.carried[1]
            if key not in index_of:
                index_of[key] = len(sources)
                sources.append(("arg", len(external)))
                external.append(entry.carried[0])
        elif item.proposal_source is not None:
            key, position = item.proposal_source
            if key not in index_of:
                index_of[key] = len(sources)
                if key in local_index:
                    sources.append(("local", local_index[key]))
                else:
                    sources.append(("arg", len(external)))
                    external.append(payload_refs[key])
        else:
            return item
        return WorkItem(session_id=item.session_id, need=item.need, open=item.open,
                        proposal_source=(index_of[key], position))

    @staticmethod
    def _phase1_item(entry: _Placed, index_of: dict[Any, int], sources: list[Any]) -> WorkItem:
        """``entry``'s item with its proposal source as an index into ``sources``: a model of this
        step's phase 0, or the payloads of an earlier call holding a pre-drafted block (added to
        ``sources`` once per call)."""
        item = entry.item
        if entry.carried is not None:
            payloads_ref, position = entry.carried
            if id(payloads_ref) not in index_of:
                index_of[id(payloads_ref)] = len(sources)
                sources.append(payloads_ref)
            source = (index_of[id(payloads_ref)], position)
        elif item.proposal_source is not None:
            source = (index_of[item.proposal_source[0]], item.proposal_source[1])
        else:
            return item
        return WorkItem(session_id=item.session_id, need=item.need, open=item.open, proposal_source=source)

    def _call(self, model: str, items: list[WorkItem], sources: list[Any] = ()) -> tuple[Any, Any]:
        releases, self.releases[model] = self.releases[model], []
        call = self.workers[model].run_step.options(num_returns=2)
        return call.remote(items, source_payloads=list(sources), releases=releases)

def call_report(model: str, entries: list[_Placed], outcomes: list[ItemOutcome]) -> CallReport:
    """What one worker call of a step ran (for :class:`actors.coordination.step_costs.StepCostModel`)."""
    timings = [outcome.timing for outcome in outcomes if outcome.timing is not None]
    forwards = [timing.forward_calls for timing in timings]
    # Steps that prefill a prompt are left out; items with different forward counts give the
    # call's mean tokens per forward.
    uniform = len(timings) == len(entries) and min(forwards, default=0) > 0 and all(
        entry.item.open is None for entry in entries)
    return CallReport(model=model, tokens_fed=sum(timing.tokens_fed for timing in timings),
                      forwards=max(forwards, default=0), forward_s=max((t.forward_s for t in timings), default=0.0),
                      uniform=uniform, call_s=max((t.call_s for t in timings), default=0.0))


def _is_ray_error(error: Exception) -> bool:
    """Whether ``error`` is Ray's (an actor that died, an object lost), not the called code's."""
    from ray.exceptions import RayError

    return isinstance(error, RayError)
