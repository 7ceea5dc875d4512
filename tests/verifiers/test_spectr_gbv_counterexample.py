"""Independent checks of the SpecTr-GBV counterexamples in docs/multi-draft.md.

Paper 004 (SpecTr-GBV), Alg. 1 with Eq. (3) and Eq. (4), one draft position (``gamma = L = 1``),
``K = 2`` i.i.d. drafts. With ``L = 1`` the sub-block loop of Alg. 1 (lines 3-10,
``i = tau+1 .. L-1``) is empty, so each draft in turn is tested with the whole-block rule
(lines 11-16): accept with probability ``h_L`` of Eq. (3) unless the token is already in the
rejected set ``H``, and stop at the first acceptance (line 13, ``break``). If nothing is accepted
the emitted token is drawn from the residual of Eq. (4) at the root (``tau = 0``).

Two instances:

* **Instance A (well-defined residual; counterexample 0 in the docs, which lead with it).** Draft ``p = (1/2, 1/2)``,
  target ``q = (4/5, 1/5)``. Eq. (4)'s residual has mass ``9/80 > 0``, so the output law of
  Alg. 1 is fully determined by the paper's formulas, and ``P(emit token 1) = 5/36``, not
  ``1/5``. The law is computed under every reading of Alg. 1 the text leaves open
  (:data:`READINGS`); all give ``5/36``. Two variants that depart from the text
  (:data:`DEPARTURES`) are checked as well; they are not lossless either.
* **Instance B (older, counterexample 1 in the docs; leans on 0/0).** Draft = target = ``(4/5, 1/5)``. All drafts are rejected
  with probability ``4/27`` while Eq. (4)'s residual is ``0/0``; whether the output law is the
  target depends on how the empty residual is filled (the uniform law happens to give exactly
  the target, the target row does not).

The laws are computed here with exact fractions straight from the paper's formulas (nothing from
``verifiers.multi_draft`` is used for them), then compared separately with the law of
``verifiers.multi_draft.spectr_gbv.verify_spectr_gbv`` enumerated exactly (``verifiers.reference.exact``, float64).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from fractions import Fraction
from itertools import permutations, product
from math import factorial

import pytest
import torch

from verifiers.reference.exact import exact_law
from verifiers.multi_draft.spectr_gbv import verify_spectr_gbv

Law = tuple[Fraction, ...]
# Exact law of one call at L = 1: {(num_accepted, emitted token): probability}.
OutputLaw = dict[tuple[int, int], Fraction]

NUM_DRAFTS = 2  # K

# Instance A: Eq. (4) is well defined.
DRAFT_A: Law = (Fraction(1, 2), Fraction(1, 2))  # p, the draft row
TARGET_A: Law = (Fraction(4, 5), Fraction(1, 5))  # q, the target row

# Instance B: draft = target, Eq. (4) is 0/0.
DRAFT_B: Law = (Fraction(4, 5), Fraction(1, 5))
TARGET_B: Law = (Fraction(4, 5), Fraction(1, 5))


# --------------------------------------------------------------------------------------------
# The paper's formulas at L = 1, in exact fractions
# --------------------------------------------------------------------------------------------


def _ratio(draft: Law, target: Law, token: int) -> Fraction:
    """``min(p(x)/q(x), 1)`` (1 where q(x) = 0)."""
    if target[token] == 0:
        return Fraction(1)
    return min(draft[token] / target[token], Fraction(1))


def _lemma_a1_mass(draft: Law, target: Law, token: int, count: int = NUM_DRAFTS) -> Fraction:
    """``q(x) [1 - (1 - min(p(x)/q(x), 1))^K]``: 004 Lemma A.1's claimed P(accept x) and the
    numerator of Eq. (3)."""
    return target[token] * (1 - (1 - _ratio(draft, target, token)) ** count)


def _present_mass(draft: Law, token: int, count: int = NUM_DRAFTS) -> Fraction:
    """``1 - (1 - p(x))^K``: P(some draft is x), 004 Eq. (9) and the denominator of Eq. (3)."""
    return 1 - (1 - draft[token]) ** count


def _eq3_pass_prob(draft: Law, target: Law, token: int, count: int = NUM_DRAFTS) -> Fraction:
    """004 Eq. (3), ``h_{Lk}`` with ``L = 1``."""
    return _lemma_a1_mass(draft, target, token, count) / _present_mass(draft, token, count)


def _eq2_pass_prob_at_block_end(draft: Law, target: Law, token: int) -> Fraction:
    """004 Eq. (2) taken at ``i = L`` (the text: "each token sub-block x_k^i, for i = tau+1, ..., L,
    is accepted with probability h_ik"), with the children ``(x^L, x)`` carrying target mass
    ``q(x^L) q(x | x^L)`` and no draft mass (the draft has no token past the block)."""
    own_uncovered = target[token] * (1 - _ratio(draft, target, token)) ** NUM_DRAFTS
    children_uncovered = target[token]  # sum_x q(x^L, x) (1 - min(0 / q, 1))^K = q(x^L)
    numerator = children_uncovered - own_uncovered
    denominator = _present_mass(draft, token) - target[token] + children_uncovered
    return numerator / denominator


def _eq4_weights(draft: Law, target: Law, power: int = NUM_DRAFTS) -> Law:
    """Unnormalised 004 Eq. (4) at ``tau = 0``: ``q(x) (1 - min(p(x)/q(x), 1))^power``
    (``power = K`` as written; ``power = 1`` is single-draft GBV's ``(q - p)_+``)."""
    return tuple(target[x] * (1 - _ratio(draft, target, x)) ** power for x in range(len(target)))


def _normalized(weights: Law) -> Law:
    mass = sum(weights)
    if mass == 0:
        raise ZeroDivisionError("empty residual: Eq. (4) is 0/0")
    return tuple(w / mass for w in weights)


def _kseq_residual_weights(draft: Law, target: Law, rho: Fraction) -> Law:
    """SpecTr K-SEQ's residual (SpecTr-GBV, arXiv:2604.25925, Sec. 3.2), unnormalised: ``q(x) - rho min(p(x), q(x)/rho)``."""
    return tuple(target[x] - rho * min(draft[x], target[x] / rho) for x in range(len(target)))


def _kseq_rho_bracket(draft: Law, target: Law, steps: int = 60) -> tuple[Fraction, Fraction]:
    """A bracket ``[low, high]`` of width ``(K - 1) / 2^steps`` around the root of
    ``1 - (1 - beta(rho))^K = rho beta(rho)``, ``beta(rho) = sum_x min(p(x), q(x)/rho)``."""

    def excess(rho: Fraction) -> Fraction:
        beta = sum(min(draft[x], target[x] / rho) for x in range(len(target)))
        return 1 - (1 - beta) ** NUM_DRAFTS - rho * beta

    low, high = Fraction(1), Fraction(NUM_DRAFTS)
    assert excess(low) >= 0 >= excess(high)
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) >= 0 else (low, middle)
    return low, high


# --------------------------------------------------------------------------------------------
# Alg. 1 at L = 1, exact, with the open choices as parameters
# --------------------------------------------------------------------------------------------


def _index_order(count: int) -> list[tuple[Fraction, tuple[int, ...]]]:
    return [(Fraction(1), tuple(range(count)))]


def _reverse_order(count: int) -> list[tuple[Fraction, tuple[int, ...]]]:
    return [(Fraction(1), tuple(reversed(range(count))))]


def _uniform_random_order(count: int) -> list[tuple[Fraction, tuple[int, ...]]]:
    weight = Fraction(1, factorial(count))
    return [(weight, order) for order in permutations(range(count))]


def _alg1_law(
    draft: Law,
    target: Law,
    *,
    orders: Callable[[int], list[tuple[Fraction, tuple[int, ...]]]] = _index_order,
    collapse_duplicates: bool = False,
    use_rejected_set: bool = True,
    pass_prob: Callable[[int, int], Fraction] | None = None,
    residual: Law | None = None,
) -> OutputLaw:
    """Exact law of SpecTr-GBV (arXiv:2604.25925) Alg. 1 at ``L = 1`` over the ``K`` i.i.d. drafts and every coin.

    ``orders(K)`` gives weighted visiting orders of the draft indices; ``collapse_duplicates``
    treats ``S`` as a set (equal drafts become one); ``use_rejected_set`` applies the
    ``x not in H`` test of line 12 (a token already rejected is not accepted again; whether its
    coin is drawn and ignored or not drawn at all does not change the law); ``pass_prob(token,
    visit)`` is ``h`` for the ``visit``-th draft examined (default Eq. (3)); ``residual`` is the
    normalised law the recovered token is drawn from (default Eq. (4)).
    """
    vocab = len(target)
    if pass_prob is None:
        pass_prob = lambda token, visit: _eq3_pass_prob(draft, target, token)  # noqa: E731
    if residual is None:
        residual = _normalized(_eq4_weights(draft, target))
    law: OutputLaw = {(tau, token): Fraction(0) for tau in (0, 1) for token in range(vocab)}
    for drafts in product(range(vocab), repeat=NUM_DRAFTS):
        draft_prob = Fraction(1)
        for token in drafts:
            draft_prob *= draft[token]
        for order_prob, order in orders(NUM_DRAFTS):
            visited = [drafts[k] for k in order]
            if collapse_duplicates:
                visited = list(dict.fromkeys(visited))
            still_running = draft_prob * order_prob  # probability that nothing is accepted yet
            rejected_set: set[int] = set()  # H of Alg. 1
            for visit, token in enumerate(visited):
                if use_rejected_set and token in rejected_set:  # line 12: "x_k^L not in H" fails
                    continue
                h = pass_prob(token, visit)
                assert 0 <= h <= 1
                law[(1, token)] += still_running * h  # line 13: tau = L, break
                still_running *= 1 - h
                rejected_set.add(token)  # line 15
            for token in range(vocab):  # line 19: y ~ p_res
                law[(0, token)] += still_running * residual[token]
    assert sum(law.values()) == 1
    return law


def _emitted(law: OutputLaw, token: int) -> Fraction:
    return sum((prob for (_, emitted), prob in law.items() if emitted == token), Fraction(0))


def _accepted(law: OutputLaw) -> Fraction:
    return sum((prob for (tau, _), prob in law.items() if tau == 1), Fraction(0))


# --------------------------------------------------------------------------------------------
# Instance A: the readings of Alg. 1 the paper leaves open
# --------------------------------------------------------------------------------------------


def reading_literal() -> OutputLaw:
    """Alg. 1 as printed: drafts visited in index order k = 1..K, ``h`` from Eq. (3), a draft whose
    block is already in ``H`` is not accepted (line 12's ``x_k^L not in H``), stop at the first
    acceptance (line 13), recovered token from Eq. (4) with exponent ``K``. This is the reading
    ``verifiers.multi_draft.spectr_gbv.verify_spectr_gbv`` implements."""
    return _alg1_law(DRAFT_A, TARGET_A)


def reading_reverse_order() -> OutputLaw:
    """``for each x_k^L in S`` with ``S`` a set: the visiting order is not fixed; drafts visited
    k = K..1."""
    return _alg1_law(DRAFT_A, TARGET_A, orders=_reverse_order)


def reading_random_order() -> OutputLaw:
    """Same openness: drafts visited in a uniformly random order (all K! orders averaged)."""
    return _alg1_law(DRAFT_A, TARGET_A, orders=_uniform_random_order)


def reading_set_of_drafts() -> OutputLaw:
    """Line 1 builds ``S = {x_k^L}`` as a set: equal drafts collapse into one before the loop (so a
    duplicate is never examined, instead of being skipped through ``H``)."""
    return _alg1_law(DRAFT_A, TARGET_A, collapse_duplicates=True)


def reading_eq2_at_block_end() -> OutputLaw:
    """The prose says every sub-block ``i = tau+1..L`` is accepted with ``h_ik`` (Eq. (2)); take
    Eq. (2) at ``i = L`` with no draft mass past the block instead of Eq. (3). (It reduces to
    Eq. (3); the law is the same.)"""
    return _alg1_law(
        DRAFT_A, TARGET_A, pass_prob=lambda token, visit: _eq2_pass_prob_at_block_end(DRAFT_A, TARGET_A, token)
    )


def reading_per_draft_residual() -> OutputLaw:
    """Residual taken per draft, as in single-draft GBV: exponent 1 in Eq. (4),
    ``(q - p)_+`` at the root (instead of the exponent ``K`` over the ``K`` drafts). At
    ``tau = 0`` every draft's context is the root, so which draft ``f`` supplies ``x_f^tau``
    does not matter either."""
    return _alg1_law(DRAFT_A, TARGET_A, residual=_normalized(_eq4_weights(DRAFT_A, TARGET_A, power=1)))


def reading_kseq_residual() -> OutputLaw:
    """Residual of SpecTr K-SEQ (SpecTr-GBV, arXiv:2604.25925, Sec. 3.2), ``q - rho min(p, q/rho)`` at the root of the K-SEQ
    equation (the multi-draft residual the paper builds on). ``rho`` is irrational here; the
    residual is computed at both ends of a tight bracket and is the same law at both."""
    low, high = _kseq_rho_bracket(DRAFT_A, TARGET_A)
    residual = _normalized(_kseq_residual_weights(DRAFT_A, TARGET_A, low))
    assert residual == _normalized(_kseq_residual_weights(DRAFT_A, TARGET_A, high))
    return _alg1_law(DRAFT_A, TARGET_A, residual=residual)


READINGS = [
    reading_literal,
    reading_reverse_order,
    reading_random_order,
    reading_set_of_drafts,
    reading_eq2_at_block_end,
    reading_per_draft_residual,
    reading_kseq_residual,
]


# Variants that contradict the text (not readings of it), checked so that they cannot rescue it.


def departure_no_rejected_set() -> OutputLaw:
    """Contradicts line 12 and the prose ("if a token sub-block ... already exists in H, the
    sampling step for that block is skipped"): a duplicate draft gets a fresh coin."""
    return _alg1_law(DRAFT_A, TARGET_A, use_rejected_set=False)


def departure_k_counts_remaining_drafts() -> OutputLaw:
    """``h_{Lk}`` carries the index ``k`` but Eq. (3) does not use it; read ``K`` in Eq. (3) as the
    number of drafts not yet examined (``K - k + 1``), so the last draft gets single-draft GBV's
    ``min(1, q/p)``. Recovered token from Eq. (4) as written."""
    return _alg1_law(
        DRAFT_A,
        TARGET_A,
        pass_prob=lambda token, visit: _eq3_pass_prob(DRAFT_A, TARGET_A, token, count=NUM_DRAFTS - visit),
    )


DEPARTURES = [departure_no_rejected_set, departure_k_counts_remaining_drafts]

# Exact P(emit token 1) under each reading / departure (the target gives 1/5).
EXPECTED_TOKEN_ONE = {
    reading_literal: Fraction(5, 36),
    reading_reverse_order: Fraction(5, 36),
    reading_random_order: Fraction(5, 36),
    reading_set_of_drafts: Fraction(5, 36),
    reading_eq2_at_block_end: Fraction(5, 36),
    reading_per_draft_residual: Fraction(5, 36),
    reading_kseq_residual: Fraction(5, 36),
    departure_no_rejected_set: Fraction(169, 900),
    departure_k_counts_remaining_drafts: Fraction(17, 120),
}


def test_instance_a_formulas_are_well_defined():
    # Eq. (3): token 0 passes with 11/12, token 1 with 4/15; both in [0, 1], no 0/0.
    assert [_eq3_pass_prob(DRAFT_A, TARGET_A, t) for t in (0, 1)] == [Fraction(11, 12), Fraction(4, 15)]
    assert [_eq2_pass_prob_at_block_end(DRAFT_A, TARGET_A, t) for t in (0, 1)] == [Fraction(11, 12), Fraction(4, 15)]
    # Eq. (4) has positive mass 9/80 (all on token 0, since p(1) >= q(1)): no 0/0 convention is
    # involved anywhere.
    assert _eq4_weights(DRAFT_A, TARGET_A) == (Fraction(9, 80), Fraction(0))
    assert sum(_eq4_weights(DRAFT_A, TARGET_A)) == Fraction(9, 80) > 0
    assert _normalized(_eq4_weights(DRAFT_A, TARGET_A)) == (Fraction(1), Fraction(0))
    # Every residual form considered puts zero mass on token 1.
    assert _normalized(_eq4_weights(DRAFT_A, TARGET_A, power=1)) == (Fraction(1), Fraction(0))
    low, high = _kseq_rho_bracket(DRAFT_A, TARGET_A)
    assert 1 < low < high < Fraction(8, 5)  # K-SEQ's residual keeps token 0 positive there
    assert _kseq_residual_weights(DRAFT_A, TARGET_A, low)[1] == 0


@pytest.mark.parametrize("reading", READINGS + DEPARTURES, ids=lambda f: f.__name__)
def test_instance_a_is_not_lossless_under_every_reading(reading):
    assert reading.__doc__ and reading.__doc__.strip()
    law = reading()
    token_one = _emitted(law, 1)
    assert token_one == EXPECTED_TOKEN_ONE[reading]
    assert token_one != TARGET_A[1]
    assert token_one < TARGET_A[1]
    assert _emitted(law, 0) + token_one == 1


def test_instance_a_literal_law_in_full():
    law = reading_literal()
    assert law == {
        (1, 0): Fraction(451, 720),  # token 0 accepted
        (1, 1): Fraction(5, 36),  # token 1 accepted (= 100/720)
        (0, 0): Fraction(169, 720),  # all drafts rejected, Eq. (4) gives token 0
        (0, 1): Fraction(0),
    }
    # Every reading of the text has exactly this law (not only the same P(token 1)).
    for reading in READINGS:
        assert reading() == law, reading.__name__
    # TV to the target law is 1/5 - 5/36 = 11/180.
    assert abs(_emitted(law, 1) - TARGET_A[1]) == Fraction(11, 180)
    # Lemma A.1 claims P(accept x) = q(x)[1 - (1 - min(p/q, 1))^K]: 11/16 and 1/5.
    assert [_lemma_a1_mass(DRAFT_A, TARGET_A, t) for t in (0, 1)] == [Fraction(11, 16), Fraction(1, 5)]
    assert law[(1, 0)] < Fraction(11, 16) and law[(1, 1)] < Fraction(1, 5)
    # A residual that completed the target law would need mass 44/169 on token 1; Eq. (4) has 0.
    rejected = law[(0, 0)] + law[(0, 1)]
    assert (TARGET_A[1] - law[(1, 1)]) / rejected == Fraction(44, 169)


def _implementation_law(draft: Law, target: Law) -> dict[tuple[int, int], float]:
    """Exact law of ``(num_accepted, first emitted token)`` of ``verify_spectr_gbv`` over the
    draft pair (weighted by the draft law) and every coin of the verifier."""
    vocab = len(target)
    draft_row = torch.tensor([float(x) for x in draft], dtype=torch.float64)
    target_row = torch.tensor([float(x) for x in target], dtype=torch.float64)
    draft_probs = draft_row.expand(1, NUM_DRAFTS, 1, vocab).clone()  # [B, K, gamma, V]
    target_probs = target_row.expand(1, NUM_DRAFTS, 2, vocab).clone()  # [B, K, gamma+1, V]
    law: dict[tuple[int, int], float] = {}
    for drafts in product(range(vocab), repeat=NUM_DRAFTS):
        # [B, K, gamma]
        draft_tokens = torch.tensor(drafts, dtype=torch.int64).reshape(1, NUM_DRAFTS, 1)

        def one_call(source, draft_tokens=draft_tokens):
            result = verify_spectr_gbv(draft_tokens, draft_probs, target_probs, generator=source)
            return int(result.num_accepted[0]), int(result.tokens[0, 0])

        draft_prob = 1.0
        for token in drafts:
            draft_prob *= float(draft[token])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="spectr_gbv", category=RuntimeWarning)
            outcomes = exact_law(one_call)
        for outcome, prob in outcomes.items():
            law[outcome] = law.get(outcome, 0.0) + draft_prob * prob
    return law


