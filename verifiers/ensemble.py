"""Ensemble distributions over n models and their speculative verification.

Paper: Fu et al., "Speculative Ensemble: Fast Large Language Model Ensemble via Speculation"
(2025), arXiv:2502.01662. In the paper ``q`` is the proposer and ``p``
the verifier; here the names are ``proposal_probs`` (the rows of the member that produced the
tokens) and ``ensemble_probs`` (the law every generated token must follow).

Ensemble functions (Sec. 3.2)
-----------------------------
* weighted, probability level (Eq. 4): ``r = sum_i w_i softmax(l_i)``, weights >= 0 summing to
  1 (``None``: uniform);
* contrastive, logit level (Eq. 5): ``r = softmax(l_expert - mu * l_amateur)``, exactly two
  members: member 0 is the expert, member 1 the amateur.

Temperature, top-k and top-p are applied in ONE place: :func:`ensemble_probs` first builds the
ensemble's logits at temperature 1 (:func:`ensemble_logits`: ``log r`` for weighted, ``l_expert -
mu * l_amateur`` for contrastive), then turns them into rows with
:func:`verifiers.sampling.logits_to_probs`. Hence ``T = 1`` is Eq. 4 / Eq. 5 exactly, ``T = 0``
is the argmax of the *ensemble* (not of any member), and for the weighted ensemble ``T`` sharpens
the mixture (``r_T ~ r^(1/T)``). Members propose from their own rows through the same transform
(:func:`member_probs`); any proposal law is lossless as long as verification sees the very row
the proposal was drawn from, which is what these functions guarantee.

Contrastive and ``-inf``: ``-inf - mu * (-inf)`` is NaN and a finite expert logit minus ``mu *
(-inf)`` is ``+inf``. The rule here: a token the expert rules out (``-inf``) is ruled out; a token
only the amateur rules out gets the amateur's smallest finite logit of that row (it is treated
as the least likely token the amateur kept), so no NaN / ``+inf`` can appear.

Vocabularies: members of one family may pad their vocabularies differently. Every member's
logits are truncated to the shared (smallest) vocabulary before anything else
(:func:`shared_vocab_logits`), so padded tokens are masked for the ensemble and never proposed.

Speculative-ensemble verification (Sec. 3.2, Eq. 6)
---------------------------------------------------
A token proposed by member ``j`` (drawn from ``q_j``) is accepted with ``min(1, r / q_j)``; at the
first rejection a token is drawn from ``norm(max(r - q_j, 0))``. That IS token verification
(:func:`verifiers.single_draft.verify_token`) with the ensemble rows as target rows; block
verification (``verify_block``) against the ensemble rows is the same composition. Row
``gamma + 1`` of the target is special: with the alternate proposal framework (Sec. 3.3,
App. B.1 Alg. 1; n models: Sec. 3.4, App. B.2 Alg. 2) the token after a fully accepted segment is
not drawn from ``r`` but is the next member's bonus token, already drawn and queued as the head
of that member's own proposal, to be verified in its turn. :func:`verify_segment` passes a point
mass on that queued token as row ``gamma + 1`` and reports the segment as fully accepted without
emitting a token after it; dropping the bonus leaves the law unchanged because what follows an
accepted segment is itself an exact continuation (see ``docs/ensembles.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from verifiers.randomness import RandomSource
from verifiers.registry import get_verifier
from verifiers.sampling import logits_to_probs
from verifiers.types import PAD_TOKEN

EnsembleKind = Literal["weighted", "contrastive"]
VerifyMethod = Literal["token", "block"]

WEIGHT_SUM_TOLERANCE = 1e-6
# Stateless single-draft rules whose target row gamma+1 is used only for the bonus token.
SEGMENT_METHODS: tuple[str, ...] = ("token", "block")


@dataclass(frozen=True)
class EnsembleFunction:
    """A validated ensemble function over ``num_members`` models (see the module docstring).

    ``weights`` is the normalised weight tuple (weighted) or ``None`` (contrastive); ``mu`` is
    the contrastive strength (unused by the weighted ensemble).
    """

    kind: EnsembleKind
    num_members: int
    weights: tuple[float, ...] | None
    mu: float

    def logits(self, member_logits: torch.Tensor) -> torch.Tensor:
        """``member_logits [n, ..., V]`` -> ensemble logits ``[..., V]`` at temperature 1."""
        member_logits = _checked_member_logits(member_logits, self.num_members)
        return _ENSEMBLE_LOGITS[self.kind](self, member_logits)

    def probs(
        self, member_logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0
    ) -> torch.Tensor:
        """``member_logits [n, ..., V]`` -> ensemble rows ``[..., V]`` (the law to sample)."""
        return logits_to_probs(self.logits(member_logits), temperature=temperature, top_k=top_k, top_p=top_p)


def make_ensemble(
    kind: EnsembleKind, num_members: int, *, weights: Sequence[float] | None = None, mu: float = 0.1
) -> EnsembleFunction:
    """Validate the arguments and build an :class:`EnsembleFunction`.

    weighted: ``num_members >= 1``, ``weights`` (default uniform) non-negative, one per member,
    summing to 1 within ``WEIGHT_SUM_TOLERANCE`` (then normalised exactly).
    contrastive: ``num_members == 2`` (expert, amateur), ``weights`` must be None, ``mu >= 0``.
    """
    if kind not in _ENSEMBLE_LOGITS:
        raise ValueError(f"ensemble must be one of {sorted(_ENSEMBLE_LOGITS)}, got {kind!r}")
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
        raise ValueError(f"num_members must be an int >= 1, got {num_members!r}")
    if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    if kind == "contrastive":
        if num_members != 2:
            raise ValueError(f"a contrastive ensemble takes exactly 2 members (expert, amateur), got {num_members}")
        if weights is not None:
            raise ValueError(f"weights apply to weighted ensembles only, got {list(weights)}")
        return EnsembleFunction(kind, num_members, None, float(mu))
    return EnsembleFunction(kind, num_members, _checked_weights(weights, num_members), float(mu))


def _checked_weights(weights: Sequence[float] | None, num_members: int) -> tuple[float, ...]:
    if weights is None:
        return tuple(1.0 / num_members for _ in range(num_members))
    weights = tuple(float(w) for w in weights)
    if len(weights) != num_members:
        raise ValueError(f"expected {num_members} weights (one per member), got {len(weights)}: {list(weights)}")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    total = sum(weights)
    if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"weights must sum to 1, got {list(weights)} (sum {total!r})")
    return tuple(w / total for w in weights)


def _checked_member_logits(member_logits: torch.Tensor, num_members: int) -> torch.Tensor:
    if not isinstance(member_logits, torch.Tensor):
        raise TypeError(f"member_logits must be a torch.Tensor [n, ..., V], got {type(member_logits).__name__}")
    if member_logits.dim() < 2 or member_logits.shape[0] != num_members:
        raise ValueError(
            f"member_logits must be [n={num_members}, ..., V], got shape {tuple(member_logits.shape)}"
        )
    member_logits = member_logits.to(torch.float64)
    if bool(torch.isnan(member_logits).any()) or bool((member_logits == float("inf")).any()):
        raise ValueError("member logits contain NaN or +inf")
    if bool((member_logits == float("-inf")).all(dim=-1).any()):
        raise ValueError("a member has a row that is -inf everywhere (no token has positive probability)")
    return member_logits


def weighted_ensemble_logits(member_logits: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Speculative Ensemble (arXiv:2502.01662) Eq. 4 in log space: ``log(sum_i w_i softmax(l_i))``.

    ``member_logits [n, ..., V]``, ``weights`` one per member -> ``[..., V]`` float64. Tokens no
    weighted member gives mass to are ``-inf``. Softmax of these logits at temperature 1 is the
    mixture itself (up to float64 rounding).
    """
    member_probs_t1 = torch.softmax(member_logits.to(torch.float64), dim=-1)  # [n, ..., V]
    weight_shape = (len(weights),) + (1,) * (member_probs_t1.dim() - 1)
    weight_tensor = torch.tensor(weights, dtype=torch.float64).reshape(weight_shape)  # [n, 1, ..., 1]
    mixture = (weight_tensor * member_probs_t1).sum(dim=0)  # [..., V]
    return torch.log(mixture)  # log(0) = -inf: a token outside every weighted member's support


