"""Solo bursts: several iterations of one request in ONE call to its target's worker.

When exactly one request is running and none waits, a scheduler step is mostly the hops around
the model: the coordinator's call to the draft, the draft's payload relayed to the target, the
target's outcome back, the coordinator's own Python between steps; the workers idle meanwhile.
A *burst* (``engine.burst_ms``) moves the iterations of that one request into its target's
worker for a bounded time: the scheduler sends the request's machine (:mod:`verifiers.machines`,
pickled: the same I/O-free machine, a copy) to the target worker, which runs

    needs = machine.needs() -> the draft's needs as ONE direct call to the draft's worker
    (``ModelWorker.run_step``), the target's own needs in its engine with the draft's payloads
    -> machine.consume(outcomes)

iteration after iteration, streaming each one's needs and outcomes back (a :class:`BurstRecord`
per iteration, over a Ray streaming generator), until the machine is done, an iteration emits an
EOS token or fails, ``budget_s`` has passed, or the scheduler told it to stop. An ``ar`` burst
makes no hop between iterations.
A request's first burst may open its sessions (``opens``): each model's first need in the burst
carries that model's :class:`~actors.messages.OpenSession` (its prompt's prefill is the need's
first row, as in a step), so a lone request runs from its prompt to its end in bursts, with no
scheduler step before them; each record names the models whose session its iteration opened.

The scheduler replays every record through ITS machine as a step of one request (``needs()``
must equal the record's, then the record's outcomes go the usual way: ``consume``, output, stop
strings, metrics), so the coordinator's machine stays the one truth and a divergence is caught.
Every need is executed by the same engine code, with the same sessions and random streams, in
the same order as step by step: a seeded request's tokens are the same with bursts on or off
(``tests/actors/worker/test_bursts.py``). ``gamma: "auto"`` with measured step costs reads the costs
frozen when the burst starts (:class:`FrozenStepCosts`), in the worker's copy and in the replay.

The stop signal: when another request arrives (or the bursting request is cancelled, its
client gone, or its stop string met) the scheduler calls the worker's ``stop_burst(burst_id)``,
which runs in its own Ray concurrency group (:data:`BURST_CONTROL_GROUP`) beside the busy burst
call and marks the burst in the worker's :class:`BurstStops`; the burst ends after its current
iteration (with its next iteration's draft calls already submitted, after that one: they are
consumed, never dropped, so every session stays where the replay expects it). The budget can
then be long (one call per request) without a newcomer waiting for it.

With pre-drafting (``engine.pre_drafting``) an iteration's PreDraft is sent to the draft's
worker right after its Sample and runs there while the target verifies here; the next iteration
verifies a pre-drafted chain from that call's payloads, so the draft's forwards leave the
critical path as in step-by-step scheduling (each record carries the PreDraft payloads' ref, so a
later step or burst reads them the same way). Only ``ar``, ``sd`` and ``multi_draft`` burst
(:func:`burstable`); the ensembles' members are peers of equal rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from actors.messages import UNAVAILABLE, FailedSource, ItemOutcome, OpenSession, WorkItem
from verifiers.adaptive import StepCosts
from verifiers.machines.autoregressive import AutoregressiveMachine
from verifiers.machines.base import DecodeMachine
from verifiers.machines.needs import MODEL_FREE, PRE_DRAFTED, Need, PreDraft, Sample, ScoreVerify
from verifiers.machines.speculative import SpeculativeMachine

logger = logging.getLogger(__name__)

#: A burst never runs more iterations than this, whatever its time budget.
MAX_BURST_ITERATIONS = 64

#: The Ray concurrency group of a worker's ``stop_burst``: it runs while the burst's call is busy.
BURST_CONTROL_GROUP = "burst_control"

#: The Ray concurrency group of a worker's read-only probes (``metrics``, ``num_sessions``) when
#: ``/v1/status`` and ``/metrics`` ask: they answer while a burst (up to ``engine.burst_ms``) or a
#: step is busy, instead of waiting for it. ``/health`` keeps the default group: it proves the
#: worker's own call loop answers.
PROBE_GROUP = "probes"

#: ``(model, items) -> (outcomes ref, payloads ref)``: submit one call on another model's worker.
PeerSubmit = Callable[[str, list[WorkItem]], tuple[Any, Any]]
#: ``refs -> values``: wait for calls' returns (Ray ObjectRefs, or resolved in-process futures).
Fetch = Callable[[Sequence[Any]], list[Any]]
#: ``(items, source payload lists) -> (outcomes, payloads)``: one call of this worker's engine.
LocalStep = Callable[[list[WorkItem], list[Any]], tuple[list[ItemOutcome], list[Any]]]


@dataclass(frozen=True)
class BurstRecord:
    """One iteration of a burst: the needs the worker's copy of the machine returned, their
    outcomes (aligned), and the iteration's wall time in the worker."""

    needs: tuple[Need, ...]
    outcomes: tuple[ItemOutcome, ...]
    wall_s: float
    #: With a PreDraft need: (the ref of its call's payloads, its position there), as the
    #: scheduler keeps it for the next iteration's ScoreVerify of a pre-drafted chain.
    pre_drafted: tuple[Any, int] | None = None
    #: The models whose session this iteration opened (their first need carried the OpenSession).
    opened: tuple[str, ...] = ()