def _total_variation(exact: OutputLaw, approx: dict[tuple[int, int], float]) -> float:
    keys = set(exact) | set(approx)
    return 0.5 * sum(abs(float(exact.get(key, 0)) - approx.get(key, 0.0)) for key in keys)


def test_implementation_reproduces_instance_a():
    """``verify_spectr_gbv`` implements the literal reading; its float64 law matches it."""
    law = _implementation_law(DRAFT_A, TARGET_A)
    assert _total_variation(reading_literal(), law) < 1e-9
    assert sum(prob for (_, token), prob in law.items() if token == 1) == pytest.approx(5 / 36, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Instance B (older): draft = target = (4/5, 1/5); the residual is 0/0
# --------------------------------------------------------------------------------------------


def _instance_b_acceptance() -> tuple[dict[int, Fraction], Fraction]:
    """``({token: P(tau = 1, t = token)}, P(tau = 0))`` of the literal reading; the residual
    weight is left as a placeholder since Eq. (4) is undefined here."""
    law = _alg1_law(DRAFT_B, TARGET_B, residual=(Fraction(1), Fraction(0)))
    accepted = {token: law[(1, token)] for token in (0, 1)}
    return accepted, law[(0, 0)] + law[(0, 1)]


def test_instance_b_acceptance_and_empty_residual():
    accepted, all_rejected = _instance_b_acceptance()

    assert [_eq3_pass_prob(DRAFT_B, TARGET_B, t) for t in (0, 1)] == [Fraction(5, 6), Fraction(5, 9)]
    assert accepted == {0: Fraction(98, 135), 1: Fraction(17, 135)}
    assert all_rejected == Fraction(4, 27)
    # Lemma A.1 claims P(accept x) = q(x) here (draft == target); Alg. 1 accepts less.
    assert [_lemma_a1_mass(DRAFT_B, TARGET_B, t) for t in (0, 1)] == list(TARGET_B)
    assert accepted[0] < TARGET_B[0] and accepted[1] < TARGET_B[1]
    # The rejection branch has positive probability but Eq. (4) has nothing to sample from.
    assert all_rejected > 0
    assert sum(_eq4_weights(DRAFT_B, TARGET_B)) == 0
    with pytest.raises(ZeroDivisionError):
        _normalized(_eq4_weights(DRAFT_B, TARGET_B))
    # Theorem 5.3 would give E[tau] = sum_x q(x)[1 - (1 - min(p/q, 1))^K] = 1 here.
    assert sum(accepted.values()) == Fraction(23, 27) < sum(_lemma_a1_mass(DRAFT_B, TARGET_B, t) for t in (0, 1))


def test_instance_b_verdict_depends_on_the_zero_over_zero_convention():
    """Why instance B alone does not settle losslessness: filling the empty residual with the
    uniform law gives exactly the target at this position; the target row does not."""
    accepted, all_rejected = _instance_b_acceptance()
    uniform = [accepted[t] + all_rejected / 2 for t in (0, 1)]
    assert uniform == list(TARGET_B)
    target_fill = [accepted[t] + all_rejected * TARGET_B[t] for t in (0, 1)]
    assert target_fill == [Fraction(38, 45), Fraction(7, 45)]  # 0.844.., not 0.8


def test_implementation_produces_the_instance_b_acceptance_law():
    accepted, all_rejected = _instance_b_acceptance()
    law = _implementation_law(DRAFT_B, TARGET_B)

    assert law[(1, 0)] == pytest.approx(float(accepted[0]), abs=1e-12)
    assert law[(1, 1)] == pytest.approx(float(accepted[1]), abs=1e-12)
    rejected = sum(prob for (num_accepted, _), prob in law.items() if num_accepted == 0)
    assert rejected == pytest.approx(float(all_rejected), abs=1e-12)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    # The implementation fills the empty residual with the target row.
    emitted_zero = sum(prob for (_, token), prob in law.items() if token == 0)
    assert emitted_zero == pytest.approx(38 / 45, abs=1e-12)
