"""What the alternating ensemble's member calls cost, measured (``se``, proposer "alternate",
gamma "auto"): the seconds of a step whose call of member ``m`` draws ``g`` tokens.

Each step of such a cohort calls members (:class:`verifiers.machines.needs.Extend`): one forward
round that scores the queued segment and draws the first token, then one round per further token.
Per model, from the steps whose every need is an ``Extend``, this keeps by the number of items in
the call (:class:`actors.coordination.step_costs.CostTable`, medians of recent observations):

* the call's first round with its set-up (``first``),
* each further round (``later``); before a call of several rounds was measured, one forward's
  seconds (the first round's forward alone, without the call's set-up) stand for it,
* the step's seconds outside its calls (hops, the scheduler's own work; ``overhead``, by batch).

:class:`PooledRates` keeps the tokens per second of their whole steps by mode (plain ensemble
steps, proposals) as the tokens over the seconds of the recent steps pooled: a proposing step
commits 0, 1 or a segment's tokens, and the median of such steps' rates read 0 whenever four of
seven had committed nothing (a proposal into an empty queue, a prefill), so that cohorts turned to
plain steps where proposals were 1.4x faster.

A step of ``m`` drawing ``g`` tokens then costs ``overhead + first_m + (g - 1) * later_m``
(:meth:`AlternateCallCosts.member_call_s`), read by the machine through
:class:`verifiers.adaptive.StepCosts` ``member_call_s`` (:mod:`verifiers.alternate_gammas`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from actors.coordination.step_costs import CallReport, CostTable, _bucket, _call_seconds

#: Whole steps a :class:`PooledRates` bucket pools (its most recent).
POOLED_WINDOW = 24


@dataclass
class PooledRates:
    """Tokens per second of whole steps by mode and by requests in the step: per bucket the
    tokens over the seconds of its last :data:`POOLED_WINDOW` steps, read at the nearest measured
    bucket (see the module doc)."""

    steps: dict[str, dict[int, deque]] = field(default_factory=dict)  # mode -> bucket -> recent (tokens, seconds)

    def observe(self, mode: str, batch: int, tokens: int, seconds: float) -> None:
        if batch < 1 or seconds <= 0:
            return
        buckets = self.steps.setdefault(mode, {})
        buckets.setdefault(_bucket(batch), deque(maxlen=POOLED_WINDOW)).append((float(tokens), float(seconds)))

    def forget(self, mode: str, batch: int) -> None:
        """Drop what ``mode`` measured at ``batch``'s bucket (a probe measures afresh)."""
        self.steps.get(mode, {}).pop(_bucket(batch), None)

    def rate(self, mode: str, batch: int) -> float | None:
        """The measured rate of ``mode`` for a step of ``batch`` requests; None before any."""
        buckets = self.steps.get(mode)
        if not buckets:
            return None
        bucket = _bucket(batch)
        kept = buckets[min(buckets, key=lambda measured: (abs(measured - bucket), measured))]
        return sum(tokens for tokens, _ in kept) / max(sum(seconds for _, seconds in kept), 1e-12)


class AlternateCallCosts:
    """Measured member calls of the alternating ensembles (see the module doc)."""

    def __init__(self) -> None:
        self.first: dict[str, CostTable] = {}  # per model, by items in the call: first round with the set-up
        self.later: dict[str, CostTable] = {}  # per model: each further round
        self.forward: dict[str, CostTable] = {}  # per model: one forward alone (later's stand-in)
        self.overhead = CostTable()  # by requests in the step: seconds outside the calls

    def observe_step(self, batch: int, items: dict[str, int], calls: list[CallReport], wall_s: float) -> None:
        """A step of ``batch`` requests whose needs were all member calls; ``items[model]``: the
        call's items (requests it served)."""
        measured = [call for call in calls if call.uniform and call.forwards > 0]
        if len(measured) != len(calls):  # a call that opened a session (a prefill): not a clean figure
            return
        for call in measured:
            count = items.get(call.model, 1)
            seconds = _call_seconds(call)
            if call.forwards == 1:
                first = seconds
            else:
                first = call.first_round_s if 0.0 < call.first_round_s <= seconds else seconds / call.forwards
            self.first.setdefault(call.model, CostTable()).observe(count, first)
            self.forward.setdefault(call.model, CostTable()).observe(count, call.forward_s / call.forwards)
            if call.forwards > 1:
                self.later.setdefault(call.model, CostTable()).observe(count, (seconds - first) / (call.forwards - 1))
        self.overhead.observe(batch, max(0.0, wall_s - sum(_call_seconds(call) for call in calls)))

    def member_call_s(self, members: list[str], batch: int, gamma_max: int) -> dict[str, tuple[float, ...]]:
        """Per member, the seconds of a step of ``batch`` requests whose call of it draws ``g`` tokens,
        ``g`` in ``[1, gamma_max]``; empty until every member's call and a step were measured."""
        if not self.overhead.measured or any(name not in self.first for name in members):
            return {}
        overhead = self.overhead.estimate(batch) or 0.0
        costs: dict[str, tuple[float, ...]] = {}
        for name in members:
            first = self.first[name].estimate(batch) or 0.0
            later_table = self.later.get(name) or self.forward[name]
            later = later_table.estimate(batch) or 0.0
            costs[name] = tuple(overhead + first + (g - 1) * later for g in range(1, gamma_max + 1))
        return costs