class BurstStops:
    """The bursts a worker was told to stop (by id), thread-safe: ``stop`` runs in the control
    group's thread while the burst reads ``stopped`` between iterations. A stop may arrive before
    its burst starts (the two calls run in different threads) or after it ended; the ids of ended
    bursts are dropped, and at most ``keep`` stray ones are kept."""

    def __init__(self, keep: int = 256):
        self.keep = keep
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def stop(self, burst_id: str) -> None:
        with self._lock:
            self._ids[burst_id] = None
            while len(self._ids) > self.keep:
                self._ids.popitem(last=False)

    def stopped(self, burst_id: str | None) -> bool:
        return burst_id is not None and burst_id in self._ids

    def ended(self, burst_id: str | None) -> None:
        with self._lock:
            self._ids.pop(burst_id, None)


class FrozenStepCosts:
    """A picklable stand-in for a machine's ``step_costs`` callable: the costs measured when the
    burst started (the choice stays a function of what was fixed before each block is drafted)."""

    def __init__(self, costs: StepCosts | None):
        self.costs = costs

    def __call__(self) -> StepCosts | None:
        return self.costs


def burstable(machine: DecodeMachine) -> bool:
    """Whether ``machine``'s needs are Samples, a ScoreVerify on its target and PreDrafts only
    (``ar``, ``sd``, ``multi_draft``; not the ensembles, whose members are peers of equal rank)."""
    if isinstance(machine, SpeculativeMachine):
        return machine.target_verifies  # an ensemble target's members are peers too
    return isinstance(machine, AutoregressiveMachine)


