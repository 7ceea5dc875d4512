"""Placement and the calls to the workers: a step's needs grouped by model into one
:class:`~actors.messages.WorkItem` list per worker, and each worker called once per phase.

A ScoreVerify reads the proposal of a Sample on another worker: the proposing worker's call goes
first (phase 0) and its payload ref is an argument of the verifying worker's call (phase 1), so
Ray runs the two back to back and the proposals' logits travel worker to worker, never through
the coordinator. A model with nothing to propose for others gets all its items in the second
call. Models hosted by one worker (:mod:`actors.worker.device_worker`) get one call per host.
Sessions of requests that left are released in the next call to each worker. Between workers of
their own the proposals' logits may move over Ray Direct Transport instead
(:mod:`actors.coordination.row_transport`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from actors.coordination.request_state import RequestState
from actors.coordination.row_transport import ROWS_LOST, RowTransport
from actors.coordination.step_costs import CallReport
from actors.messages import UNAVAILABLE, ItemOutcome, WorkItem
from actors.worker.device_worker import HostCall, host_of
from verifiers.machines.needs import MODEL_FREE, PRE_DRAFTED, PreDraft, ScoreBlock, ScoreVerify

logger = logging.getLogger(__name__)


@dataclass
class Placed:
    """A need of a request placed in a worker call."""

    request: RequestState
    need_index: int
    item: WorkItem
    carried: tuple[Any, int] | None = None  # a ScoreVerify of a pre-drafted block: where the block is


@dataclass
class StepRun:
    """What a step's worker calls gave: each request's outcome per need index, the models whose
    worker call failed (with the models hosted beside them), one report per call that carried
    items, every placed need, and the calls' wall time."""

    outcomes: dict[int, dict[int, ItemOutcome]]  # id(request) -> need index -> outcome
    lost: set[str]
    reports: list[CallReport] = field(default_factory=list)
    needs: list = field(default_factory=list)
    wall_s: float = 0.0

    def of(self, request: RequestState) -> list[ItemOutcome]:
        """``request``'s outcomes, in the order of its needs."""
        outcomes = self.outcomes[id(request)]
        return [outcomes[i] for i in range(len(request.last_needs))]


