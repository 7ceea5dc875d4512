"""What a decode machine asks of the models (*needs*) and what the executors hand back (*results*).

A need names the model that does it, the committed tokens that model has not been told about
yet (``append``) and the random stream it draws from; each need's docstring states the draws an
executor makes for it, in order (:mod:`verifiers.machines` describes the contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch


# ---------------------------------------------------------------------------------- needs
@dataclass(frozen=True)
class Sample:
    """``model`` draws ``count`` tokens for each of ``num_drafts`` drafts after its context.

    Contract: the first tokens of the K drafts come from the row after the context (shared);
    draft position i makes ONE ``categorical(rows [K, V])`` call on stream ``stream``, row k being the row
    after the context and draft k's first i tokens. Result: :class:`Sampled`.
    """

    model: str
    append: tuple[int, ...]
    count: int
    num_drafts: int = 1
    return_logits: bool = False
    stream: str = "sample"
    logprobs: int | None = None  # report each draw's log-probability (and this many alternatives)
    #: The result handed back to the machine carries the logits too (a machine that verifies the
    #: block itself: the ensemble as the target, :class:`EnsembleDraftMachine`); the rows drawn
    #: from are then float64 whatever the worker's precision, as the machine recomputes them so.
    report_logits: bool = False


@dataclass(frozen=True)
class ScoreVerify:
    """``model`` (the target) scores the proposal returned for need ``draft_need`` of the same
    iteration, or chain ``chain`` of the previous iteration's :class:`PreDraft` when ``draft_need`` is
    :data:`PRE_DRAFTED` (``gamma + 1`` rows per draft), and verifies it with the registry rule ``method`` on its
    stream ``stream``, ONE verifier call with batch 1; a stateful rule's state stays with the
    executor. The emitted tokens are committed to the model's context by the executor.
    Result: :class:`Verified`."""

    model: str
    append: tuple[int, ...]
    draft_need: int
    method: str
    stream: str = "verify"
    logprobs: int | None = None  # report each emitted token's log-probability under the target row
    chain: int = 0  # with draft_need PRE_DRAFTED: the chain of the previous iteration's PreDraft to verify
    proposed: tuple[int, ...] | None = None  # with draft_need MODEL_FREE: the block (one-hot draft rows)


#: ``ScoreVerify.draft_need`` of a block drafted in the previous iteration (:class:`PreDraft`).
PRE_DRAFTED = -1
#: ``ScoreVerify.draft_need`` of a model-free proposal (``ScoreVerify.proposed``; the draft rows
#: are one-hot, :func:`verifiers.proposers.one_hot_rows`).
MODEL_FREE = -2


@dataclass(frozen=True)
class PreDraft:
    """``model`` (the draft) drafts ahead while the target verifies: after its context plus the
    block under verification (``block``; None: draft 0 of need ``block_from``'s result in this
    iteration, which the executor sampled before), it takes the ``guesses`` most likely ids of its
    row there (under the request's law; ties to the lower id) as candidates for the target's
    bonus token, and after each candidate ``k`` draws ``count`` tokens: position i makes ONE
    ``categorical(rows [K, V])`` call on stream ``stream``, row k being the row after the
    block, candidate k and chain k's first i tokens. Result: :class:`PreDrafted`; the next
    iteration verifies chain k (``ScoreVerify(draft_need=PRE_DRAFTED, chain=k)``) when the block was
    accepted in full and the bonus token is candidate k."""

    model: str
    append: tuple[int, ...]
    block: tuple[int, ...] | None
    count: int
    guesses: int
    block_from: int | None = None
    stream: str = "sample"


@dataclass(frozen=True)
class Extend:
    """Ensemble member call: ``model``'s logits at every ``queued`` position and after the
    queue, then ``count`` tokens drawn after the queue on stream ``stream``, one
    ``categorical(row [V])`` each (the first from the row after the queue).
    Result: :class:`MemberBlock`."""

    model: str
    append: tuple[int, ...]
    queued: tuple[int, ...]
    count: int
    stream: str = "sample"


@dataclass(frozen=True)
class ScoreBlock:
    """Ensemble member call of a drafted block: ``model`` scores the first ``gamma`` tokens of
    each draft of need ``draft_need``'s proposal (this iteration) in ONE forward, as a target's
    :class:`ScoreVerify` does, and returns its logits without verifying: ``[K, gamma+1, V]``
    (shared vocabulary), row j of draft k after the context and draft k's first j tokens. The
    block stays fed but uncommitted (the next ``append`` keeps what it accepted)."""

    model: str
    append: tuple[int, ...]
    draft_need: int
    gamma: int


@dataclass(frozen=True)
class NextLogits:
    """``model``'s logits ``[V]`` (shared vocabulary) of the next position. Result: a tensor."""

    model: str
    append: tuple[int, ...]


Need = Union[Sample, ScoreVerify, PreDraft, Extend, ScoreBlock, NextLogits]

#: ``(token, logprob, ((id, logprob), ...))``: a token's log-probability under the law it was
#: sampled from and the most likely alternatives (:func:`verifiers.sampling.token_logprob`).
DrawLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


# -------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Sampled:
    """tokens: [K, n] int64; logits: [K, n, V] (what token i of draft k was drawn from, through
    the request's ``logits_to_probs``) or None when not asked for.

    rows: the very probability rows the tokens were drawn from (those ``logits`` give), n rows
    ``[K, V]``, one per position,
    for a verifier in the same process, which then reads them instead of making them again; a
    payload that leaves the process carries its logits only (the field's ``travels`` is False)."""

    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    logprobs: list[DrawLogprob] | None = None  # draft 0's draws, when asked for
    rows: tuple[torch.Tensor, ...] | None = field(default=None, compare=False, repr=False, metadata={"travels": False})


@dataclass(frozen=True)
class Verified:
    """emitted: the accepted draft prefix plus the correction-or-bonus token."""

    emitted: list[int]
    num_accepted: int
    draft_index: int | None = None
    logprobs: list[DrawLogprob] | None = None  # per emitted token, under the target's row there


def bonus_guesses(row: torch.Tensor, count: int) -> list[int]:
    """The ``count`` most likely ids of ``row [V]`` (ties: the lower id first): a
    :class:`PreDraft`'s candidates for the bonus token."""
    return torch.sort(row, descending=True, stable=True).indices[:count].tolist()


@dataclass(frozen=True)
class PreDrafted:
    """guesses: the K candidate bonus tokens; tokens: [K, n] int64, chain k drafted after
    candidate k; logits: [K, n, V] (what token i of chain k was drawn from) or None in the
    summary a scheduler hands to the machine (the rows stay with the executor)."""

    guesses: list[int]
    tokens: torch.Tensor
    logits: torch.Tensor | None = None

    def chain(self, index: int) -> Sampled:
        """Chain ``index`` as the proposal a :class:`ScoreVerify` reads (``[1, n]`` tokens)."""
        logits = None if self.logits is None else self.logits[index: index + 1]
        return Sampled(self.tokens[index: index + 1], logits)


@dataclass(frozen=True)
class MemberBlock:
    """queued_logits [Q, V]: row j after context + queued[:j]; tokens [m] drawn after the queue;
    token_logits [m, V]: row i is what token i was drawn from."""

    queued_logits: torch.Tensor
    tokens: torch.Tensor
    token_logits: torch.Tensor