def run_burst(machine: DecodeMachine, session_id: str, local_model: str, local_step: LocalStep,
              peer_submit: PeerSubmit, fetch: Fetch, *, eos_token_ids: Sequence[int] = (), budget_s: float,
              pre_drafted: tuple[Any, int] | None = None, opens: Mapping[str, OpenSession] | None = None,
              ahead: bool = True, max_iterations: int = MAX_BURST_ITERATIONS,
              stop: Callable[[], bool] | None = None) -> Iterator[BurstRecord]:
    """Drive ``machine`` (a copy: this consumes its outcomes) iteration after iteration; yield
    each one's :class:`BurstRecord`. Stops after the iteration that finishes the machine, emits
    one of ``eos_token_ids``, fails, or ends past ``budget_s`` seconds (or ``max_iterations``),
    or once ``stop()`` is true (the scheduler's stop signal, read after each iteration).
    ``pre_drafted``: where the chains of the request's last PreDraft are, when the first
    iteration verifies one. ``opens``: model -> how to open the request's session there, for
    the models whose session is not open yet (each opens with the model's first need).
    ``ahead``: submit the next iteration's peer calls before the record goes out (peers in other
    processes work while it streams); False where every peer runs in this process, where a
    submitted call runs at once and would only hold the record back."""
    eos = frozenset(int(t) for t in eos_token_ids)
    unopened = dict(opens or {})

    def begin_iteration() -> tuple[float, list[Need], dict[str, OpenSession], PeerCalls]:
        """The next iteration's start time, needs, the sessions it opens, and its submitted peer calls."""
        began = time.perf_counter()
        needs = machine.needs()
        opening = _take_opens(needs, unopened)
        return began, needs, opening, submit_peer_calls(needs, session_id, local_model, peer_submit, opening)

    iteration_started, needs, opening, calls = begin_iteration()
    started = iteration_started
    for iteration in range(max_iterations):
        outcomes, drafted_ahead = finish_needs(needs, calls, session_id, local_model, local_step, fetch, pre_drafted,
                                               opening.get(local_model))
        pre_drafted = drafted_ahead or pre_drafted
        record = BurstRecord(tuple(needs), tuple(outcomes), time.perf_counter() - iteration_started, drafted_ahead,
                             tuple(opening))
        tokens: list[int] = []
        failed = any(outcome.error is not None for outcome in outcomes)
        if not failed:
            try:
                tokens = machine.consume([outcome.value for outcome in outcomes])
            except Exception:  # noqa: BLE001 - the scheduler's replay raises it again and ends the request
                failed = True
        last = (failed or machine.done or bool(eos.intersection(tokens)) or iteration + 1 == max_iterations
                or time.perf_counter() - started >= budget_s or (stop is not None and stop()))
        if not last and ahead:
            # The next iteration's peer calls go out before this record does: the draft drafts
            # while the record is serialized and streamed (they are the calls the next iteration
            # makes anyway, in the same order: the generator is only closed early when the
            # request ends, and then its sessions are released).
            iteration_started, needs, opening, calls = begin_iteration()
        yield record
        if last:
            return
        if not ahead:
            iteration_started, needs, opening, calls = begin_iteration()


def _take_opens(needs: Sequence[Need], unopened: dict[str, OpenSession]) -> dict[str, OpenSession]:
    """The sessions this iteration opens (taken from ``unopened``): those of its needs' models."""
    return {model: unopened.pop(model) for model in dict.fromkeys(need.model for need in needs) if model in unopened}


@dataclass(frozen=True)
class PeerCalls:
    """One iteration's calls on other models' workers, submitted: the calls its local needs wait
    for (``first``) and its PreDrafts (``ahead``), each as ``model -> (need indices, refs)``."""

    first: dict[str, tuple[list[int], tuple[Any, Any]]]
    ahead: dict[str, tuple[list[int], tuple[Any, Any]]]


def submit_peer_calls(needs: Sequence[Need], session_id: str, local_model: str, peer_submit: PeerSubmit,
                      opens: Mapping[str, OpenSession] | None = None) -> PeerCalls:
    """Submit one iteration's needs on other models (one call per model), the PreDrafts last: each
    queues right behind its worker's first call (a worker runs its calls in order). ``opens``: the
    sessions to open, each with its model's first item."""
    first, ahead = _peer_calls(needs, local_model)
    unopened = dict(opens or {})

    def submit(indices_by_model: dict[str, list[int]]) -> dict[str, tuple[list[int], tuple[Any, Any]]]:
        return {model: (indices, peer_submit(model, [WorkItem(session_id, needs[i], open=unopened.pop(model, None)
                                                              if position == 0 else None)
                                                     for position, i in enumerate(indices)]))
                for model, indices in indices_by_model.items()}

    return PeerCalls(submit(first), submit(ahead))  # in this order


