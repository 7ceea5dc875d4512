"""Adaptive draft length: each request picks gamma before each draft from its own acceptance.

Why it stays lossless. Every verification rule is exact for any FIXED block length: given the
context, one iteration's emitted block followed by the target's own sampling has the target's
law. A rule that chooses the next gamma from what already happened (the accepted lengths so
far), before the draft is sampled, fixes gamma given the past; conditioning on the past, the
iteration is one of the fixed-gamma iterations, so by induction over iterations the output law
is the target's. The exact-enumeration tests (``tests/verifiers/test_adaptive.py``) check it for
every lossless rule on tiny context-dependent models with histories that really change gamma,
including the stateful greedy rules.

Served, the block may also depend on the measured cost of a step at the current batch
(:class:`StepCosts`, from the scheduler's measurements): still fixed before the draft is sampled,
so the same induction holds whatever the choice reads outside the request (the
exact-enumeration tests drive it with an arbitrary outside schedule). With costs the choice
may be 0: no draft at all, the step samples plain tokens from the target (the target's own
law, trivially). Timings differ from run to run, so with costs a seeded request keeps its law
but not its tokens: batch invariance is promised for fixed gamma only.

The rule. Under the i.i.d. acceptance model (each draft token accepted with probability
``alpha`` given the previous ones were), one iteration with ``gamma`` drafts yields

    E[tokens](gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)

tokens (Fu et al. 2025, App. A.2, Eq. (12), with this project's block of ``gamma`` drafts plus
the target's own token; Leviathan et al. 2023 state the same) and costs ``gamma * c + 1``
iteration equivalents, ``c`` the time one more drafted token adds to an iteration relative to
the time of an iteration without drafts: the target's verification forward and whatever else
each iteration pays once (Ray hops, coordination). That is the cost coefficient of Fu et al.
2025, Sec. 3.2 (proposal over verifier call time) with the fixed per-iteration costs counted
on the verifier's side, where a served iteration pays them. The rule picks the gamma in
``[1, gamma_max]`` that maximises ``E[tokens](gamma) / (gamma * c + 1)`` at the current
estimate of ``alpha``: a Beta-prior estimate from decayed counts of accepted and rejected draft
positions (a block that stopped before its end counts one rejection).

With measured step costs (:func:`best_block`, the goodput rule of SmartSpec, Liu et al. 2024,
arXiv 2406.14066, Sec. 4: the block that maximises the batch's expected tokens per second of
the step) the rate of a block is ``E[tokens](gamma) / (draft_first_s + (gamma - 1) * draft_s +
verify_s(gamma) + overhead_s)`` (the draft call's first forward round, which pays the call's
fixed costs, then one further round per draft) and a plain step's is
``plain_tokens / (plain_tokens * plain_s + plain_overhead_s)``, every time taken at the current
batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ALPHA_CEILING = 1.0 - 1e-9  # E[tokens] is gamma + 1 at alpha = 1; keep the closed form finite


@dataclass(frozen=True)
class AdaptiveGammaSettings:
    """How ``gamma: "auto"`` chooses.

    gamma_max: the largest block it may draft. draft_cost_ratio: ``c``, the time one more
    drafted token adds to an iteration over the time of an iteration without drafts. prior_acceptance / prior_weight: the Beta prior on the
    per-token acceptance rate (mean, pseudo-count). decay: weight kept by older observations per
    iteration (1: all history counts equally)."""

    gamma_max: int
    draft_cost_ratio: float = 0.07
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.gamma_max, bool) or not isinstance(self.gamma_max, int) or self.gamma_max < 1:
            raise ValueError(f"gamma_max must be an int >= 1, got {self.gamma_max!r}")
        if not 0.0 <= self.draft_cost_ratio:
            raise ValueError(f"draft_cost_ratio must be >= 0, got {self.draft_cost_ratio!r}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {self.prior_acceptance!r}")
        if not self.prior_weight > 0.0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")


#: :attr:`StepCosts.mode` values.
STEP_MODES = ("any", "plain", "speculative")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted by one iteration of ``gamma`` drafts at per-token acceptance
    ``alpha`` (accepted prefix plus the target's token): ``sum_{i=0..gamma} alpha^i``."""
    alpha = min(max(alpha, 0.0), ALPHA_CEILING)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, gamma_max: int, draft_cost_ratio: float) -> int:
    """The gamma in ``[1, gamma_max]`` with the most expected tokens per unit of time
    ``E[tokens](gamma) / (gamma * c + 1)``; ties go to the shorter block."""
    best, best_rate = 1, -1.0
    for gamma in range(1, gamma_max + 1):
        rate = expected_tokens(alpha, gamma) / (gamma * draft_cost_ratio + 1.0)
        if rate > best_rate * (1.0 + 1e-12):
            best, best_rate = gamma, rate
    return best


