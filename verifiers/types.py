"""Result types and input validation shared by every verification rule.

Vocabulary (defined once; cited by every verifier's docstring):

* **draft tokens** ``X_1..X_gamma``: sampled by the draft model from ``draft_probs``.
* **accepted tokens**: the longest draft prefix ``X^tau`` the rule keeps (``num_accepted = tau``).
* **recovered (correction) token**: drawn from a residual distribution when ``tau < gamma``.
* **bonus token**: drawn from the target row after the last draft token when ``tau = gamma``.

Every verification call emits exactly ``num_accepted + 1`` tokens per batch row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAD_TOKEN = -1


@dataclass(frozen=True)
class VerifyResult:
    """What one verification call decided, per batch row.

    tokens:        [B, gamma+1] int64 -- accepted draft prefix, then the correction-or-bonus
                   token, then PAD_TOKEN (-1) padding.
    num_accepted:  [B] int64 -- accepted draft tokens tau (the row emits tau + 1 tokens).
    draft_index:   [B] int64 -- multi-draft only: which of the K drafts the accepted prefix
                   was taken from (any draft sharing that prefix); None for single-draft rules.
    state:         value to pass back as ``state=`` to the next call of the same rule for the
                   same request (greedy variants: the distribution modification of the next
                   iteration); None for stateless rules.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    draft_index: torch.Tensor | None = None
    state: Any = None

    def emitted(self, row: int) -> list[int]:
        """The tokens batch row ``row`` emits: accepted prefix + one correction/bonus token."""
        count = int(self.num_accepted[row]) + 1
        return [int(t) for t in self.tokens[row, :count]]


def validated_verify_inputs(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    lead_dims: tuple[str, ...],
    allow_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check one verification call's inputs and return ``(draft_tokens int64, draft_probs,
    target_probs)``, the rows in float64, or in float32 when ``allow_float32`` and both come in
    float32 (a rule that computes in the rows' precision; :data:`verifiers.sampling.ROW_DTYPES`).

    ``lead_dims`` names the leading dims in front of ``gamma``: ``("B",)`` for the single-draft
    rules (``draft_tokens [B, gamma]``, ``draft_probs [B, gamma, V]``, ``target_probs
    [B, gamma+1, V]``), ``("B", "K")`` for the multi-draft rules (``[B, K, gamma]`` and so on).
    Raises ``ValueError`` naming the offending argument, its expected and actual shape, on a
    shape mismatch, a draft token outside ``[0, V)`` or a draft token with zero draft
    probability, and ``TypeError`` on non-integer ``draft_tokens``. Inputs are not modified.
    """
    draft_tokens = torch.as_tensor(draft_tokens)
    draft_probs = torch.as_tensor(draft_probs)
    target_probs = torch.as_tensor(target_probs)
    num_lead = len(lead_dims)
    names = ", ".join(lead_dims)
    if draft_tokens.dim() != num_lead + 1:
        raise ValueError(f"draft_tokens must be [{names}, gamma], got shape {tuple(draft_tokens.shape)}")
    *lead, gamma = draft_tokens.shape
    sizes = ", ".join(str(size) for size in lead)
    if draft_probs.dim() != num_lead + 2 or tuple(draft_probs.shape[: num_lead + 1]) != (*lead, gamma):
        raise ValueError(
            f"draft_probs must be [{names}, gamma, V] = [{sizes}, {gamma}, V], got {tuple(draft_probs.shape)}"
        )
    vocab = draft_probs.shape[-1]
    if tuple(target_probs.shape) != (*lead, gamma + 1, vocab):
        raise ValueError(
            f"target_probs must be [{names}, gamma+1, V] = [{sizes}, {gamma + 1}, {vocab}], "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    draft_tokens = draft_tokens.to(torch.int64)
    if gamma > 0 and (bool((draft_tokens < 0).any()) or bool((draft_tokens >= vocab).any())):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {draft_tokens.tolist()}")
    rows_float32 = allow_float32 and draft_probs.dtype == torch.float32 and target_probs.dtype == torch.float32
    dtype = torch.float32 if rows_float32 else torch.float64
    draft_probs = draft_probs.to(dtype)
    if gamma > 0:
        token_probs = draft_probs.gather(-1, draft_tokens.unsqueeze(-1))  # [*lead, gamma, 1]
        if bool((token_probs <= 0).any()):
            raise ValueError("a draft token has zero probability under draft_probs (rows do not match the draws)")
    return draft_tokens, draft_probs, target_probs.to(dtype)
