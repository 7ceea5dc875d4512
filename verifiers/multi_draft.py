"""Multi-draft verification rules: SpecTr K-SEQ, SpecTr-GBV, and sequential greedy block
verification.

Vocabulary: see :mod:`verifiers.types` (draft / accepted / recovered / bonus tokens). Papers:
Lin et al., "SpecTr-GBV: Multi-Draft Block Verification Accelerating Speculative Decoding"
(arXiv:2604.25925), cited below as SpecTr-GBV; Sun et al., "SpecTr: Fast Speculative Decoding via
Optimal Transport" (arXiv:2310.15141); Sun et al., "Block Verification Accelerates Speculative
Decoding" (arXiv:2403.10444), cited as Block Verification. SpecTr-GBV writes ``p`` for the draft
and ``q`` for the target; here they are always ``draft_probs`` / ``target_probs``.

Every rule has one signature, batched over a leading batch dim ``B``, with ``K`` i.i.d. drafts
of ``gamma`` tokens per batch row::

    verify_X(draft_tokens   [B, K, gamma]        int64,
             draft_probs    [B, K, gamma, V]     rows draft k's tokens were sampled from,
             target_probs   [B, K, gamma+1, V]   target rows after each prefix of draft k,
             *, generator, state=None) -> VerifyResult

``draft_probs[b, k, i]`` is the draft's law of ``draft_tokens[b, k, i]`` given the context plus
``draft_tokens[b, k, :i]``; ``target_probs[b, k, i]`` is the target's law at the same context
and ``target_probs[b, k, gamma]`` the target's law after all of draft k (bonus row). Drafts
that share a prefix share those rows (same context). The result carries ``tokens [B, gamma+1]``,
``num_accepted [B]`` and ``draft_index [B]``: a draft whose first ``num_accepted`` tokens are
the accepted prefix (the one whose cache the caller keeps).

The rules:

* :func:`verify_spectr` -- SpecTr K-SEQ (SpecTr-GBV Sec. 3.2; SpecTr) applied position by
  position: the candidates at position ``i`` are the drafts whose first ``i`` tokens equal the
  accepted prefix; their tokens at ``i`` are i.i.d. draft samples given that prefix, and K-SEQ
  selects one of them or rejects all. Lossless; stateless.
* :func:`verify_spectr_gbv` -- SpecTr-GBV exactly as published (SpecTr-GBV Alg. 1 + Eq. (2)-(4),
  distribution modification Alg. 2, loop Alg. 3). **Experimental: not lossless for K >= 2**
  (exact enumeration finds counterexamples, see ``docs/multi-draft.md``); for K = 1 it is
  greedy block verification and is lossless. Stateful.
* :func:`verify_sequential_gbv` -- the lossless multi-draft variant derived in
  ``docs/multi-draft.md``: greedy block verification (Block Verification, App. C, Alg. 4) of draft 1
  against the target, then of every later draft that still carries the accepted prefix against
  the law that greedy block verification leaves behind (its residual plus distribution
  modification, Alg. 5), and so on. For K = 1 it is greedy block verification. Stateful.

State of the stateful rules: a tuple with one :class:`GreedyModificationState` (or None) per
batch row. A greedy rule emits ``tau`` accepted tokens plus one token drawn from a residual and
promises that the *next* tokens follow a modified target law (Alg. 5 of Block Verification / Alg. 2 of SpecTr-GBV),
not the raw target. That promise is the state: a stack of :class:`ModificationLevel` s, each
"rows at these positions are ``norm(L(path, x) * relu(1 - draft(path, x)/L(path, x))^power)``
where ``L`` is the law below this level and ``path`` starts where the level's block started".
The verifier applies the stack to the next call's raw ``target_probs`` along each draft's own
tokens (using the next call's ``draft_probs``); the caller only passes the value back.

All arithmetic is float64, products of ratios are formed in log space, no epsilon is added
anywhere; every random choice goes through the :class:`~verifiers.randomness.RandomSource`
(``generator`` may be a ``torch.Generator``), so :func:`verifiers.reference.exact.exact_law` enumerates
these very functions. Inputs are never modified.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from verifiers.randomness import RandomSource, as_random_source
from verifiers.types import PAD_TOKEN, VerifyResult, validated_verify_inputs

logger = logging.getLogger(__name__)

__all__ = [
    "EXPERIMENTAL_METHODS",
    "GreedyModificationState",
    "ModificationLevel",
    "kseq_rho",
    "verify_sequential_gbv",
    "verify_spectr",
    "verify_spectr_gbv",
]

#: Registered methods of this module that are known not to be lossless in general.
EXPERIMENTAL_METHODS = frozenset({"spectr_gbv"})

_BISECTION_ITERATIONS = 200  # far more than float64 needs; the loop stops when the bracket is tight


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MultiBlock:
    """Validated float64 views of one multi-draft verification call's inputs."""

    draft_tokens: torch.Tensor  # [B, K, gamma] int64
    draft_probs: torch.Tensor  # [B, K, gamma, V] float64
    target_probs: torch.Tensor  # [B, K, gamma+1, V] float64

    @property
    def batch(self) -> int:
        return self.draft_tokens.shape[0]

    @property
    def num_drafts(self) -> int:
        return self.draft_tokens.shape[1]

    @property
    def gamma(self) -> int:
        return self.draft_tokens.shape[2]

    def row(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch row ``row``: ``(draft_tokens [K, gamma], draft_probs [K, gamma, V],
        target_probs [K, gamma+1, V])``."""
        return self.draft_tokens[row], self.draft_probs[row], self.target_probs[row]


def _validated_multi_block(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> _MultiBlock:
    draft_tokens = torch.as_tensor(draft_tokens)
    if draft_tokens.dim() == 3 and draft_tokens.shape[1] < 1:
        raise ValueError(f"need at least one draft per row (K >= 1), got K = {draft_tokens.shape[1]}")
    return _MultiBlock(*validated_verify_inputs(draft_tokens, draft_probs, target_probs, lead_dims=("B", "K")))


def _result(
    block: _MultiBlock, rows: list[tuple[int, int, int]], state: tuple | None = None
) -> VerifyResult:
    """Assemble ``VerifyResult`` from per-row ``(num_accepted, draft_index, last_token)``."""
    tokens = torch.full((block.batch, block.gamma + 1), PAD_TOKEN, dtype=torch.int64)  # [B, gamma+1]
    for row, (num_accepted, draft_index, last_token) in enumerate(rows):
        tokens[row, :num_accepted] = block.draft_tokens[row, draft_index, :num_accepted]
        tokens[row, num_accepted] = last_token
    num_accepted = torch.tensor([r[0] for r in rows], dtype=torch.int64)  # [B]
    draft_index = torch.tensor([r[1] for r in rows], dtype=torch.int64)  # [B]
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, draft_index=draft_index, state=state)


def _draw_token(source: RandomSource, row: torch.Tensor, fallback: torch.Tensor) -> int:
    """One token from ``row [V]``; a row with no mass (reached only with probability zero by the
    exact rules, i.e. through float rounding) is replaced by ``fallback [V]``."""
    if not bool(row.sum() > 0):
        logger.debug("empty residual row reached; drawing from the fallback row")
        row = fallback
    return int(source.categorical(row))


def _normalized_or_zero(weights: torch.Tensor) -> torch.Tensor:
    """``weights [..., V]`` (non-negative) divided by their sum; rows with no mass stay zero
    (zero rows mark contexts the law reaches with probability zero)."""
    mass = weights.sum(dim=-1, keepdim=True)  # [..., 1]
    return weights / torch.where(mass > 0, mass, 1.0)  # a zero row stays zero


def _safe_log(values: torch.Tensor) -> torch.Tensor:
    """log of non-negative values with log(0) = -inf (no warnings, no epsilon)."""
    return torch.where(values > 0, torch.log(torch.where(values > 0, values, 1.0)), float("-inf"))


# --------------------------------------------------------------------------------------------
# SpecTr K-SEQ
# --------------------------------------------------------------------------------------------


def _at_least_one(prob: torch.Tensor | float, count: int) -> torch.Tensor:
    """``1 - (1 - prob)^count`` in float64 without cancellation (-expm1(count * log1p(-prob)))."""
    prob = torch.as_tensor(prob, dtype=torch.float64).clamp(0.0, 1.0)
    return -torch.expm1(count * torch.log1p(-prob))


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
    excess = _at_least_one(betas, count) - uppers * betas  # [M+1]
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
        scale = _at_least_one(beta, num_candidates) / beta
    else:
        scale = torch.tensor(0.0, dtype=torch.float64)  # disjoint supports: nothing is ever accepted
    residual = (target_row - scale * single).clamp(min=0.0)  # [V]
    return rho, _normalized_or_zero(residual)


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
    block = _validated_multi_block(draft_tokens, draft_probs, target_probs)
    rows = [_spectr_row(block, row, source) for row in range(block.batch)]
    return _result(block, rows)


def _spectr_row(block: _MultiBlock, row: int, source: RandomSource) -> tuple[int, int, int]:
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
            last = _draw_token(source, residual, target_row)
            return position, chosen, last
        chosen = accepted
        token = int(tokens[accepted, position])
        candidates = [c for c in candidates if int(tokens[c, position]) == token]
    last = _draw_token(source, target_rows[chosen, block.gamma], target_rows[chosen, block.gamma])
    return block.gamma, chosen, last


# --------------------------------------------------------------------------------------------
# Distribution-modification state (shared by the greedy rules)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModificationLevel:
    """One pending distribution modification, as seen from the start of the next call.

    It modifies the rows at positions ``0 .. window-1`` of the next call (row ``j`` = the law of
    the token after the next call's first ``j`` tokens) to
    ``norm_x( L(path, x) * relu(1 - D(path, x) / L(path, x))^power )`` where ``L`` is the law
    of the levels below it (the raw target for the first level), ``D`` the draft, and the joint
    probabilities are taken along the path from the block where the level was created:
    ``L(path) = exp(log_target_prefix) * L(next call's tokens up to j)``, likewise ``D``.
    ``power = 1`` is Alg. 5 of Block Verification; ``power = K`` is Alg. 2 of SpecTr-GBV.
    """

    log_target_prefix: float
    log_draft_prefix: float
    window: int
    power: int


@dataclass(frozen=True)
class GreedyModificationState:
    """What a greedy rule hands to its next call for one request: the stack of modification
    levels still in force, oldest (closest to the raw target) first."""

    levels: tuple[ModificationLevel, ...] = ()


@dataclass(frozen=True)
class _Level:
    """A modification level in the coordinates of the current call.

    Rows ``first_row <= j < end_row`` are modified; joints are accumulated from call position
    ``start`` on, on top of the ``log_*_prefix`` accumulated before this call.
    """

    start: int
    first_row: int
    end_row: int
    log_target_prefix: float
    log_draft_prefix: float
    power: int


def _incoming_levels(state: object, row: int, batch: int, gamma: int) -> list[_Level]:
    if state is None:
        return []
    if not isinstance(state, Sequence) or len(state) != batch:
        raise ValueError(f"state must be None or a sequence of {batch} per-row states (as returned), got {state!r}")
    row_state = state[row]
    if row_state is None:
        return []
    if not isinstance(row_state, GreedyModificationState):
        raise TypeError(f"state[{row}] must be a GreedyModificationState or None, got {type(row_state).__name__}")
    levels = []
    for level in row_state.levels:
        if level.window > gamma:
            raise ValueError(
                f"a pending distribution modification covers {level.window} positions but this call "
                f"drafts only gamma = {gamma}; keep gamma >= the previous gamma - 1 for greedy rules"
            )
        levels.append(_Level(0, 0, level.window, level.log_target_prefix, level.log_draft_prefix, level.power))
    return levels


_GreedyRowRule = Callable[
    [_MultiBlock, int, list[_Level], RandomSource], tuple[tuple[int, int, int], GreedyModificationState]
]


def _greedy_result(
    block: _MultiBlock, state: object, source: RandomSource, verify_row: _GreedyRowRule
) -> VerifyResult:
    """Run the stateful per-row rule ``verify_row`` over the batch rows in order (the order of
    the random stream) on each row's incoming modification levels, and assemble the result
    with one outgoing :class:`GreedyModificationState` per row."""
    rows, states = [], []
    for row in range(block.batch):
        levels = _incoming_levels(state, row, block.batch, block.gamma)
        outcome, row_state = verify_row(block, row, levels, source)
        rows.append(outcome)
        states.append(row_state)
    return _result(block, rows, tuple(states))


def _path_log_probs(rows: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """``log rows[..., i, paths[..., i]]`` for ``i < gamma``: ``[..., gamma]`` (log 0 = -inf)."""
    gamma = paths.shape[-1]
    return _safe_log(rows[..., :gamma, :].gather(-1, paths.unsqueeze(-1)).squeeze(-1))


def _modified_rows(
    level: _Level, law_rows: torch.Tensor, draft_rows: torch.Tensor, paths: torch.Tensor
) -> torch.Tensor:
    """Rows ``[K, gamma+1, V]`` of the law ``level`` builds on top of ``law_rows`` along each
    draft path.

    ``law_rows [K, gamma+1, V]``: the law below the level along the draft paths
    ``paths [K, gamma]`` whose draft rows are ``draft_rows [K, gamma, V]``. Only paths that carry
    the level's block prefix give meaningful rows; the others are computed but never used.
    """
    if level.end_row <= level.first_row:
        return law_rows
    gamma = paths.shape[-1]
    counted = (torch.arange(gamma) >= level.start).to(torch.float64)  # [gamma]
    path_law = _path_log_probs(law_rows, paths)  # [K, gamma]
    path_draft = _path_log_probs(draft_rows, paths)  # [K, gamma]
    # Joint log-probabilities of each path before row j, j = first_row..end_row-1: [K, R]
    rows = slice(level.first_row, level.end_row)
    joint_law = level.log_target_prefix + _exclusive_cumsum(path_law, counted)[:, rows]
    joint_draft = level.log_draft_prefix + _exclusive_cumsum(path_draft, counted)[:, rows]
    below = law_rows[:, rows]  # [K, R, V]
    drafted = draft_rows[:, rows]  # [K, R, V]
    reachable = joint_law > float("-inf")  # [K, R]
    # log c = log( D(path) / L(path) ) per row; -inf where the draft cannot reach the path.
    log_joint_ratio = torch.where(reachable, joint_draft - torch.where(reachable, joint_law, 0.0), 0.0)  # [K, R]
    if level.power == 1:
        weights = _uncovered_mass(below, drafted, log_joint_ratio, reachable)  # [K, R, V]
    else:
        weights = _uncovered_mass_power(below, drafted, log_joint_ratio, level.power)  # [K, R, V]
        weights = torch.where(reachable.unsqueeze(-1), weights, 0.0)  # unreachable contexts: zero rows
    modified = law_rows.clone()
    modified[:, rows] = _normalized_or_zero(weights)
    return modified


def _uncovered_mass(
    below: torch.Tensor, drafted: torch.Tensor, log_joint_ratio: torch.Tensor, reachable: torch.Tensor
) -> torch.Tensor:
    """``relu(L(path, x) - D(path, x))`` up to a positive factor per row, ``[K, R, V]``.

    With ``c = D(path) / L(path)`` (``log_joint_ratio [K, R]``) this is
    ``relu(min(1, 1/c) L_row - min(1, c) D_row)``: both weights are <= 1, so no joint ratio
    overflows and ``inf * 0`` cannot occur; normalisation removes the factor. Rows of
    unreachable contexts (``reachable [K, R]`` False) get weight 0 on L, hence zero rows.
    """
    log_c = log_joint_ratio.unsqueeze(-1)  # [K, R, 1]
    law_weight = torch.where(reachable.unsqueeze(-1), torch.exp((-log_c).clamp(max=0.0)), 0.0)  # min(1, 1/c)
    draft_weight = torch.exp(log_c.clamp(max=0.0))  # min(1, c)
    return (law_weight * below - draft_weight * drafted).clamp(min=0.0)


def _uncovered_mass_power(
    below: torch.Tensor, drafted: torch.Tensor, log_joint_ratio: torch.Tensor, power: int
) -> torch.Tensor:
    """``L(path, x) * relu(1 - D(path, x) / L(path, x))^power`` up to a positive factor per row
    (SpecTr-GBV Alg. 2 with ``power = K``), formed in log space, ``[K, R, V]``."""
    positive = below > 0
    log_ratio = log_joint_ratio.unsqueeze(-1) + _safe_log(drafted) - torch.log(torch.where(positive, below, 1.0))
    uncovered = (-torch.expm1(log_ratio)).clamp(min=0.0)  # relu(1 - D/L)
    return torch.where(positive, below * uncovered.pow(power), 0.0)


def _exclusive_cumsum(log_probs: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``[K, gamma+1]``: entry j = sum of ``log_probs[:, i]`` over counted ``i < j``. Masked
    entries are zeroed with where (a -inf times 0 would be NaN)."""
    masked = torch.where(counted > 0, log_probs, 0.0)  # [K, gamma]
    zero = torch.zeros((log_probs.shape[0], 1), dtype=torch.float64)
    return torch.cat([zero, torch.cumsum(masked, dim=-1)], dim=-1)


def _outgoing_state(
    levels: list[_Level],
    stack: list[torch.Tensor],
    draft_rows: torch.Tensor,
    path: torch.Tensor,
    num_accepted: int,
    last_token: int,
) -> GreedyModificationState:
    """Carry every level that still covers positions after the emitted tokens into the next
    call: its joints grow by the emitted tokens (accepted prefix + last token) under the law
    below it (``stack[m] [gamma+1, V]`` along the chosen draft) and under the draft
    (``draft_rows [gamma, V]``)."""
    emitted = torch.cat([path[:num_accepted], torch.tensor([last_token])])  # [tau+1]
    carried = []
    for index, level in enumerate(levels):
        window = level.end_row - (num_accepted + 1)
        if window <= 0:
            continue
        if not (level.first_row <= num_accepted < draft_rows.shape[0]):
            raise AssertionError("a carried level must cover the emitted last token")
        span = slice(level.start, num_accepted + 1)
        log_law = _safe_log(stack[index][span].gather(-1, emitted[span, None])).sum()
        log_draft = _safe_log(draft_rows[span].gather(-1, emitted[span, None])).sum()
        carried.append(
            ModificationLevel(
                log_target_prefix=level.log_target_prefix + float(log_law),
                log_draft_prefix=level.log_draft_prefix + float(log_draft),
                window=window,
                power=level.power,
            )
        )
    return GreedyModificationState(tuple(carried))


# --------------------------------------------------------------------------------------------
# Sequential greedy block verification (lossless multi-draft variant)
# --------------------------------------------------------------------------------------------


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
    log_nu = torch.cumsum(_path_log_probs(law_rows, tokens) - _path_log_probs(draft_rows, tokens), 0)  # [n]
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
    block = _validated_multi_block(draft_tokens, draft_probs, target_probs)
    return _greedy_result(block, state, source, _sequential_gbv_row)


def _sequential_gbv_row(
    block: _MultiBlock, row: int, levels: list[_Level], source: RandomSource
) -> tuple[tuple[int, int, int], GreedyModificationState]:
    tokens, draft_rows, target_rows = block.row(row)  # [K, gamma], [K, gamma, V], [K, gamma+1, V]
    gamma = block.gamma
    levels = list(levels)
    stack = _law_stack(levels, target_rows, draft_rows, tokens)  # laws along every draft
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
            last = _draw_token(source, law[gamma], target_rows[draft, gamma])
            return (gamma, chosen, last), GreedyModificationState(_carried_unchanged(levels, gamma))
        level = _Level(accepted_length, accepted_length + passed, gamma, 0.0, 0.0, power=1)
        levels.append(level)
        stack.append(_modified_rows(level, stack[-1], draft_rows, tokens))
        accepted_length += passed
    residual = stack[-1][chosen, accepted_length]  # [V]
    last = _draw_token(source, residual, target_rows[chosen, accepted_length])
    chosen_stack = [law[chosen] for law in stack]
    state = _outgoing_state(levels, chosen_stack, draft_rows[chosen], tokens[chosen], accepted_length, last)
    return (accepted_length, chosen, last), state


def _law_stack(
    levels: list[_Level], target_rows: torch.Tensor, draft_rows: torch.Tensor, paths: torch.Tensor
) -> list[torch.Tensor]:
    """The law along every draft path below and after each level: ``[raw, after level 1, ...]``,
    each ``[K, gamma+1, V]``; the last entry is the current law."""
    stack = [target_rows]
    for level in levels:
        stack.append(_modified_rows(level, stack[-1], draft_rows, paths))
    return stack


def _carried_unchanged(levels: list[_Level], gamma: int) -> tuple[ModificationLevel, ...]:
    """After a full pass ``gamma + 1`` tokens are emitted; no level reaches that far (incoming
    windows are at most gamma, this call's levels end at gamma)."""
    if any(level.end_row > gamma for level in levels):
        raise AssertionError("a modification level reaches past the bonus token")
    return ()


# --------------------------------------------------------------------------------------------
# SpecTr-GBV as published (experimental)
# --------------------------------------------------------------------------------------------


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
    block = _validated_multi_block(draft_tokens, draft_probs, target_probs)
    if block.num_drafts >= 2:
        warnings.warn(
            "spectr_gbv (published SpecTr-GBV) is experimental and not lossless for K >= 2; "
            "use sequential_gbv or spectr (docs/multi-draft.md)",
            RuntimeWarning,
            stacklevel=2,
        )
    return _greedy_result(block, state, source, _spectr_gbv_row)


def _spectr_gbv_row(
    block: _MultiBlock, row: int, levels: list[_Level], source: RandomSource
) -> tuple[tuple[int, int, int], GreedyModificationState]:
    tokens, draft_rows, target_rows = block.row(row)  # [K, gamma], [K, gamma, V], [K, gamma+1, V]
    gamma, num_drafts = block.gamma, block.num_drafts
    stack = _law_stack(levels, target_rows, draft_rows, tokens)
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
            last = _draw_token(source, laws[chosen, gamma], target_rows[chosen, gamma])
            return (gamma, chosen, last), GreedyModificationState(_carried_unchanged(levels, gamma))
    level = _Level(0, accepted_length, gamma, 0.0, 0.0, power=num_drafts)
    levels = [*levels, level]
    stack.append(_modified_rows(level, laws, draft_rows, tokens))
    residual = stack[-1][chosen, accepted_length]  # Eq. (4), [V]
    last = _draw_token(source, residual, target_rows[chosen, accepted_length])
    chosen_stack = [law[chosen] for law in stack]
    state = _outgoing_state(levels, chosen_stack, draft_rows[chosen], tokens[chosen], accepted_length, last)
    return (accepted_length, chosen, last), state


def _spectr_gbv_pass_probs(
    tokens: torch.Tensor, draft_rows: torch.Tensor, law_rows: torch.Tensor, num_drafts: int
) -> list[list[float]]:
    """``h_{i,k}`` of SpecTr-GBV Eq. (2)-(3) for every draft k and sub-block length i = 1..gamma
    (joints from the block start), as K lists of gamma floats."""
    gamma = tokens.shape[-1]
    law_joint = torch.exp(torch.cumsum(_path_log_probs(law_rows, tokens), -1))  # [K, gamma]: q(x^i)
    draft_joint = torch.exp(torch.cumsum(_path_log_probs(draft_rows, tokens), -1))  # [K, gamma]: p(x^i)
    covered = _covered_mass(law_joint, draft_joint, num_drafts)  # A(x^i), [K, gamma]
    has = _at_least_one(draft_joint, num_drafts)  # Has(x^i), [K, gamma]
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
    return torch.where(law_joint > 0, law_joint * _at_least_one(ratio.clamp(max=1.0), num_drafts), 0.0)