def finish_needs(needs: Sequence[Need], calls: PeerCalls, session_id: str, local_model: str, local_step: LocalStep,
                 fetch: Fetch, pre_drafted: tuple[Any, int] | None = None, local_open: OpenSession | None = None,
                 ) -> tuple[list[ItemOutcome], tuple[Any, int] | None]:
    """The rest of one iteration whose peer ``calls`` were submitted: the first calls awaited (the
    local ScoreVerify reads their payloads), the local needs run here while the PreDrafts run
    there, and the PreDrafts awaited. Returns the outcomes aligned with ``needs`` (a peer that
    cannot be reached fails its needs, retryable) and, with a PreDraft, where its payloads are.
    ``local_open``: the local model's session to open, with its first item."""
    outcomes: list[ItemOutcome | None] = [None] * len(needs)
    sources: list[Any] = []  # per source, a payload list
    where: dict[int, tuple[int, int]] = {}  # need index -> (source, position) of its payload
    for model, (indices, refs) in calls.first.items():
        _place_results(indices, _await_peer(model, refs, fetch, len(indices)), outcomes, where, sources)
    local = [i for i, need in enumerate(needs) if need.model == local_model]
    if local:
        items = [_local_item(session_id, needs[i], where, sources, pre_drafted, fetch) for i in local]
        if local_open is not None:
            items[0] = replace(items[0], open=local_open)
        local_outcomes, _ = local_step(items, sources)
        for index, outcome in zip(local, local_outcomes):
            outcomes[index] = outcome
    drafted_ahead = None
    for model, (indices, refs) in calls.ahead.items():
        peer_outcomes, _ = _await_peer(model, refs, fetch, len(indices))
        for position, index in enumerate(indices):
            outcomes[index] = peer_outcomes[position]
            drafted_ahead = (refs[1], position)
    return outcomes, drafted_ahead  # type: ignore[return-value]


def _peer_calls(needs: Sequence[Need], local_model: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Indices of the needs on other models, per model: those the local needs wait for, and the
    PreDrafts, which run while the local needs do."""
    first: dict[str, list[int]] = {}
    ahead: dict[str, list[int]] = {}
    for index, need in enumerate(needs):
        if need.model != local_model:
            (ahead if isinstance(need, PreDraft) else first).setdefault(need.model, []).append(index)
    return first, ahead


def _await_peer(model: str, refs: tuple[Any, Any], fetch: Fetch, count: int) -> tuple[list[ItemOutcome], list[Any]]:
    """A peer call's (outcomes, payloads); every item failed (retryable) when it cannot be read."""
    try:
        outcomes, payloads = fetch(refs)
        return list(outcomes), list(payloads)
    except Exception as error:  # noqa: BLE001 - the peer died: its needs fail, retryable
        logger.error("burst: the call on %s failed (%s)", model, type(error).__name__)
        failed = ItemOutcome(error=UNAVAILABLE.format(model=model), retryable=True)
        return [failed] * count, [failed] * count


def _place_results(indices: list[int], results: tuple[list[ItemOutcome], list[Any]], outcomes: list,
                   where: dict[int, tuple[int, int]], sources: list[Any]) -> None:
    peer_outcomes, payloads = results
    for position, index in enumerate(indices):
        outcomes[index] = peer_outcomes[position]
        where[index] = (len(sources), position)
    sources.append(payloads)


def _local_item(session_id: str, need: Need, where: dict[int, tuple[int, int]], sources: list[Any],
                pre_drafted: tuple[Any, int] | None, fetch: Fetch) -> WorkItem:
    """The local need as a work item; a ScoreVerify says where its proposal is (a pre-drafted
    chain: the payloads of the request's last PreDraft, fetched and added to ``sources``)."""
    if isinstance(need, ScoreVerify) and need.draft_need == PRE_DRAFTED:
        if pre_drafted is None:
            raise RuntimeError("a pre-drafted block to verify, but no PreDraft ran")
        payloads_ref, position = pre_drafted
        try:
            (payloads,) = fetch([payloads_ref])
        except Exception as error:  # noqa: BLE001 - the engine reports a lost proposal (retryable)
            payloads = FailedSource(type(error).__name__)
        sources.append(payloads)
        return WorkItem(session_id, need, proposal_source=(len(sources) - 1, position))
    if isinstance(need, ScoreVerify) and need.draft_need == MODEL_FREE:  # the block travels in the need
        return WorkItem(session_id, need)
    if isinstance(need, ScoreVerify):
        return WorkItem(session_id, need, proposal_source=where[need.draft_need])
    if not isinstance(need, Sample):
        raise TypeError(f"a burst runs Sample, ScoreVerify and PreDraft needs only, got {type(need).__name__}")
    return WorkItem(session_id, need)
