"""Independent check of the SpecTr-GBV counterexample in docs/multi-draft.md (counterexample 1).

Paper 004 (SpecTr-GBV), Alg. 1 with Eq. (3) and Eq. (4), one draft position (``gamma = L = 1``),
``K = 2`` i.i.d. drafts, draft = target = ``(4/5, 1/5)``. With ``L = 1`` the sub-block loop of
Alg. 1 (lines 3-10, ``i = tau+1 .. L-1``) is empty, so each draft in turn is tested with the
whole-block rule (lines 11-16): accept with probability ``h_L`` of Eq. (3) unless the token is
already in the rejected set ``H``, and stop at the first acceptance.

The law is computed here with exact fractions straight from the paper's formulas (nothing from
``verifiers.multi_draft`` is used for it), then compared with the target law and, separately,
with the law of ``verifiers.multi_draft.verify_spectr_gbv`` enumerated exactly.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from itertools import product

import pytest
import torch

from verifiers.exact import exact_law
from verifiers.multi_draft import verify_spectr_gbv

DRAFT_LAW = (Fraction(4, 5), Fraction(1, 5))  # p, the draft row
TARGET_LAW = (Fraction(4, 5), Fraction(1, 5))  # q, the target row
NUM_DRAFTS = 2  # K


def _lemma_a1_mass(token: int) -> Fraction:
    """``q(x) [1 - (1 - min(p(x)/q(x), 1))^K]``: 004 Lemma A.1's claimed P(accept x) and the
    numerator of Eq. (3)."""
    ratio = min(DRAFT_LAW[token] / TARGET_LAW[token], Fraction(1))
    return TARGET_LAW[token] * (1 - (1 - ratio) ** NUM_DRAFTS)


def _present_mass(token: int) -> Fraction:
    """``1 - (1 - p(x))^K``: P(some draft is x), 004 Eq. (9) and the denominator of Eq. (3)."""
    return 1 - (1 - DRAFT_LAW[token]) ** NUM_DRAFTS


def _whole_block_pass_prob(token: int) -> Fraction:
    """004 Eq. (3), ``h_{Lk}`` with ``L = 1``."""
    return _lemma_a1_mass(token) / _present_mass(token)


def _eq4_residual_weight(token: int) -> Fraction:
    """Unnormalised 004 Eq. (4) with ``tau = 0``: ``q(x) (1 - min(p(x)/q(x), 1))^K``."""
    ratio = min(DRAFT_LAW[token] / TARGET_LAW[token], Fraction(1))
    return TARGET_LAW[token] * (1 - ratio) ** NUM_DRAFTS


def _published_acceptance_law() -> tuple[dict[int, Fraction], Fraction]:
    """Exact ``({token: P(tau = 1, t = token)}, P(tau = 0))`` of 004 Alg. 1 at ``L = 1``."""
    vocab = len(DRAFT_LAW)
    pass_probs = [_whole_block_pass_prob(token) for token in range(vocab)]
    accepted = {token: Fraction(0) for token in range(vocab)}
    all_rejected = Fraction(0)
    for drafts in product(range(vocab), repeat=NUM_DRAFTS):
        draft_prob = Fraction(1)
        for token in drafts:
            draft_prob *= DRAFT_LAW[token]
        still_running = draft_prob  # probability that no draft has been accepted yet
        rejected_set: set[int] = set()  # H of Alg. 1
        for token in drafts:
            if token in rejected_set:  # line 12 fails: "x_k^L not in H"
                continue
            accepted[token] += still_running * pass_probs[token]  # line 13: tau = L, break
            still_running *= 1 - pass_probs[token]
            rejected_set.add(token)  # line 15
        all_rejected += still_running
    return accepted, all_rejected


def test_published_rule_is_not_lossless_on_one_position_two_drafts():
    accepted, all_rejected = _published_acceptance_law()

    assert [_whole_block_pass_prob(t) for t in (0, 1)] == [Fraction(5, 6), Fraction(5, 9)]
    assert accepted == {0: Fraction(98, 135), 1: Fraction(17, 135)}
    assert all_rejected == Fraction(4, 27)
    assert sum(accepted.values()) + all_rejected == 1
    # Lemma A.1 claims P(accept x) = q(x) here (draft == target); Alg. 1 accepts less.
    assert [_lemma_a1_mass(t) for t in (0, 1)] == list(TARGET_LAW)
    assert accepted[0] != TARGET_LAW[0]
    assert accepted[0] < TARGET_LAW[0] and accepted[1] < TARGET_LAW[1]
    # The rejection branch has positive probability but Eq. (4) has nothing to sample from,
    # so no choice of recovered token inside the published formulas completes the target law.
    assert all_rejected > 0
    assert sum(_eq4_residual_weight(t) for t in (0, 1)) == 0
    # Theorem 5.3 would give E[tau] = sum_x q(x)[1 - (1 - min(p/q, 1))^K] = 1 here.
    assert sum(accepted.values()) == Fraction(23, 27) < sum(_lemma_a1_mass(t) for t in (0, 1))


def _implementation_law() -> dict[tuple[int, int], float]:
    """Exact law of ``(num_accepted, first emitted token)`` of ``verify_spectr_gbv`` over the
    draft pair (weighted by the draft law) and every coin of the verifier."""
    draft_row = torch.tensor([float(x) for x in DRAFT_LAW], dtype=torch.float64)
    target_row = torch.tensor([float(x) for x in TARGET_LAW], dtype=torch.float64)
    draft_probs = draft_row.expand(1, NUM_DRAFTS, 1, 2).clone()  # [B, K, gamma, V]
    target_probs = target_row.expand(1, NUM_DRAFTS, 2, 2).clone()  # [B, K, gamma+1, V]
    law: dict[tuple[int, int], float] = {}
    for drafts in product(range(2), repeat=NUM_DRAFTS):
        # [B, K, gamma]
        draft_tokens = torch.tensor(drafts, dtype=torch.int64).reshape(1, NUM_DRAFTS, 1)

        def one_call(source, draft_tokens=draft_tokens):
            result = verify_spectr_gbv(draft_tokens, draft_probs, target_probs, generator=source)
            return int(result.num_accepted[0]), int(result.tokens[0, 0])

        draft_prob = float(DRAFT_LAW[drafts[0]] * DRAFT_LAW[drafts[1]])
        for outcome, prob in exact_law(one_call).items():
            law[outcome] = law.get(outcome, 0.0) + draft_prob * prob
    return law


def test_implementation_produces_the_published_law():
    accepted, all_rejected = _published_acceptance_law()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="spectr_gbv", category=RuntimeWarning)
        law = _implementation_law()

    assert law[(1, 0)] == pytest.approx(float(accepted[0]), abs=1e-12)
    assert law[(1, 1)] == pytest.approx(float(accepted[1]), abs=1e-12)
    rejected = sum(prob for (num_accepted, _), prob in law.items() if num_accepted == 0)
    assert rejected == pytest.approx(float(all_rejected), abs=1e-12)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
