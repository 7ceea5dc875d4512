"""Distribution-modification state shared by the greedy rules (``sequential_gbv``, ``spectr_gbv``).

A greedy rule emits ``tau`` accepted tokens plus one token drawn from a residual and promises
that the next tokens follow a modified target law (Alg. 5 of Block Verification / Alg. 2 of
SpecTr-GBV): :class:`GreedyModificationState` carries that promise from one call to the next as
a stack of :class:`ModificationLevel` s; :func:`law_stack` rebuilds the law along every draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from verifiers.multi_draft.block import MultiBlock, assemble_result, normalized_or_zero, safe_log
from verifiers.randomness import RandomSource
from verifiers.types import VerifyResult


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
class Level:
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


def _incoming_levels(state: object, row: int, batch: int, gamma: int) -> list[Level]:
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
        levels.append(Level(0, 0, level.window, level.log_target_prefix, level.log_draft_prefix, level.power))
    return levels


_GreedyRowRule = Callable[
    [MultiBlock, int, list[Level], RandomSource], tuple[tuple[int, int, int], GreedyModificationState]
]


def greedy_result(
    block: MultiBlock, state: object, source: RandomSource, verify_row: _GreedyRowRule
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
    return assemble_result(block, rows, tuple(states))


def path_log_probs(rows: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """``log rows[..., i, paths[..., i]]`` for ``i < gamma``: ``[..., gamma]`` (log 0 = -inf)."""
    gamma = paths.shape[-1]
    return safe_log(rows[..., :gamma, :].gather(-1, paths.unsqueeze(-1)).squeeze(-1))


def modified_rows(
    level: Level, law_rows: torch.Tensor, draft_rows: torch.Tensor, paths: torch.Tensor
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
    path_law = path_log_probs(law_rows, paths)  # [K, gamma]
    path_draft = path_log_probs(draft_rows, paths)  # [K, gamma]
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
    modified[:, rows] = normalized_or_zero(weights)
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
    log_ratio = log_joint_ratio.unsqueeze(-1) + safe_log(drafted) - torch.log(torch.where(positive, below, 1.0))
    uncovered = (-torch.expm1(log_ratio)).clamp(min=0.0)  # relu(1 - D/L)
    return torch.where(positive, below * uncovered.pow(power), 0.0)


def _exclusive_cumsum(log_probs: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``[K, gamma+1]``: entry j = sum of ``log_probs[:, i]`` over counted ``i < j``. Masked
    entries are zeroed with where (a -inf times 0 would be NaN)."""
    masked = torch.where(counted > 0, log_probs, 0.0)  # [K, gamma]
    zero = torch.zeros((log_probs.shape[0], 1), dtype=torch.float64)
    return torch.cat([zero, torch.cumsum(masked, dim=-1)], dim=-1)


def outgoing_state(
    levels: list[Level],
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
        log_law = safe_log(stack[index][span].gather(-1, emitted[span, None])).sum()
        log_draft = safe_log(draft_rows[span].gather(-1, emitted[span, None])).sum()
        carried.append(
            ModificationLevel(
                log_target_prefix=level.log_target_prefix + float(log_law),
                log_draft_prefix=level.log_draft_prefix + float(log_draft),
                window=window,
                power=level.power,
            )
        )
    return GreedyModificationState(tuple(carried))


def law_stack(
    levels: list[Level], target_rows: torch.Tensor, draft_rows: torch.Tensor, paths: torch.Tensor
) -> list[torch.Tensor]:
    """The law along every draft path below and after each level: ``[raw, after level 1, ...]``,
    each ``[K, gamma+1, V]``; the last entry is the current law."""
    stack = [target_rows]
    for level in levels:
        stack.append(modified_rows(level, stack[-1], draft_rows, paths))
    return stack


def carried_unchanged(levels: list[Level], gamma: int) -> tuple[ModificationLevel, ...]:
    """After a full pass ``gamma + 1`` tokens are emitted; no level reaches that far (incoming
    windows are at most gamma, this call's levels end at gamma)."""
    if any(level.end_row > gamma for level in levels):
        raise AssertionError("a modification level reaches past the bonus token")
    return ()