def contrastive_ensemble_logits(
    expert_logits: torch.Tensor, amateur_logits: torch.Tensor, mu: float
) -> torch.Tensor:
    """Speculative Ensemble (arXiv:2502.01662) Eq. 5 logits: ``l_expert - mu * l_amateur`` without NaN or ``+inf``.

    ``expert_logits``, ``amateur_logits [..., V]`` -> ``[..., V]`` float64. A token with expert
    logit ``-inf`` stays ``-inf``; an amateur ``-inf`` (e.g. after top-k) is replaced by the
    amateur's smallest finite logit of the same row before the subtraction. Adding a constant to
    either member's logits does not change the softmax of the result.
    """
    expert_logits = expert_logits.to(torch.float64)
    amateur_logits = amateur_logits.to(torch.float64)
    amateur_finite = torch.isfinite(amateur_logits)  # [..., V]
    smallest_finite = torch.where(amateur_finite, amateur_logits, float("inf")).amin(dim=-1, keepdim=True)
    # A row with no finite amateur logit was rejected by the caller's checks; guard anyway.
    smallest_finite = torch.where(torch.isfinite(smallest_finite), smallest_finite, 0.0)  # [..., 1]
    amateur_filled = torch.where(amateur_finite, amateur_logits, smallest_finite)  # [..., V]
    contrast = expert_logits - float(mu) * amateur_filled  # [..., V], NaN-free: amateur is finite
    return torch.where(torch.isfinite(expert_logits), contrast, float("-inf"))


