"""What a step costs, measured: the numbers behind ``gamma: "auto"``'s goodput choice.

The scheduler reports every step it runs (:meth:`StepCostModel.observe_step`): per model worker
call, the tokens it fed, its forwards and their seconds, and the step's wall time. From them the
model keeps

* per model, the seconds of one forward by the tokens it runs, with the worker's own work around
  it (sampling, verification, row building; a :class:`CostTable`: the median of recent
  observations per bucket of token counts, interpolated between buckets; forwards of steps that
  opened a session, i.e. prefilled a prompt, are left out): a call's first forward round
  (:attr:`StepCostModel.forwards`) apart from each further round of a call of several
  (:attr:`StepCostModel.later_forwards`, a draft's block). A call pays its first round once
  (the call's set-up, the tokens the last verification accepted, caches the other model's
  forwards evicted: served on this CPU ~1.4x a further round); spread over the block's rounds,
  that cost read as a per-token one, larger the shorter the blocks measured, so that blocks
  chosen short made long ones look dear;
* per kind of step (speculative: a draft call then a verifying call; plain: the target alone),
  the seconds a step pays besides its worker calls (hops, the scheduler's own work), by the
  number of requests in the step.

:class:`ModeRates` keeps the tokens per second that whole steps of several gamma-auto requests
reached, plain and speculative, by the number of requests: the scheduler steps such a cohort in
the mode that measured faster (each step's mode is decided for all its requests at once).

:class:`AcceptanceBoard` keeps, per draft / target / rule, the per-token acceptance the group's
requests met recently: a new ``gamma: "auto"`` request starts from it instead of the settings'
fixed prior (a short request otherwise spends its first iterations learning what every request
of the pair already showed).

:meth:`StepCostModel.costs` turns them into the :class:`verifiers.adaptive.StepCosts` of a step
of ``batch`` requests, which the speculative machines weigh before each draft
(:func:`verifiers.adaptive.best_block`). Nothing here changes what is sampled: the choice is made
before the draft (see :mod:`verifiers.adaptive` for why any such choice is lossless).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from verifiers.adaptive import StepCosts

#: Bucket edges of token / request counts (a count falls in the bucket of the largest edge <= it).
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096)

#: Whole steps a :class:`ModeRates` bucket keeps (its most recent); it reads as their median.
MODE_WINDOW = 7

#: Observations a :class:`CostTable` bucket keeps (its most recent); the bucket reads as their
#: median. A forward that the machine's other work delayed (a preempted process: several times
#: its usual seconds) moves a median not at all, where it moved a running mean for many steps;
#: and a table's buckets are read through a monotone envelope, so one inflated bucket raised
#: every larger count's cost with it.
WINDOW = 15

#: A bucket with fewer observations is read only while no bucket has this many (a count seen
#: once, e.g. a request's last, shorter block, would otherwise stand on one timing).
MIN_OBSERVATIONS = 3

#: Outside the measured range a forward is scaled as a fixed cost of this many token positions
#: plus one per token (the CPU value of ``actors.model.backends.FORWARD_OVERHEAD_TOKENS``).
EXTRAPOLATION_OVERHEAD_TOKENS = 8


def _bucket(count: float) -> int:
    """The bucket of a count: the largest edge of :data:`BUCKETS` at or below it."""
    return BUCKETS[max(0, bisect.bisect_right(BUCKETS, count) - 1)]


@dataclass
class CostTable:
    """Seconds by a count (tokens of a forward, requests of a step): per bucket the median of its
    recent observations (:data:`WINDOW`), linear interpolation between the measured buckets,
    proportional scaling outside them."""

    samples: dict[int, deque] = field(default_factory=dict)  # bucket -> recent (count, seconds)
    _points: list[tuple[float, float]] | None = field(default=None, repr=False)  # cached, by count

    def observe(self, count: float, seconds: float) -> None:
        if count <= 0 or seconds < 0:
            return
        self.samples.setdefault(_bucket(count), deque(maxlen=WINDOW)).append((float(count), float(seconds)))
        self._points = None

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    def points(self) -> list[tuple[float, float]]:
        """(count, seconds) per bucket read (see :data:`MIN_OBSERVATIONS`), by count, monotone."""
        if self._points is None:
            buckets = [kept for kept in self.samples.values() if len(kept) >= MIN_OBSERVATIONS]
            buckets = buckets or list(self.samples.values())
            medians = [(statistics.median(c for c, _ in kept), statistics.median(s for _, s in kept))
                       for kept in buckets]
            self._points = _monotone(sorted(medians))
        return self._points

    def estimate(self, count: float) -> float | None:
        """The seconds at ``count`` (None before any observation)."""
        if not self.samples:
            return None
        points = self.points()
        counts = [c for c, _ in points]
        i = bisect.bisect_left(counts, count)
        if i < len(points) and counts[i] == count:
            return points[i][1]
        if 0 < i < len(points):
            (c0, s0), (c1, s1) = points[i - 1], points[i]
            return s0 + (s1 - s0) * (count - c0) / (c1 - c0)
        nearest_count, nearest_seconds = points[0] if i == 0 else points[-1]
        scale = (count + EXTRAPOLATION_OVERHEAD_TOKENS) / (nearest_count + EXTRAPOLATION_OVERHEAD_TOKENS)
        return nearest_seconds * scale


def _monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points whose seconds never fall as the count grows (a noisy bucket below a smaller count's
    is raised to it: more work never looks cheaper) and never grow faster than the count (a bucket
    above the smaller count's seconds scaled by the counts' ratio is lowered to that: a forward of
    more tokens never costs more per token). The second bound keeps a bucket measured only on
    a slow start (the first forwards of a shape) from reading as a cliff that the choice then
    avoids, and so never measures again."""
    result: list[tuple[float, float]] = []
    for count, seconds in points:
        if result:
            previous_count, previous_seconds = result[-1]
            seconds = min(max(seconds, previous_seconds), previous_seconds * count / previous_count)
        result.append((count, seconds))
    return result


