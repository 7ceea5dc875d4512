"""SpecTr with K-SEQ draft selection, position by position (SpecTr-GBV Sec. 3.2; Sun et al.,
SpecTr, arXiv:2310.15141). Lossless; stateless."""

from __future__ import annotations

import math

import torch

from verifiers.multi_draft.block import (
    MultiBlock,
    assemble_result,
    at_least_one,
    draw_token,
    normalized_or_zero,
    validated_multi_block,
)
from verifiers.randomness import RandomSource, as_random_source
from verifiers.types import VerifyResult

_BISECTION_ITERATIONS = 200  # far more than float64 needs; the loop stops when the bracket is tight


def _kseq_excess(rho: float, linear: float, inverse: float, count: int) -> float:
    """``1 - (1 - beta)^K - rho * beta`` with ``beta = linear + inverse / rho`` (the form of
    ``beta(rho)`` between two breakpoints); non-increasing in rho."""
    beta = min(max(linear + inverse / rho, 0.0), 1.0)
    return -math.expm1(count * math.log1p(-beta)) - rho * beta if beta < 1.0 else 1.0 - rho


def kseq_rho(draft_row: torch.Tensor, target_row: torch.Tensor, num_candidates: int) -> float:
    """The K-SEQ scaling factor rho in [1, K] (SpecTr-GBV Sec. 3.2; SpecTr K-SEQ, arXiv:2310.15141).

    rho is the smallest root of ``1 - (1 - beta(rho))^K = rho * beta(rho)`` with
    ``beta(rho) = sum_x min(draft(x), target(x) / rho)``. The left side is non-increasing and
    the right side non-decreasing in rho, so the root is bracketed by [1, K]. ``beta`` is
    piecewise ``linear + inverse / rho`` between the sorted breakpoints ``target(x)/draft(x)``:
    the breakpoints are evaluated at once (sorted prefix sums), the piece holding the root is
    picked, and the root inside it is bisected in float64 down to adjacent floats. The returned
    value is the upper end of the final bracket, so ``1 - (1 - beta)^K <= rho * beta`` holds as
    computed: that inequality (not the equality) keeps the residual non-negative and the rule
    exact.
    """
    if num_candidates < 1:
        raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
    if num_candidates == 1:
        return 1.0  # K = 1 is token verification
    count = num_candidates
    draft_row = torch.as_tensor(draft_row, dtype=torch.float64)  # [V]
    target_row = torch.as_tensor(target_row, dtype=torch.float64)  # [V]
    in_draft = draft_row > 0  # tokens outside the draft's support add nothing to beta
    ratios = torch.where(in_draft, target_row / torch.where(in_draft, draft_row, 1.0), float("inf"))  # [V]
    sorted_ratios, order = torch.sort(ratios)  # ascending; tokens outside the draft's support last
    draft_sorted = torch.where(in_draft, draft_row, 0.0)[order]  # [V]
    target_sorted = torch.where(in_draft, target_row, 0.0)[order]  # [V]
    zero = torch.zeros(1, dtype=torch.float64)
    # Piece m covers rho in (ratio[m-1], ratio[m]] (ratio[-1] = 0, ratio[V] = inf): tokens
    # before m are capped (target / rho), tokens from m on keep their draft mass, so
    # beta = linear[m] + inverse[m] / rho with linear[m] = sum_{j >= m} draft, inverse[m] =
    # sum_{j < m} target.
    linear = torch.cat([torch.flip(torch.cumsum(torch.flip(draft_sorted, [0]), 0), [0]), zero])  # [V+1]
    inverse = torch.cat([zero, torch.cumsum(target_sorted, 0)])  # [V+1]
    edges = torch.tensor([1.0, float(count)], dtype=torch.float64)
    edge_pieces = torch.searchsorted(sorted_ratios, edges)  # pieces holding rho = 1 and rho = K
    piece_one = int(edge_pieces[0])
    if _kseq_excess(1.0, float(linear[piece_one]), float(inverse[piece_one]), count) <= 0.0:
        return 1.0
    # Upper ends of the pieces between 1 and K, then K itself; the root lies in the first
    # piece whose upper end has excess <= 0 (excess is non-increasing in rho).
    inner = torch.nonzero((sorted_ratios > 1.0) & (sorted_ratios < count)).squeeze(1)  # [M]
    uppers = torch.cat([sorted_ratios[inner], edges[1:]])  # [M+1]
    pieces = torch.cat([inner, edge_pieces[1:]])  # [M+1]
    betas = (linear[pieces] + inverse[pieces] / uppers).clamp(0.0, 1.0)  # [M+1]
    excess = at_least_one(betas, count) - uppers * betas  # [M+1]
    non_positive = torch.nonzero(excess <= 0.0).squeeze(1)
    if non_positive.numel() == 0:
        return float(count)  # only through rounding: excess(K) <= 0 holds exactly
    first = int(non_positive[0])
    low = float(uppers[first - 1]) if first > 0 else 1.0
    piece = int(pieces[first])
    return _bisect_piece(low, float(uppers[first]), float(linear[piece]), float(inverse[piece]), count)


