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
EOS token or fails, or ``budget_s`` has passed. An ``ar`` burst makes no hop between iterations.

The scheduler replays every record through ITS machine as a step of one request (``needs()``
must equal the record's, then the record's outcomes go the usual way: ``consume``, output, stop
strings, metrics), so the coordinator's machine stays the one truth and a divergence is caught.
Every need is executed by the same engine code, with the same sessions and random streams, in
the same order as step by step: a seeded request's tokens are the same with bursts on or off
(``tests/actors/test_bursts.py``). ``gamma: "auto"`` with measured step costs reads the costs
frozen when the burst starts (:class:`FrozenStepCosts`), in the worker's copy and in the replay.

Only machines whose needs are a Sample on the target, or a Sample on the draft and a
ScoreVerify on the target, burst (``ar``, ``sd``, ``multi_draft`` without pre-drafting):
:func:`burstable`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from actors.messages import UNAVAILABLE, ItemOutcome, WorkItem
from verifiers.adaptive import StepCosts
from verifiers.machines import AutoregressiveMachine, DecodeMachine, Need, Sample, ScoreVerify, SpeculativeMachine

logger = logging.getLogger(__name__)

#: A burst never runs more iterations than this, whatever its time budget.
MAX_BURST_ITERATIONS = 64

#: ``(model, items) -> (outcomes, payloads)``: one call on another model's worker.
PeerStep = Callable[[str, list[WorkItem]], tuple[list[ItemOutcome], list[Any]]]
#: ``(items, source payload lists) -> (outcomes, payloads)``: one call of this worker's engine.
LocalStep = Callable[[list[WorkItem], list[Any]], tuple[list[ItemOutcome], list[Any]]]


@dataclass(frozen=True)
class BurstRecord:
    """One iteration of a burst: the needs the worker's copy of the machine returned, their
    outcomes (aligned), and the iteration's wall time in the worker."""

    needs: tuple[Need, ...]
    outcomes: tuple[ItemOutcome, ...]
    wall_s: float


class FrozenStepCosts:
    """A picklable stand-in for a machine's ``step_costs`` callable: the costs measured when the
    burst started (the choice stays a function of what was fixed before each block is drafted)."""

    def __init__(self, costs: StepCosts | None):
        self.costs = costs

    def __call__(self) -> StepCosts | None:
        return self.costs


def burstable(machine: DecodeMachine) -> bool:
    """Whether ``machine``'s needs are always a Sample on its target, or a Sample on the draft
    and a ScoreVerify on the target (``ar``; ``sd`` / ``multi_draft`` without pre-drafting)."""
    if isinstance(machine, AutoregressiveMachine):
        return True
    return isinstance(machine, SpeculativeMachine) and not machine.pre_drafting


def run_burst(machine: DecodeMachine, session_id: str, local_model: str, local_step: LocalStep,
              peer_step: PeerStep, *, eos_token_ids: Sequence[int] = (), budget_s: float,
              max_iterations: int = MAX_BURST_ITERATIONS) -> Iterator[BurstRecord]:
    """Drive ``machine`` (a copy: this consumes its outcomes) iteration after iteration; yield
    each one's :class:`BurstRecord`. Stops after the iteration that finishes the machine, emits
    one of ``eos_token_ids``, fails, or ends past ``budget_s`` seconds (or ``max_iterations``)."""
    eos = frozenset(int(t) for t in eos_token_ids)
    started = time.perf_counter()
    for _ in range(max_iterations):
        iteration_started = time.perf_counter()
        needs = machine.needs()
        outcomes = execute_needs(needs, session_id, local_model, local_step, peer_step)
        record = BurstRecord(tuple(needs), tuple(outcomes), time.perf_counter() - iteration_started)
        tokens: list[int] = []
        failed = any(outcome.error is not None for outcome in outcomes)
        if not failed:
            try:
                tokens = machine.consume([outcome.value for outcome in outcomes])
            except Exception:  # noqa: BLE001 - the scheduler's replay raises it again and ends the request
                failed = True
        yield record
        if failed or machine.done or eos.intersection(tokens) or time.perf_counter() - started >= budget_s:
            return


def execute_needs(needs: Sequence[Need], session_id: str, local_model: str, local_step: LocalStep,
                  peer_step: PeerStep) -> list[ItemOutcome]:
    """One iteration of one request: the needs on other models first (one call per model), then
    the local model's, each ScoreVerify reading its proposal from those calls' payloads. Outcomes
    aligned with ``needs``; a peer that cannot be reached fails its needs (retryable)."""
    outcomes: list[ItemOutcome | None] = [None] * len(needs)
    remote: dict[str, list[int]] = {}
    for index, need in enumerate(needs):
        if need.model != local_model:
            remote.setdefault(need.model, []).append(index)
    sources: list[Any] = []  # per peer call, its payload list
    where: dict[int, tuple[int, int]] = {}  # need index -> (source, position) of its payload
    for model, indices in remote.items():
        items = [WorkItem(session_id, needs[i]) for i in indices]
        try:
            peer_outcomes, payloads = peer_step(model, items)
        except Exception as error:  # noqa: BLE001 - the peer died: its needs fail, retryable
            logger.error("burst: %s step failed (%s)", model, type(error).__name__)
            failed = ItemOutcome(error=UNAVAILABLE.format(model=model), retryable=True)
            peer_outcomes, payloads = [failed] * len(items), [failed] * len(items)
        for position, (index, outcome) in enumerate(zip(indices, peer_outcomes)):
            outcomes[index] = outcome
            where[index] = (len(sources), position)
        sources.append(list(payloads))
    local = [i for i, need in enumerate(needs) if need.model == local_model]
    if local:
        items = [_local_item(session_id, needs[i], where) for i in local]
        local_outcomes, _ = local_step(items, sources)
        for index, outcome in zip(local, local_outcomes):
            outcomes[index] = outcome
    return outcomes  # type: ignore[return-value]


def _local_item(session_id: str, need: Need, where: dict[int, tuple[int, int]]) -> WorkItem:
    if isinstance(need, ScoreVerify):
        return WorkItem(session_id, need, proposal_source=where[need.draft_need])
    if not isinstance(need, Sample):
        raise TypeError(f"a burst runs Sample and ScoreVerify needs only, got {type(need).__name__}")
    return WorkItem(session_id, need)
