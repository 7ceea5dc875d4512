"""One multi-draft verification call's validated inputs (:class:`MultiBlock`), its assembled
result, and the row arithmetic every rule shares (float64, no epsilon)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from verifiers.randomness import RandomSource
from verifiers.types import PAD_TOKEN, VerifyResult, validated_verify_inputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MultiBlock:
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


def validated_multi_block(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> MultiBlock:
    draft_tokens = torch.as_tensor(draft_tokens)
    if draft_tokens.dim() == 3 and draft_tokens.shape[1] < 1:
        raise ValueError(f"need at least one draft per row (K >= 1), got K = {draft_tokens.shape[1]}")
    return MultiBlock(*validated_verify_inputs(draft_tokens, draft_probs, target_probs, lead_dims=("B", "K")))


def assemble_result(
    block: MultiBlock, rows: list[tuple[int, int, int]], state: tuple | None = None
) -> VerifyResult:
    """Assemble ``VerifyResult`` from per-row ``(num_accepted, draft_index, last_token)``."""
    tokens = torch.full((block.batch, block.gamma + 1), PAD_TOKEN, dtype=torch.int64)  # [B, gamma+1]
    for row, (num_accepted, draft_index, last_token) in enumerate(rows):
        tokens[row, :num_accepted] = block.draft_tokens[row, draft_index, :num_accepted]
        tokens[row, num_accepted] = last_token
    num_accepted = torch.tensor([r[0] for r in rows], dtype=torch.int64)  # [B]
    draft_index = torch.tensor([r[1] for r in rows], dtype=torch.int64)  # [B]
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, draft_index=draft_index, state=state)


def draw_token(source: RandomSource, row: torch.Tensor, fallback: torch.Tensor) -> int:
    """One token from ``row [V]``; a row with no mass (reached only with probability zero by the
    exact rules, i.e. through float rounding) is replaced by ``fallback [V]``."""
    if not bool(row.sum() > 0):
        logger.debug("empty residual row reached; drawing from the fallback row")
        row = fallback
    return int(source.categorical(row))


def normalized_or_zero(weights: torch.Tensor) -> torch.Tensor:
    """``weights [..., V]`` (non-negative) divided by their sum; rows with no mass stay zero
    (zero rows mark contexts the law reaches with probability zero)."""
    mass = weights.sum(dim=-1, keepdim=True)  # [..., 1]
    return weights / torch.where(mass > 0, mass, 1.0)  # a zero row stays zero


def safe_log(values: torch.Tensor) -> torch.Tensor:
    """log of non-negative values with log(0) = -inf (no warnings, no epsilon)."""
    return torch.where(values > 0, torch.log(torch.where(values > 0, values, 1.0)), float("-inf"))


def at_least_one(prob: torch.Tensor | float, count: int) -> torch.Tensor:
    """``1 - (1 - prob)^count`` in float64 without cancellation (-expm1(count * log1p(-prob)))."""
    prob = torch.as_tensor(prob, dtype=torch.float64).clamp(0.0, 1.0)
    return -torch.expm1(count * torch.log1p(-prob))