@dataclass(frozen=True)
class CallReport:
    """One worker call of a step, as the scheduler saw it."""

    model: str
    tokens_fed: int  # every item's tokens, summed
    forwards: int  # forwards the call ran (its items' most)
    forward_s: float  # seconds in those forwards
    uniform: bool  # every item ran as many forwards and none opened a session (clean per-forward figures)
    call_s: float = 0.0  # the whole call's seconds in the worker (>= forward_s; 0: use forward_s)
    first_round_s: float = 0.0  # the call's seconds to the end of its first forward round (0: not measured)


def _call_seconds(call: CallReport) -> float:
    """What a call costs per its forwards: the whole call in the worker (its forwards and the work
    that grows with them: per-position sampling, verification of longer blocks, row building).
    Charged to the forwards, that work scales with the block; left in the step's overhead, it read
    as a fixed cost per step (57 ms of a 16-request speculative step, served), and long blocks
    looked cheaper than they are."""
    return max(call.forward_s, call.call_s)


class StepCostModel:
    """Measured forward tables per model and per-step overheads (see the module doc)."""

    def __init__(self, plain_tokens: int):
        self.plain_tokens = int(plain_tokens)
        self.forwards: dict[str, CostTable] = {}  # per model: a call's first forward round
        self.later_forwards: dict[str, CostTable] = {}  # per model: each further round of a call
        self.speculative_overhead = CostTable()  # by requests in the step
        self.plain_overhead = CostTable()

    def observe_step(self, batch: int, calls: list[CallReport], wall_s: float, *, speculative: bool) -> None:
        """A finished step of ``batch`` requests: its worker calls and its wall time."""
        for call in calls:
            if call.uniform and call.forwards > 0 and call.tokens_fed > 0:
                self._observe_call(call)
        outside = max(0.0, wall_s - sum(_call_seconds(call) for call in calls))
        (self.speculative_overhead if speculative else self.plain_overhead).observe(batch, outside)

    def _observe_call(self, call: CallReport) -> None:
        """A call's first round into :attr:`forwards`, its further rounds' mean into
        :attr:`later_forwards`; without a measured first round, the call's seconds over its forwards
        into :attr:`forwards` (every round then costs the same)."""
        tokens, seconds = call.tokens_fed / call.forwards, _call_seconds(call)
        if call.forwards > 1 and 0.0 < call.first_round_s <= seconds:
            self.forwards.setdefault(call.model, CostTable()).observe(tokens, call.first_round_s)
            self.later_forwards.setdefault(call.model, CostTable()).observe(
                tokens, (seconds - call.first_round_s) / (call.forwards - 1))
        else:
            self.forwards.setdefault(call.model, CostTable()).observe(tokens, seconds / call.forwards)

    def costs(self, draft: str, target: str, *, batch: int, gamma_max: int, num_drafts: int = 1) -> StepCosts | None:
        """The costs of a step of ``batch`` requests drafting on ``draft`` (``num_drafts`` chains)
        and verifying on ``target``; None until both models' forwards and a speculative step
        have been measured."""
        draft_table, target_table = self.forwards.get(draft), self.forwards.get(target)
        if draft_table is None or target_table is None or not self.speculative_overhead.measured:
            return None
        overhead = self.speculative_overhead.estimate(batch)
        plain_overhead = self.plain_overhead.estimate(batch)
        if plain_overhead is None:  # no plain step yet: one worker call instead of two
            plain_overhead = overhead / 2
        draft_first = draft_table.estimate(batch * num_drafts)
        later_table = self.later_forwards.get(draft)
        return StepCosts(
            draft_s=later_table.estimate(batch * num_drafts) if later_table is not None else draft_first,
            draft_first_s=draft_first,
            verify_s=tuple(target_table.estimate(batch * (num_drafts * gamma + 1)) for gamma in range(1, gamma_max + 1)),
            overhead_s=overhead,
            plain_s=target_table.estimate(batch),
            plain_overhead_s=plain_overhead,
            plain_tokens=self.plain_tokens,
        )


