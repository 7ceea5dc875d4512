"""Sequential greedy block verification: the lossless multi-draft variant derived in
``docs/multi-draft.md`` (greedy block verification of each draft in turn against the law the
previous ones leave behind). Stateful."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifiers.multi_draft.block import MultiBlock, draw_token, validated_multi_block
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


def _greedy_block_length(
    tokens: torch.Tensor, draft_rows: torch.Tensor, law_rows: torch.Tensor, source: RandomSource
) -> int:
    """Accepted length of greedy block verification (Block Verification, App. C, Alg. 4) of the block
    ``tokens [n]`` with draft rows ``[n, V]`` against the law rows ``[n+1, V]``.

    ``nu_i = L(X^i) / D(X^i)`` (log space); sub-block ``X^i`` (i < n) passes with
    ``h_i = sum relu(nu_i L_i - D_i) / sum relu(D_i - nu_i L_i)`` (clamped to 1; a zero
    denominator means ``h_i = 1``), the full block with ``min(1, nu_n)``; the result is the
    longest sub-block that passed. Alg. 4 draws the n coins independently, so drawing them from
    the longest sub-block down and stopping at the first pass yields the same law with fewer
    draws.
    """
    length = tokens.shape[0]
    if length == 0:
        return 0
    pass_probs = _greedy_pass_probs(tokens, draft_rows, law_rows)  # [n] as floats
    for sub_length in range(length, 0, -1):
        prob = pass_probs[sub_length - 1]
        if prob > 0.0 and bool(source.bernoulli(torch.tensor(prob, dtype=torch.float64))):
            return sub_length
    return 0


def _greedy_pass_probs(tokens: torch.Tensor, draft_rows: torch.Tensor, law_rows: torch.Tensor) -> list[float]:
    """``[h_1, ..., h_{n-1}, min(1, nu_n)]`` of Block Verification Alg. 4. Both sums of ``h_i`` are scaled by
    ``1 / max(1, nu_i)`` so that no joint ratio overflows."""
    length = tokens.shape[0]
    log_nu = torch.cumsum(path_log_probs(law_rows, tokens) - path_log_probs(draft_rows, tokens), 0)  # [n]
    inner = log_nu[: length - 1].unsqueeze(-1)  # [n-1, 1]
    law_weight = torch.exp(inner.clamp(max=0.0))  # min(1, nu)
    draft_weight = torch.exp((-inner).clamp(max=0.0))  # min(1, 1/nu)
    difference = law_weight * law_rows[1:length] - draft_weight * draft_rows[1:length]  # [n-1, V]
    remain = difference.clamp(min=0.0).sum(-1)  # [n-1]
    reject = (-difference).clamp(min=0.0).sum(-1)  # [n-1]
    ratio = torch.where(reject > 0, remain / torch.where(reject > 0, reject, 1.0), 1.0).clamp(max=1.0)
    full = torch.exp(log_nu[-1:].clamp(max=0.0))  # [1]
    return torch.cat([ratio, full]).tolist()


def verify_sequential_gbv(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: Sequence[GreedyModificationState | None] | None = None,
) -> VerifyResult:
    """Sequential greedy block verification over K i.i.d. drafts (lossless; see
    ``docs/multi-draft.md`` for the derivation and proof).

    With ``L`` the current target law (raw target after the incoming ``state``) and an
    accepted prefix ``A`` (empty at first), for ``k = 1..K``: if draft k starts with ``A``, run
    greedy block verification (Block Verification Alg. 4) of its remaining tokens against ``L`` given ``A``.
    A full pass accepts the whole draft and the bonus token is drawn from ``L`` after it. A
    partial pass of ``t`` tokens extends ``A`` by them and replaces ``L`` by the law greedy block
    verification leaves behind (Block Verification Alg. 5: ``norm(relu(L(path) - D(path)))`` from draft k's
    starting point to the end of the block), which is what later drafts are verified against.
    After the last draft the recovered token is drawn from ``L`` after ``A``, and the levels of
    ``L`` that reach past the emitted tokens are returned as the state for the next call.

    Why it is exact: greedy block verification of a fresh draft against any law ``L`` outputs
    an accepted block followed by a continuation law whose mixture is ``L`` (Block Verification Lemma 6); a
    later draft carrying the accepted prefix is, given everything seen so far, a fresh draft
    sample from that prefix (drafts are independent and only their first tokens were looked
    at), so the argument repeats; a draft that does not carry the prefix is skipped.
    For K = 1 this is exactly greedy block verification with distribution modification
    (Block Verification Alg. 4-6).

    Random stream: batch rows in order; per examined draft one ``bernoulli`` per sub-block
    tried, longest first, stopping at the first pass (sub-blocks that cannot pass are not
    drawn); then one ``categorical``.
    """
    source = as_random_source(generator)
    block = validated_multi_block(draft_tokens, draft_probs, target_probs)
    return greedy_result(block, state, source, _sequential_gbv_row)


def _sequential_gbv_row(
    block: MultiBlock, row: int, levels: list[Level], source: RandomSource
) -> tuple[tuple[int, int, int], GreedyModificationState]:
    tokens, draft_rows, target_rows = block.row(row)  # [K, gamma], [K, gamma, V], [K, gamma+1, V]
    gamma = block.gamma
    levels = list(levels)
    stack = law_stack(levels, target_rows, draft_rows, tokens)  # laws along every draft
    accepted_length, chosen = 0, 0
    for draft in range(block.num_drafts):
        if not torch.equal(tokens[draft, :accepted_length], tokens[chosen, :accepted_length]):
            continue  # does not carry the accepted prefix: not a sample from the current context
        law = stack[-1][draft]  # [gamma+1, V]
        passed = _greedy_block_length(
            tokens[draft, accepted_length:], draft_rows[draft, accepted_length:], law[accepted_length:], source
        )
        if passed > 0:
            chosen = draft
        if accepted_length + passed == gamma:
            last = draw_token(source, law[gamma], target_rows[draft, gamma])
            return (gamma, chosen, last), GreedyModificationState(carried_unchanged(levels, gamma))
        level = Level(accepted_length, accepted_length + passed, gamma, 0.0, 0.0, power=1)
        levels.append(level)
        stack.append(modified_rows(level, stack[-1], draft_rows, tokens))
        accepted_length += passed
    residual = stack[-1][chosen, accepted_length]  # [V]
    last = draw_token(source, residual, target_rows[chosen, accepted_length])
    chosen_stack = [law[chosen] for law in stack]
    state = outgoing_state(levels, chosen_stack, draft_rows[chosen], tokens[chosen], accepted_length, last)
    return (accepted_length, chosen, last), state