@dataclass(frozen=True)
class StepCosts:
    """What a step costs at the current batch (seconds), as the scheduler measured it.

    draft_s: one further draft forward (every request's next draft token) with the worker's
    sampling around it; draft_first_s: the draft call's first forward round, which also pays what
    the call pays once (None: as draft_s), so a block of ``g`` drafts costs
    ``draft_first_s + (g - 1) * draft_s``. verify_s: the target's scoring forward with the
    verification, by block, ``verify_s[g]`` for a block of ``g`` drafts (``g + 1`` tokens per request), g in
    ``[1, gamma_max]``. overhead_s: what a speculative step pays once besides its worker calls
    (hops, coordination). plain_s: one plain target forward with its sampling (one token per
    request); plain_overhead_s: what a plain step pays once besides its worker call;
    plain_tokens: tokens a plain step samples per request (one forward each)."""

    draft_s: float
    verify_s: tuple[float, ...]
    overhead_s: float
    plain_s: float
    plain_overhead_s: float
    plain_tokens: int
    #: What the step's other requests do, decided for them all (``STEP_MODES``): ``any``, each
    #: request weighs the costs itself; ``plain``, a plain step unless a greedy modification is
    #: pending; ``speculative``, a block of at least one draft. A step whose requests split pays
    #: the draft's forwards AND the plain forwards, worse than either.
    mode: str = "any"
    #: With mode ``speculative``: the block every request of the step drafts (a step's draft call
    #: runs as many forwards as its longest block); 0: each request chooses its own.
    block: int = 0
    draft_first_s: float | None = None
    #: The alternating ensemble's calls (se, gamma "auto"): per member, the seconds of a step whose
    #: call of that member draws ``g`` tokens at ``[g - 1]`` (:mod:`verifiers.alternate_gammas`); empty: unmeasured.
    member_call_s: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in STEP_MODES:
            raise ValueError(f"StepCosts.mode must be one of {STEP_MODES}, got {self.mode!r}")
        if self.block < 0 or (self.block and self.mode != "speculative"):
            raise ValueError(f"StepCosts.block must be >= 0, and set only with mode speculative, got {self.block!r}")
        values = (self.draft_s, self.draft_seconds(1), *self.verify_s, self.overhead_s, self.plain_s,
                  self.plain_overhead_s)
        if any(not value >= 0.0 for value in values):
            raise ValueError(f"step costs must be >= 0 seconds, got {self}")
        if not self.verify_s:
            raise ValueError("StepCosts.verify_s must hold the cost of at least one block")
        if self.plain_tokens < 1:
            raise ValueError(f"StepCosts.plain_tokens must be >= 1, got {self.plain_tokens}")

    def draft_seconds(self, gamma: int) -> float:
        """The draft call of a block of ``gamma`` drafts: its first round, then ``gamma - 1`` more."""
        first = self.draft_s if self.draft_first_s is None else self.draft_first_s
        return first + (gamma - 1) * self.draft_s

    def speculative_rate(self, alpha: float, gamma: int, tokens: float | None = None) -> float:
        """Expected tokens per second of one request's speculative step with ``gamma`` drafts:
        ``tokens`` per iteration when given (a measured expectation), else the geometric
        expectation at per-token acceptance ``alpha``."""
        seconds = self.draft_seconds(gamma) + self.verify_s[gamma - 1] + self.overhead_s
        expected = expected_tokens(alpha, gamma) if tokens is None else tokens
        return expected / max(seconds, 1e-12)

    def plain_rate(self) -> float:
        """Tokens per second of one request's plain step."""
        seconds = self.plain_tokens * self.plain_s + self.plain_overhead_s
        return self.plain_tokens / max(seconds, 1e-12)


def best_block(alpha: float, gamma_max: int, costs: StepCosts, *, allow_plain: bool = True,
               tokens_by_block: tuple[float, ...] | None = None) -> int:
    """The block in ``[0, gamma_max]`` (0: a plain step, only when ``allow_plain``) with the most
    expected tokens per second of the step at ``costs``; ties go to the shorter block.
    ``tokens_by_block[g - 1]``: the tokens an iteration drafting ``g`` emits, when measured
    (:meth:`actors.coordination.step_costs.AcceptanceBoard.expected_tokens`); else the geometric expectation
    at ``alpha``."""
    best, best_rate = (0, costs.plain_rate()) if allow_plain else (1, -1.0)
    longest = min(gamma_max, len(costs.verify_s), len(tokens_by_block) if tokens_by_block else gamma_max)
    for gamma in range(1, longest + 1):
        rate = costs.speculative_rate(alpha, gamma, None if tokens_by_block is None else tokens_by_block[gamma - 1])
        if rate > best_rate * (1.0 + 1e-12):
            best, best_rate = gamma, rate
    return best


class AdaptiveGamma:
    """One request's gamma chooser: :meth:`choose` before each draft, :meth:`observe` after
    each verification (``num_accepted`` of the ``gamma`` drafted tokens were accepted)."""

    def __init__(self, settings: AdaptiveGammaSettings):
        self.settings = settings
        self.accepted = 0.0  # decayed count of accepted draft positions
        self.rejected = 0.0  # decayed count of rejected ones (at most one per iteration)

    @property
    def acceptance(self) -> float:
        """Posterior mean of the per-token acceptance rate."""
        s = self.settings
        return (self.accepted + s.prior_weight * s.prior_acceptance) / (self.accepted + self.rejected + s.prior_weight)

    def choose(self, costs: StepCosts | None = None, *, allow_plain: bool = True) -> int:
        """The next block: from the acceptance alone (in ``[1, gamma_max]``), or with measured
        step ``costs`` (in ``[0, gamma_max]``, 0 a plain step when ``allow_plain``)."""
        s = self.settings
        if costs is None:
            return best_gamma(self.acceptance, s.gamma_max, s.draft_cost_ratio)
        return best_block(self.acceptance, s.gamma_max, costs, allow_plain=allow_plain)

    def skip(self) -> None:
        """An iteration without a draft (a plain step): nothing observed, the counts age as every
        iteration ages them (:meth:`observe` too), so the prior regains weight. A request that took plain steps on an
        unluckily low estimate drifts back to its prior (the pair's recent rate when the
        scheduler set one) instead of keeping that estimate for as long as it stays plain."""
        decay = self.settings.decay
        self.accepted *= decay
        self.rejected *= decay

    def observe(self, gamma: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= gamma:
            raise ValueError(f"num_accepted must be in [0, {gamma}], got {num_accepted}")
        self.skip()
        self.accepted += num_accepted
        self.rejected += 1.0 if num_accepted < gamma else 0.0
