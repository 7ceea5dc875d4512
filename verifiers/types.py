"""Result and state types shared by every verification rule.

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