class WorkerCalls:
    """The workers of one model group and how a step calls them (see the module doc)."""

    def __init__(self, workers: dict[str, Any], transport: RowTransport | None = None):
        self.workers = dict(workers)
        self.transport = transport or RowTransport("object_store")
        self.rows_calls: set[str] = set()  # models whose phase-1 call this step reads rows over RDT
        self.read_from: dict[str, list[str]] = {}  # model -> the models whose proposals its phase-1 call reads
        #: model -> the id of the worker hosting it with others (actors.worker.device_worker); None: its own worker
        self.hosts: dict[str, str | None] = {name: host_of(handle) for name, handle in self.workers.items()}
        self.releases: dict[str, list[str]] = {name: [] for name in self.workers}

    async def run(self, requests: list[RequestState]) -> StepRun:
        """Place the requests' ``last_needs``, call the workers and wait for every call."""
        await self.transport.prepare(self.workers, self.hosts)
        placed = self.place([(request, request.last_needs) for request in requests])
        run = StepRun({id(r): {} for r in requests}, set(),
                      needs=[entry.item.need for phases in placed.values() for phase in phases for entry in phase])
        started = time.perf_counter()
        stamps: dict[tuple[str, int], Any] = {}  # (model, phase) -> a timing of the call
        for (model, phase), (ref, entries) in self.call_workers(placed).items():
            try:
                outcomes = await ref
            except Exception as error:  # noqa: BLE001 - the worker call failed: its requests fail
                outcomes = self.failed_call(model, phase, error, run.lost, len(entries))
            for entry, outcome in zip(entries, outcomes):
                run.outcomes[id(entry.request)][entry.need_index] = outcome
            if outcomes and outcomes[0].error is None:
                stamps[(model, phase)] = outcomes[0].timing
            if entries:
                run.reports.append(call_report(model, entries, outcomes))
        run.wall_s = time.perf_counter() - started
        self.time_moves(stamps)
        run.lost |= self.co_hosted(run.lost)  # a worker that died took every model it hosted
        if run.lost and self.transport.active:  # its restarted process is in no collective group
            self.transport.fail(RuntimeError(f"workers {sorted(run.lost)} restarted"), "a worker left the collective group")
        return run

    def failed_call(self, model: str, phase: int, error: Exception, lost: set[str], count: int) -> list[ItemOutcome]:
        """The outcomes of ``model``'s failed call. A verifying call that read rows over RDT and failed
        for anything but its own worker's death never ran (its rows, or their source, failed): its
        requests fail, retryable, its sessions stay, and the transport falls back to the object store
        unless the source itself was lost. Else the worker's sessions are lost."""
        if phase == 1 and model in self.rows_calls and getattr(error, "actor_id", None) != actor_id(self.workers[model]):
            if not lost:
                self.transport.fail(error, f"moving rows to {model} failed")
            message = ROWS_LOST.format(model=model, error=type(error).__name__)
            return [ItemOutcome(error=message, retryable=True)] * count
        logger.error("worker %s call failed (%s); its sessions are lost", model, type(error).__name__)
        lost.add(model)
        return [ItemOutcome(error=UNAVAILABLE.format(model=model))] * count

    def time_moves(self, stamps: dict[tuple[str, int], Any]) -> None:
        """Record how long this step's proposals took to reach each verifying call of a worker of its
        own: from its proposers' end to its having their payloads and rows (``CallTiming`` stamps)."""
        for model, sources in self.read_from.items():
            verifier = stamps.get((model, 1))
            ends = [stamps[(source, 0)].ended_at for source in sources if (source, 0) in stamps]
            if verifier is not None and verifier.sources_at and len(ends) == len(sources) and all(ends):
                self.transport.moved_in(max(0.0, verifier.sources_at - max(ends)))

    def release(self, request: RequestState) -> None:
        for model in request.opened:
            self.releases[model].append(request.session_id)
        request.opened = set()

    async def flush_releases(self) -> None:
        calls = [self.call(model, []) for model, ids in self.releases.items() if ids]
        for outcomes_ref, _ in calls:
            try:
                await outcomes_ref
            except Exception as error:  # noqa: BLE001 - a dead worker has nothing left to free
                logger.warning("releasing sessions failed: %s", error)

    def co_hosted(self, models: set[str]) -> set[str]:
        """The models hosted by the same workers as ``models`` (:mod:`actors.worker.device_worker`)."""
        hosts = {self.hosts[m] for m in models} - {None}
        return {m for m, host in self.hosts.items() if host in hosts}

    def place(self, work: list[tuple[RequestState, list]]) -> dict[str, list[list[Placed]]]:
        """Group needs into per-model item lists for phase 0 (proposers) and phase 1 (verifiers
        and everything on a model no one waits for)."""
        verifying = {need.model for _, needs in work for need in needs if isinstance(need, (ScoreVerify, ScoreBlock))}
        sources = {needs[need.draft_need].model for _, needs in work for need in needs
                   if isinstance(need, (ScoreVerify, ScoreBlock)) and need.draft_need >= 0}
        placed: dict[str, list[list[Placed]]] = {name: [[], []] for name in self.workers}
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
                slot_list.append(Placed(request, index, item, carried))
        return placed

    def call_workers(self, placed: dict[str, list[list[Placed]]]) -> dict[tuple[str, int], tuple[Any, list[Placed]]]:
        """Submit the step's calls: ``(model, phase) -> (outcomes ref, entries)``. Models with a worker
        of their own get one call per phase; models hosted together (:mod:`actors.worker.device_worker`) get
        one call per host, their proposers first, when every proposal the host verifies this step is
        its own (else one call per phase). Calls that others read go out first."""
        calls: dict[tuple[str, int], tuple[Any, list[Placed]]] = {}
        payload_refs: dict[str, Any] = {}
        rows_refs: dict[str, Any] = {}  # model -> its take_rows ref (rows over RDT)
        held = self.rows_over_rdt(placed)
        self.rows_calls, self.read_from = set(), {}
        hosts = self.hosted(placed)
        whole = {host for host, models in hosts.items() if self.host_self_contained(models, placed)}
        for model, (phase0, _) in placed.items():
            if phase0 and self.hosts[model] is None:
                if model in held:
                    outcomes_ref, payloads_ref, rows_refs[model] = self.call_holding(model, [e.item for e in phase0])
                else:
                    outcomes_ref, payloads_ref = self.call(model, [e.item for e in phase0])
                calls[(model, 0)] = (outcomes_ref, phase0)
                payload_refs[model] = payloads_ref
        for host, models in hosts.items():
            phases = (0, 1) if host in whole else (0,)
            self.call_host(models, [(m, p) for p in phases for m in models if placed[m][p]], placed, calls, payload_refs)
        for model, (_, phase1) in placed.items():
            if not phase1 or self.hosts[model] is not None:
                continue
            source_models = sorted({e.item.proposal_source[0] for e in phase1 if e.item.proposal_source})
            if source_models and not any(e.carried is not None for e in phase1):
                self.read_from[model] = source_models
            sources = [payload_refs[name] for name in source_models]  # refs nested: see ModelWorker.run_step
            index_of: dict[Any, int] = {name: i for i, name in enumerate(source_models)}
            items = [self.phase1_item(e, index_of, sources) for e in phase1]
            rows = [(i, rows_refs[name]) for i, name in enumerate(source_models) if name in rows_refs]
            if rows:
                self.rows_calls.add(model)
                outcomes_ref, payloads_ref = self.call_rows(model, items, sources, rows)
            else:
                outcomes_ref, payloads_ref = self.call(model, items, sources)
            calls[(model, 1)] = (outcomes_ref, phase1)
            for position, entry in enumerate(phase1):
                if isinstance(entry.item.need, PreDraft):  # the next step may verify one of its chains
                    entry.request.pre_drafted = (payloads_ref, position)
        for host, models in hosts.items():
            if host not in whole:
                self.call_host(models, [(m, 1) for m in models if placed[m][1]], placed, calls, payload_refs)
        for model, ids in self.releases.items():
            if ids and not any(key[0] == model for key in calls):
                calls[(model, 0)] = (self.call(model, [])[0], [])
        return calls

    def hosted(self, placed: dict[str, list[list[Placed]]]) -> dict[str, list[str]]:
        """host id -> its models with work this step (in the order of ``placed``)."""
        hosts: dict[str, list[str]] = {}
        for model, phases in placed.items():
            host = self.hosts[model]
            if host is not None and (phases[0] or phases[1]):
                hosts.setdefault(host, []).append(model)
        return hosts

    def host_self_contained(self, models: list[str], placed: dict[str, list[list[Placed]]]) -> bool:
        """Whether every proposal the host's models verify this step comes from the same host, and
        no other worker reads one of its proposals (that worker would wait for the whole call's
        end, the host's verification included, instead of the proposal's: the drafted ensemble's
        members on workers of their own)."""
        host = self.hosts[models[0]]
        reads = [(m, e.item.proposal_source[0]) for m, phases in placed.items() for e in phases[1]
                 if e.item.proposal_source]
        return all(self.hosts[source] == host for m, source in reads if self.hosts[m] == host) and \
            not any(self.hosts[source] == host and self.hosts[m] != host for m, source in reads)

    def call_host(self, models: list[str], parts: list[tuple[str, int]], placed: dict[str, list[list[Placed]]],
                   calls: dict[tuple[str, int], tuple[Any, list[Placed]]], payload_refs: dict[str, Any]) -> None:
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
            items = [self.host_item(e, local_index, payload_refs, sources, external, index_of) for e in entries]
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
    def host_item(entry: Placed, local_index: dict[str, int], payload_refs: dict[str, Any],
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
    def phase1_item(entry: Placed, index_of: dict[Any, int], sources: list[Any]) -> WorkItem:
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

    def rows_over_rdt(self, placed: dict[str, list[list[Placed]]]) -> set[str]:
        """The models whose phase-0 rows go over RDT this step: workers of their own whose proposals
        only other workers of their own read (a host reads a payload whole, in its process)."""
        if not self.transport.active:
            return set()
        reads = {(e.item.proposal_source[0], m) for m, (_, phase1) in placed.items() for e in phase1
                 if e.item.proposal_source is not None and e.carried is None}
        sources = {source for source, _ in reads if self.hosts[source] is None}
        return sources - {source for source, m in reads if self.hosts[m] is not None or m == source}

    def call_holding(self, model: str, items: list[WorkItem]) -> tuple[Any, Any, Any]:
        """``model``'s phase-0 call holding its rows back, and the ``take_rows`` call that hands them
        over RDT: (outcomes ref, payloads ref, rows ref)."""
        releases, self.releases[model] = self.releases[model], []
        key, worker = self.transport.key(), self.workers[model]
        outcomes_ref, payloads_ref = worker.run_step_holding.options(num_returns=2).remote(
            items, key, self.transport.rows_device, releases)
        rows_ref = worker.take_rows.options(tensor_transport=self.transport.backend).remote(key)
        self.transport.counters.moved += 1
        return outcomes_ref, payloads_ref, rows_ref

    def call_rows(self, model: str, items: list[WorkItem], sources: list[Any], rows: list[tuple[int, Any]]) -> tuple[Any, Any]:
        """``model``'s call reading ``rows`` (source index, take_rows ref) as top-level arguments."""
        releases, self.releases[model] = self.releases[model], []
        call = self.workers[model].run_step_rows.options(num_returns=2)
        return call.remote(items, list(sources), releases, [i for i, _ in rows], *[ref for _, ref in rows])

    def call(self, model: str, items: list[WorkItem], sources: list[Any] = ()) -> tuple[Any, Any]:
        releases, self.releases[model] = self.releases[model], []
        call = self.workers[model].run_step.options(num_returns=2)
        return call.remote(items, source_payloads=list(sources), releases=releases)


def actor_id(handle: Any) -> str | None:
    """The hex id of the Ray actor behind ``handle`` (None: not a Ray actor)."""
    actor = getattr(handle, "_actor_id", None)
    return None if actor is None else actor.hex()


def call_report(model: str, entries: list[Placed], outcomes: list[ItemOutcome]) -> CallReport:
    """What one worker call of a step ran (for :class:`actors.coordination.step_costs.StepCostModel`)."""
    timings = [outcome.timing for outcome in outcomes if outcome.timing is not None]
    forwards = [timing.forward_calls for timing in timings]
    # Steps that prefill a prompt are left out; items with different forward counts give the
    # call's mean tokens per forward.
    uniform = len(timings) == len(entries) and min(forwards, default=0) > 0 and all(
        entry.item.open is None for entry in entries)
    return CallReport(model=model, tokens_fed=sum(timing.tokens_fed for timing in timings),
                      forwards=max(forwards, default=0), forward_s=max((t.forward_s for t in timings), default=0.0),
                      uniform=uniform, call_s=max((t.call_s for t in timings), default=0.0),
                      first_round_s=max((t.first_round_s for t in timings), default=0.0))