#: Weight kept by the board's older observations per verification (about the last 50 count).
BOARD_DECAY = 0.98
#: Verifications the board needs for a pair before it offers a prior.
BOARD_MIN_VERIFICATIONS = 8
#: The board's prior is kept in this range (a request still learns its own rate from there).
BOARD_PRIOR_RANGE = (0.05, 0.98)
#: A request started from the board counts its rate as this many verifications seen (next to its
#: own decayed counts, about ``1 / (1 - decay)`` = 10 verifications): one request's few blocks
#: are noisy, and an estimate that dips low by chance would otherwise turn it to plain steps.
BOARD_PRIOR_VERIFICATIONS = 3.0


def board_prior_weight(alpha: float) -> float:
    """The prior weight (:class:`verifiers.adaptive.AdaptiveGammaSettings.prior_weight`, in
    accepted-position units) of :data:`BOARD_PRIOR_VERIFICATIONS` verifications at rate ``alpha``:
    ``k`` geometric verifications at rate ``alpha`` accept ``k alpha / (1 - alpha)`` positions
    and reject ``k`` times, i.e. a weight of ``k / (1 - alpha)``."""
    return BOARD_PRIOR_VERIFICATIONS / (1.0 - alpha)


@dataclass
class AcceptanceBoard:
    """Per key (draft, target, rule, drafts per step): per draft position, the decayed counts of
    the group's recent blocks that reached it and of those rejected there; :meth:`acceptance` is
    the ratio of accepted positions (reached, not rejected) to rejections over every position, the
    per-token acceptance rate (as :class:`verifiers.adaptive.AdaptiveGamma` estimates one
    request's). Read when a request is admitted, so it is fixed before the request's first
    draft and depends on other requests only: the choice it informs stays lossless."""

    #: key -> (reached, rejected): per draft position i (0-based), the decayed count of blocks that
    #: reached it and of those rejected there (a survival table of the accepted run, see
    #: :meth:`expected_tokens`).
    positions: dict[Hashable, tuple[list[float], list[float]]] = field(default_factory=dict)
    verifications: dict[Hashable, int] = field(default_factory=dict)  # key -> verifications seen

    def observe(self, key: Hashable, gamma: int, num_accepted: int) -> None:
        self.verifications[key] = self.verifications.get(key, 0) + 1
        reached, rejected_at = self.positions.setdefault(key, ([], []))
        if len(reached) < gamma:
            reached.extend([0.0] * (gamma - len(reached)))
            rejected_at.extend([0.0] * (gamma - len(rejected_at)))
        for i in range(len(reached)):
            reached[i] *= BOARD_DECAY
            rejected_at[i] *= BOARD_DECAY
        for i in range(min(num_accepted + 1, gamma)):  # positions 0 .. num_accepted were drafted and judged
            reached[i] += 1.0
        if num_accepted < gamma:
            rejected_at[num_accepted] += 1.0

    def expected_tokens(self, key: Hashable, gamma_max: int) -> tuple[float, ...] | None:
        """``E[tokens](g)`` for ``g = 1 .. gamma_max``: the tokens one iteration drafting ``g``
        emits, ``1 + sum_{i <= g} S(i)``, with ``S(i)`` the share of blocks whose first ``i`` drafts
        are all accepted, estimated position by position from the recent verifications (the
        Kaplan-Meier estimate of the accepted run's length; blocks shorter than a position leave
        it unjudged, not rejected). A position judged fewer than :data:`BOARD_MIN_VERIFICATIONS`
        times takes the pooled rate of :meth:`acceptance`. None until that rate exists.

        Why not ``(1 - alpha^(g+1)) / (1 - alpha)`` at the pooled rate: requests differ (code
        accepts more than prose), and at the pooled rate the geometric formula overstates long
        blocks: the requests that reach deep positions are the easy ones, whose rejections are
        rare, while the hard ones stop early. Served at 16 clients that formula chose blocks of
        6-7 where 4 was faster."""
        alpha = self.acceptance(key)
        if alpha is None:
            return None
        reached, rejected_at = self.positions.get(key, ([], []))
        survival, expected = 1.0, [1.0]
        for i in range(gamma_max):
            judged = reached[i] if i < len(reached) else 0.0
            keep = 1.0 - rejected_at[i] / judged if judged >= BOARD_MIN_VERIFICATIONS else alpha
            survival *= keep
            expected.append(expected[-1] + survival)
        return tuple(expected[1:])

    def acceptance(self, key: Hashable) -> float | None:
        """The recent per-token acceptance of ``key``; None until it has enough verifications."""
        reached, rejected_at = self.positions.get(key, ([], []))
        rejected = sum(rejected_at)
        accepted = sum(reached) - rejected
        if self.verifications.get(key, 0) < BOARD_MIN_VERIFICATIONS or accepted + rejected <= 0:
            return None
        low, high = BOARD_PRIOR_RANGE
        return min(high, max(low, accepted / (accepted + rejected)))



@dataclass
class ModeRates:
    """Tokens per second of whole steps by mode (``plain``, ``speculative``) and by requests in
    the step: per bucket the median of its last :data:`MODE_WINDOW` steps, read at the nearest
    measured bucket. A median, not a running mean: the mode a cohort avoids is measured only on
    its probes, and a running mean kept a slow first step (a server's first steps of a shape) for
    most of a run, so that mode went on looking slower than it was."""

    rates: dict[str, dict[int, deque]] = field(default_factory=dict)  # mode -> bucket -> recent rates

    def observe(self, mode: str, batch: int, tokens: int, seconds: float) -> None:
        if batch < 1 or seconds <= 0:
            return
        buckets = self.rates.setdefault(mode, {})
        buckets.setdefault(_bucket(batch), deque(maxlen=MODE_WINDOW)).append(tokens / seconds)

    def rate(self, mode: str, batch: int) -> float | None:
        """The measured rate of ``mode`` for a step of ``batch`` requests; None before any."""
        buckets = self.rates.get(mode)
        if not buckets:
            return None
        bucket = _bucket(batch)
        return statistics.median(buckets[min(buckets, key=lambda measured: (abs(measured - bucket), measured))])
