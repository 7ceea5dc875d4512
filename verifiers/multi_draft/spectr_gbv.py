"""SpecTr-GBV exactly as published (Lin et al., arXiv:2604.25925). Experimental: not lossless
for K >= 2 (``docs/multi-draft.md``); for K = 1 it is greedy block verification. Stateful."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from verifiers.multi_draft.block import MultiBlock, at_least_one, draw_token, validated_multi_block
from verifiers.multi_draft.modification import (
    GreedyModificationState,
    Level,
    carried_unchanged,
    greedy_result,
    law_stack,
    modified_rows,
    outgoing_state,
    path_log_probs,
)
from verifiers.randomness import RandomSource, as_random_source
from verifiers.types import VerifyResult


def verify_spectr_gbv(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: Sequence[GreedyModificationState | None] | None = None,
) -> VerifyResult:
    """SpecTr-GBV exactly as published (arXiv:2604.25925): Alg. 1 with Eq. (2)-(4), distribution modification
    Alg. 2, decode loop Alg. 3. EXPERIMENTAL: not lossless for K >= 2 (exact enumeration gives
    counterexamples; ``docs/multi-draft.md``). For K = 1 it is greedy block verification.

    Joint probabilities ``p(x^i)`` (draft) and ``q(x^i)`` (current target law) run from the
    start of the block. With ``A(y) = q(y) [1 - (1 - min(p(y)/q(y), 1))^K]`` and
    ``Has(y) = 1 - (1 - p(y))^K``, Eq. (2) reads
    ``h_i = (A(x^i) - sum_x A(x^i, x)) / (Has(x^i) - sum_x A(x^i, x))`` for ``i < L`` and
    Eq. (3) ``h_L = A(x^L) / Has(x^L)``. Drafts are visited in order; draft k tries its
    sub-blocks longer than the current ``tau`` that are not in the rejected set ``H``; a pass
    sets ``tau`` (and the chosen draft), a failure adds the sub-block to ``H``; a full pass
    ends the loop with the bonus token. Otherwise the recovered token follows Eq. (4)
    ``~ q(x^tau, x) (1 - min(p/q, 1))^K`` and the next ``L - tau - 1`` positions follow Alg. 2
    (the same formula, carried as state). ``h`` values outside [0, 1] (the published formulas
    do not guarantee the range) are clamped; a zero denominator counts as ``h = 1``; an empty
    residual falls back to the target row.

    Law-preserving shortcut: within one draft, Alg. 1 draws every coin; only the longest
    passing sub-block and the failures above it matter afterwards (later drafts only try longer
    sub-blocks), so coins are drawn from the longest sub-block down and stop at the first pass.

    Random stream: batch rows in order; per draft one ``bernoulli`` per sub-block tried; then
    one ``categorical``.
    """
    source = as_random_source(generator)
    block = validated_multi_block(draft_tokens, draft_probs, target_probs)
    if block.num_drafts >= 2:
        warnings.warn(
            "spectr_gbv (published SpecTr-GBV) is experimental and not lossless for K >= 2; "
            "use sequential_gbv or spectr (docs/multi-draft.md)",
            RuntimeWarning,
            stacklevel=2,
        )
    return greedy_result(block, state, source, _spectr_gbv_row)


def _spectr_gbv_row(
    block: MultiBlock, row: int, levels: list[Level], source: RandomSource
) -> tuple[tuple[int, int, int], GreedyModificationState]:
    tokens, draft_rows, target_rows = block.row(row)  # [K, gamma], [K, gamma, V], [K, gamma+1, V]
    gamma, num_drafts = block.gamma, block.num_drafts
    stack = law_stack(levels, target_rows, draft_rows, tokens)
    laws = stack[-1]  # current target law along every draft, [K, gamma+1, V]
    pass_probs = _spectr_gbv_pass_probs(tokens, draft_rows, laws, num_drafts)  # K lists of gamma
    accepted_length, chosen = 0, 0
    rejected: set[tuple[int, ...]] = set()
    for draft in range(num_drafts):
        path = tokens[draft].tolist()
        for sub_length in range(gamma, accepted_length, -1):
            sub_block = tuple(path[:sub_length])
            if sub_block in rejected:
                continue
            prob = torch.tensor(pass_probs[draft][sub_length - 1], dtype=torch.float64)
            if bool(source.bernoulli(prob)):
                accepted_length, chosen = sub_length, draft
                break
            rejected.add(sub_block)
        if accepted_length == gamma:
            last = draw_token(source, laws[chosen, gamma], target_rows[chosen, gamma])
            return (gamma, chosen, last), GreedyModificationState(carried_unchanged(levels, gamma))
    level = Level(0, accepted_length, gamma, 0.0, 0.0, power=num_drafts)
    levels = [*levels, level]
    stack.append(modified_rows(level, laws, draft_rows, tokens))
    residual = stack[-1][chosen, accepted_length]  # Eq. (4), [V]
    last = draw_token(source, residual, target_rows[chosen, accepted_length])
    chosen_stack = [law[chosen] for law in stack]
    state = outgoing_state(levels, chosen_stack, draft_rows[chosen], tokens[chosen], accepted_length, last)
    return (accepted_length, chosen, last), state


def _spectr_gbv_pass_probs(
    tokens: torch.Tensor, draft_rows: torch.Tensor, law_rows: torch.Tensor, num_drafts: int
) -> list[list[float]]:
    """``h_{i,k}`` of SpecTr-GBV Eq. (2)-(3) for every draft k and sub-block length i = 1..gamma
    (joints from the block start), as K lists of gamma floats."""
    gamma = tokens.shape[-1]
    law_joint = torch.exp(torch.cumsum(path_log_probs(law_rows, tokens), -1))  # [K, gamma]: q(x^i)
    draft_joint = torch.exp(torch.cumsum(path_log_probs(draft_rows, tokens), -1))  # [K, gamma]: p(x^i)
    covered = _covered_mass(law_joint, draft_joint, num_drafts)  # A(x^i), [K, gamma]
    has = at_least_one(draft_joint, num_drafts)  # Has(x^i), [K, gamma]
    children = _covered_mass(
        law_joint[:, : gamma - 1, None] * law_rows[:, 1:gamma],
        draft_joint[:, : gamma - 1, None] * draft_rows[:, 1:gamma],
        num_drafts,
    ).sum(-1)  # sum_x A(x^i, x) for i < gamma, [K, gamma-1]
    zero = torch.zeros((tokens.shape[0], 1), dtype=torch.float64)
    children = torch.cat([children, zero], dim=-1)  # Eq. (3) for i = gamma has no children term
    numerator, denominator = covered - children, has - children  # [K, gamma]
    ratio = torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), 1.0)
    return ratio.clamp(0.0, 1.0).tolist()


def _covered_mass(law_joint: torch.Tensor, draft_joint: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """``q [1 - (1 - min(p / q, 1))^K]`` elementwise (0 where q = 0)."""
    ratio = torch.where(law_joint > 0, draft_joint / torch.where(law_joint > 0, law_joint, 1.0), 1.0)
    return torch.where(law_joint > 0, law_joint * at_least_one(ratio.clamp(max=1.0), num_drafts), 0.0)