def _bisect_piece(low: float, high: float, linear: float, inverse: float, count: int) -> float:
    """Smallest rho in (low, high] with excess <= 0, to adjacent floats (excess(high) <= 0)."""
    for _ in range(_BISECTION_ITERATIONS):
        middle = 0.5 * (low + high)
        if middle <= low or middle >= high:
            break
        if _kseq_excess(middle, linear, inverse, count) <= 0.0:
            high = middle
        else:
            low = middle
    return high


def _kseq_rows(
    draft_row: torch.Tensor, target_row: torch.Tensor, num_candidates: int
) -> tuple[float, torch.Tensor]:
    """``(rho, residual_row [V])`` of one K-SEQ selection with ``num_candidates`` i.i.d. drafts.

    Each candidate x is accepted with ``min(1, target(x) / (rho * draft(x)))`` in turn, so the
    first acceptance outputs x with probability ``c * min(draft(x), target(x)/rho)`` where
    ``c = (1 - (1 - beta)^K) / beta`` (= rho at the root). The residual is written with ``c``
    (not rho) -- ``norm(target - c * min(draft, target / rho))``, SpecTr-GBV's formula at the root --
    so that it is the exact complement for the rho actually used.
    """
    rho = kseq_rho(draft_row, target_row, num_candidates)
    single = torch.minimum(draft_row, target_row / rho)  # [V]
    beta = single.sum()
    if bool(beta > 0):
        scale = at_least_one(beta, num_candidates) / beta
    else:
        scale = torch.tensor(0.0, dtype=torch.float64)  # disjoint supports: nothing is ever accepted
    residual = (target_row - scale * single).clamp(min=0.0)  # [V]
    return rho, normalized_or_zero(residual)


def verify_spectr(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: None = None,
) -> VerifyResult:
    """SpecTr with K-SEQ draft selection (SpecTr-GBV Sec. 3.2; SpecTr, arXiv:2310.15141), position by position.

    At position ``i`` the candidates are the drafts whose first ``i`` tokens equal the accepted
    prefix (all K at ``i = 0``); given the prefix, their tokens at ``i`` are i.i.d. samples of
    the draft row, so K-SEQ with ``K_i = #candidates`` applies: compute rho (:func:`kseq_rho`),
    visit the candidates in draft order and accept candidate ``k``'s token with probability
    ``min(1, target(x_k) / (rho * draft(x_k)))``; the first acceptance extends the prefix (the
    candidates become the drafts carrying it). If all candidates are rejected, the recovered
    token is drawn from the K-SEQ residual and the block ends; after ``gamma`` accepted
    positions the bonus token is drawn from the target row after the block.

    Random stream: batch rows in order; per position one ``bernoulli`` per visited candidate
    (stopping at the first acceptance); then one ``categorical`` for the last token.
    """
    if state is not None:
        raise ValueError("verify_spectr is stateless; state must be None")
    source = as_random_source(generator)
    block = validated_multi_block(draft_tokens, draft_probs, target_probs)
    rows = [_spectr_row(block, row, source) for row in range(block.batch)]
    return assemble_result(block, rows)


def _spectr_row(block: MultiBlock, row: int, source: RandomSource) -> tuple[int, int, int]:
    tokens, draft_rows, target_rows = block.row(row)  # [K, gamma], [K, gamma, V], [K, gamma+1, V]
    candidates = list(range(block.num_drafts))
    chosen = 0
    for position in range(block.gamma):
        # The candidates share the context, hence the rows: use the first one's.
        draft_row = draft_rows[candidates[0], position]  # [V]
        target_row = target_rows[candidates[0], position]  # [V]
        rho, residual = _kseq_rows(draft_row, target_row, len(candidates))
        accepted = None
        for candidate in candidates:
            token = int(tokens[candidate, position])
            accept_prob = min(1.0, float(target_row[token]) / (rho * float(draft_row[token])))
            if bool(source.bernoulli(torch.tensor(accept_prob, dtype=torch.float64))):
                accepted = candidate
                break
        if accepted is None:
            last = draw_token(source, residual, target_row)
            return position, chosen, last
        chosen = accepted
        token = int(tokens[accepted, position])
        candidates = [c for c in candidates if int(tokens[c, position]) == token]
    last = draw_token(source, target_rows[chosen, block.gamma], target_rows[chosen, block.gamma])
    return block.gamma, chosen, last