def _weighted(function: EnsembleFunction, member_logits: torch.Tensor) -> torch.Tensor:
    assert function.weights is not None
    return weighted_ensemble_logits(member_logits, function.weights)


def _contrastive(function: EnsembleFunction, member_logits: torch.Tensor) -> torch.Tensor:
    return contrastive_ensemble_logits(member_logits[0], member_logits[1], function.mu)


_ENSEMBLE_LOGITS: dict[str, Callable[[EnsembleFunction, torch.Tensor], torch.Tensor]] = {
    "weighted": _weighted,
    "contrastive": _contrastive,
}


def shared_vocab_logits(member_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack per-member logits ``[..., V_i]`` into ``[n, ..., V]`` with ``V = min_i V_i``.

    Members of one family often pad their vocabularies to different sizes; the tokens beyond
    the shared vocabulary are dropped (masked for the ensemble and for every proposer).
    """
    if len(member_logits) == 0:
        raise ValueError("need at least one member's logits")
    tensors = [torch.as_tensor(logits).to(torch.float64) for logits in member_logits]
    batch_shapes = {tuple(t.shape[:-1]) for t in tensors}
    if len(batch_shapes) != 1 or any(t.dim() < 1 for t in tensors):
        raise ValueError(f"member logits must share their leading shape, got {[tuple(t.shape) for t in tensors]}")
    shared = min(t.shape[-1] for t in tensors)
    if shared < 1:
        raise ValueError("a member has an empty vocabulary")
    return torch.stack([t[..., :shared] for t in tensors])  # [n, ..., V]


def member_probs(
    member_logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Each member's own proposal rows: ``member_logits [n, ..., V]`` -> ``[n, ..., V]`` through
    :func:`verifiers.sampling.logits_to_probs` (same transform as the ensemble rows)."""
    return logits_to_probs(member_logits, temperature=temperature, top_k=top_k, top_p=top_p)


@dataclass(frozen=True)
class SegmentVerdict:
    """What the verification of one proposal segment decided, per batch row.

    tokens:          [B, gamma+1] int64 -- the accepted prefix, then the correction token when
                     the segment was not fully accepted, then PAD_TOKEN (-1).
    num_accepted:    [B] int64 -- accepted segment tokens tau.
    fully_accepted:  [B] bool -- tau == gamma: the row emits the gamma segment tokens and NO token
                     after them (the next queued segment continues the sequence).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor
    fully_accepted: torch.Tensor

    def emitted(self, row: int) -> list[int]:
        """Tokens batch row ``row`` commits: tau accepted, plus the correction if tau < gamma."""
        count = int(self.num_accepted[row]) + (0 if bool(self.fully_accepted[row]) else 1)
        return [int(t) for t in self.tokens[row, :count]]


def verify_segment(
    segment_tokens: torch.Tensor,
    proposal_probs: torch.Tensor,
    ensemble_probs: torch.Tensor,
    next_tokens: torch.Tensor,
    *,
    method: VerifyMethod,
    generator: torch.Generator | RandomSource,
) -> SegmentVerdict:
    """Verify a segment proposed by one member against the ensemble law (Speculative Ensemble, arXiv:2502.01662, Eq. 6).

    segment_tokens  [B, gamma] int64 -- the segment, all drawn by one member (its bonus token
                    first when the segment came from a scoring call, then its proposals);
    proposal_probs  [B, gamma, V] -- that member's rows the tokens were drawn from;
    ensemble_probs  [B, gamma, V] -- the ensemble rows at the same positions;
    next_tokens     [B] int64 -- the head of the segment queued after this one, or PAD_TOKEN
                    when nothing is queued (the caller then needs no token after the segment).
    method          "token" (Leviathan et al. / Eq. 6) or "block" (Sun et al. block
                    verification with the ensemble as target).

    Calls the registry's single-draft verifier ONCE with ``draft_tokens = segment_tokens``,
    ``draft_probs = proposal_probs`` and ``target_probs = ensemble_probs`` extended by a point
    mass on ``next_tokens`` (token 0 for PAD) as row gamma+1, and ``generator`` as is; so the
    random stream is exactly that verifier's. The bonus the verifier draws from that row is
    discarded: a fully accepted segment emits only its own tokens. Inputs are not modified.
    """
    if method not in SEGMENT_METHODS:
        raise ValueError(f"method must be one of {list(SEGMENT_METHODS)}, got {method!r}")
    segment_tokens = torch.as_tensor(segment_tokens)
    proposal_probs = torch.as_tensor(proposal_probs, dtype=torch.float64)
    ensemble_probs = torch.as_tensor(ensemble_probs, dtype=torch.float64)
    next_tokens = torch.as_tensor(next_tokens, dtype=torch.int64)
    if segment_tokens.dim() != 2 or segment_tokens.shape[1] < 1:
        raise ValueError(f"segment_tokens must be [B, gamma] with gamma >= 1, got {tuple(segment_tokens.shape)}")
    if tuple(ensemble_probs.shape) != tuple(proposal_probs.shape):
        raise ValueError(
            f"ensemble_probs {tuple(ensemble_probs.shape)} must match proposal_probs {tuple(proposal_probs.shape)}"
        )
    batch, gamma = segment_tokens.shape
    vocab = ensemble_probs.shape[-1]
    if tuple(next_tokens.shape) != (batch,):
        raise ValueError(f"next_tokens must be [B] = [{batch}], got {tuple(next_tokens.shape)}")
    if bool(((next_tokens < PAD_TOKEN) | (next_tokens >= vocab)).any()):
        raise ValueError(f"next_tokens must lie in [0, {vocab}) or be PAD_TOKEN, got {next_tokens.tolist()}")
    point_mass = torch.zeros(batch, 1, vocab, dtype=torch.float64)  # [B, 1, V]
    point_mass[torch.arange(batch), 0, next_tokens.clamp(min=0)] = 1.0
    target_probs = torch.cat([ensemble_probs, point_mass], dim=1)  # [B, gamma+1, V]
    result = get_verifier(method).verify(segment_tokens, proposal_probs, target_probs, generator=generator)
    fully_accepted = result.num_accepted == gamma  # [B]
    positions = torch.arange(gamma + 1).expand(batch, gamma + 1)  # [B, gamma+1]
    dropped_bonus = fully_accepted.unsqueeze(1) & (positions == gamma)  # [B, gamma+1]
    tokens = result.tokens.masked_fill(dropped_bonus, PAD_TOKEN)
    return SegmentVerdict(tokens=tokens, num_accepted=result.num_accepted, fully_accepted=fully_accepted)


def default_proposer(gammas: Sequence[int]) -> int:
    """The member that proposes at the start and after every rejection: the largest proposal
    length, the first such member on ties."""
    return max(range(len(gammas)), key=lambda i: (gammas[i], -i))


def next_scorer(coverage: Sequence[int]) -> int:
    """App. B.2 Alg. 2's ``argmin_i |C_i|``: the member with the fewest cached rows (the first on
    ties) scores the queue next. ``coverage[i]`` = queued positions member i has rows for."""
    return min(range(len(coverage)), key=lambda i: (coverage[i], i))
