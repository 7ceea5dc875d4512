"""Single-draft verification rules: token, block and greedy block verification.

Vocabulary: see :mod:`verifiers.types` (draft / accepted / recovered / bonus tokens).
Every rule has one signature, batched over a leading batch dim ``B``::

    verify_X(draft_tokens   [B, gamma]          int64,
             draft_probs    [B, gamma, V]       rows the draft tokens were sampled from,
             target_probs   [B, gamma+1, V]     target rows after each draft prefix,
             *, generator, state=None) -> VerifyResult

``draft_probs[b, i]`` is the draft's law of ``draft_tokens[b, i]`` given the context plus
``draft_tokens[b, :i]``; ``target_probs[b, i]`` is the target's law at the same position,
and ``target_probs[b, gamma]`` the target's law after the whole block (the bonus row).
Rows are the exact post-temperature / top-k / top-p rows of :func:`verifiers.sampling.logits_to_probs`.

All arithmetic is float64; every random choice goes through the
:class:`~verifiers.randomness.RandomSource` (``generator`` may be a ``torch.Generator``), so
:func:`verifiers.exact.exact_law` enumerates these very functions. Inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifiers.randomness import RandomSource, as_random_source
from verifiers.types import PAD_TOKEN, VerifyResult


@dataclass(frozen=True)
class _Block:
    """Validated float64 views of one verification call's inputs."""

    draft_tokens: torch.Tensor  # [B, gamma] int64
    draft_probs: torch.Tensor  # [B, gamma, V] float64
    target_probs: torch.Tensor  # [B, gamma+1, V] float64

    @property
    def batch(self) -> int:
        return self.draft_tokens.shape[0]

    @property
    def gamma(self) -> int:
        return self.draft_tokens.shape[1]

    def draft_token_probs(self) -> torch.Tensor:
        """Draft probability of each draft token ``[B, gamma]``."""
        return self.draft_probs.gather(-1, self.draft_tokens.unsqueeze(-1)).squeeze(-1)

    def target_token_probs(self) -> torch.Tensor:
        """Target probability of each draft token at its position ``[B, gamma]``."""
        rows = self.target_probs[:, : self.gamma]  # [B, gamma, V]
        return rows.gather(-1, self.draft_tokens.unsqueeze(-1)).squeeze(-1)


def _validated_block(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> _Block:
    draft_tokens = torch.as_tensor(draft_tokens)
    draft_probs = torch.as_tensor(draft_probs)
    target_probs = torch.as_tensor(target_probs)
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, gamma], got shape {tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (batch, gamma):
        raise ValueError(
            f"draft_probs must be [B, gamma, V] = [{batch}, {gamma}, V], got {tuple(draft_probs.shape)}"
        )
    vocab = draft_probs.shape[2]
    if tuple(target_probs.shape) != (batch, gamma + 1, vocab):
        raise ValueError(
            f"target_probs must be [B, gamma+1, V] = [{batch}, {gamma + 1}, {vocab}], "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    draft_tokens = draft_tokens.to(torch.int64)
    if gamma > 0 and (bool((draft_tokens < 0).any()) or bool((draft_tokens >= vocab).any())):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {draft_tokens.tolist()}")
    block = _Block(draft_tokens, draft_probs.to(torch.float64), target_probs.to(torch.float64))
    if gamma > 0 and bool((block.draft_token_probs() <= 0).any()):
        raise ValueError("a draft token has zero probability under draft_probs (rows do not match the draws)")
    return block


def _residual_rows(target_rows: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """``norm(max(target - draft, 0))`` per row ``[N, V]`` (Leviathan et al. Eq. (1); BV
    paper Alg. 1). A row whose residual is empty (target == draft, rejection impossible in
    exact arithmetic) falls back to the target row itself; no epsilon is added."""
    residual = (target_rows - draft_rows).clamp(min=0.0)  # [N, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [N, 1]
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), target_rows)


def _assemble(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last_tokens: torch.Tensor
) -> torch.Tensor:
    """``tokens [B, gamma+1]``: the accepted draft prefix, the correction-or-bonus token, PAD."""
    batch, gamma = draft_tokens.shape
    positions = torch.arange(gamma + 1).expand(batch, gamma + 1)  # [B, gamma+1]
    padded_draft = torch.cat([draft_tokens, torch.full((batch, 1), PAD_TOKEN)], dim=1)
    tokens = torch.where(positions < num_accepted.unsqueeze(1), padded_draft, PAD_TOKEN)
    return tokens.scatter(1, num_accepted.unsqueeze(1), last_tokens.unsqueeze(1))


def verify_token(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | RandomSource,
    state: None = None,
) -> VerifyResult:
    """Token verification (Leviathan et al. 2023, paper file 002; Alg. 1 of Sun et al.,
    "Block Verification Accelerates Speculative Decoding", files 000/003).

    Position by position, draft token ``X_i`` is accepted with probability
    ``min(1, target(X_i) / draft(X_i))``; at the first rejection a recovered token is drawn
    from ``norm(max(target_i - draft_i, 0))``; if all ``gamma`` are accepted the bonus token
    is drawn from ``target_probs[:, gamma]``.

    Random stream (part of the reproducibility contract): for ``i = 0..gamma-1`` one
    ``bernoulli`` call over the rows still accepting (in batch order), then one
    ``categorical`` call over all rows ``[B, V]`` for the correction-or-bonus tokens.
    Stateless: ``state`` must be None and the result's ``state`` is None.
    """
    if state is not None:
        raise ValueError("verify_token is stateless; state must be None")
    source = as_random_source(generator)
    block = _validated_block(draft_tokens, draft_probs, target_probs)
    draft_token_probs = block.draft_token_probs()  # [B, gamma]
    target_token_probs = block.target_token_probs()  # [B, gamma]
    # min(1, target/draft); draft > 0 was validated, so the ratio is finite.
    accept_probs = torch.clamp(target_token_probs / draft_token_probs, max=1.0)  # [B, gamma]

    num_accepted = torch.zeros(block.batch, dtype=torch.int64)  # [B]
    still_accepting = torch.ones(block.batch, dtype=torch.bool)  # [B]
    for position in range(block.gamma):
        rows = still_accepting.nonzero().squeeze(1)  # [A]
        if rows.numel() == 0:
            break
        accepted_here = source.bernoulli(accept_probs[rows, position])  # [A]
        num_accepted[rows[accepted_here]] += 1
        still_accepting[rows[~accepted_here]] = False

    last_rows = _last_token_rows(block, num_accepted, _residual_rows)  # [B, V]
    last_tokens = source.categorical(last_rows)  # [B]
    tokens = _assemble(block.draft_tokens, num_accepted, last_tokens)
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


def _last_token_rows(block: _Block, num_accepted: torch.Tensor, residual_fn) -> torch.Tensor:
    """Rows ``[B, V]`` of the correction-or-bonus token: ``residual_fn(target, draft)`` at the
    first rejected position, the target's bonus row when the whole block was accepted."""
    batch_index = torch.arange(block.batch)
    target_rows = block.target_probs[batch_index, num_accepted]  # [B, V]
    full = num_accepted == block.gamma  # [B]
    if bool(full.all()):
        return target_rows
    rejected_at = num_accepted.clamp(max=max(block.gamma - 1, 0))  # [B]
    draft_rows = block.draft_probs[batch_index, rejected_at]  # [B, V]
    residual = residual_fn(target_rows, draft_rows)  # [B, V]
    return torch.where(full.unsqueeze(1), target_rows, residual)
