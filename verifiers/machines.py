"""Decoding strategies as state machines without I/O: the one implementation of each strategy.

A machine decodes one request. Each *iteration* it says what the models must do (:meth:`needs`: a
list of :data:`Need` values), and it consumes what they returned (:meth:`consume`, results
aligned with the needs), returning the tokens that became final. It never calls a model and
never touches a KV cache; who executes the needs is up to the driver:

* the reference loops (:mod:`verifiers.reference`, :mod:`verifiers.reference.ensemble`)
  execute them with :class:`verifiers.reference.executor.LocalExecutor`, recomputing every row from the
  full context (slow, obviously correct; the exactness tests enumerate their output law);
* the serving engine (``actors.coordination.scheduler``) gathers the needs of every request in flight and
  runs them as one batched call per model worker per scheduler step (each running request
  makes one iteration per step).

Both drivers run the same machine, so what is proven exact is what serves.

Random streams. Every draw belongs to one stream of the request's layout
(:func:`verifiers.randomness.stream_seeds`): :meth:`DecodeMachine.streams` says which model's
executor owns which stream (draws of a need happen where the need is executed, next to the
rows), and ensemble machines own their verification stream themselves (``own_source``). A
need names the stream it draws from; executors draw in the order the machine's contract below
states, which is what makes a request's tokens independent of its neighbours in a batch.

Vocabulary: ``append`` is always the committed tokens the model has not been told about yet
(the model's executor commits them before doing the need); ``queued`` tokens are unverified.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

from verifiers.adaptive import AdaptiveGamma, AdaptiveGammaSettings, StepCosts
from verifiers.ensemble import default_proposer, make_ensemble, next_scorer, verify_segment
from verifiers.penalties import NO_PENALTIES, Penalties, penalized_probs
from verifiers.proposers import MODEL_FREE_METHODS, Proposer
from verifiers.randomness import RandomSource
from verifiers.sampling import token_logprob
from verifiers.registry import get_verifier
from verifiers.types import PAD_TOKEN

#: Tokens a plain iteration draws by default (``ar``, ``sd``'s plain steps): a request alone (its
#: iterations run in a burst, each streamed as it ends). The scheduler sets each step's count
#: (``plain_tokens``; ``actors.coordination.policy.set_plain_tokens``) where that cannot change a
#: seeded request's tokens: an ``ar`` iteration's draws never change them (one draw per token, in
#: order, on stream 0); an ``sd`` plain step's count decides when the next block is drafted, so it
#: changes only for ``gamma: "auto"`` weighing measured step costs, whose tokens already depend on timings.
AR_TOKENS_PER_ITERATION = 4
#: After this many plain steps in a row, gamma "auto" with step costs drafts once (a probe): plain
#: steps observe no acceptance, so without it an early low estimate would never be revised.
PLAIN_PROBE_EVERY = 4


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
    the request's ``logits_to_probs``) or None when not asked for."""

    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    logprobs: list[DrawLogprob] | None = None  # draft 0's draws, when asked for


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


# ------------------------------------------------------------------------------- machines
class DecodeMachine(ABC):
    """One request decoded with one strategy.

    max_new_tokens: the most tokens this machine will ever commit (the driver may stop earlier:
    EOS, stop strings). context_budget: positions left after the prompt in the smallest model
    context (None: unlimited, as in the reference loops); blocks are clipped near its end.
    logprobs: when not None, ``token_logprobs`` gets one entry per committed token: its
    log-probability under the law it was sampled from (the target's for ar / sd / multi_draft,
    the ensemble's for ensemble / se, never the draft's) and the ``logprobs`` most likely ids.
    """

    def __init__(self, max_new_tokens: int, context_budget: int | None = None, logprobs: int | None = None):
        self.max_new_tokens = int(max_new_tokens)
        self.context_budget = context_budget
        self.committed: list[int] = []
        self.accepted_lengths: list[int] = []
        self.logprobs = logprobs  # None: not asked for; k: the token's and k alternatives
        self.token_logprobs: list[DrawLogprob] = []  # aligned with committed, when asked for

    @property
    def done(self) -> bool:
        return len(self.committed) >= self.max_new_tokens

    @abstractmethod
    def streams(self) -> dict[str, dict[str, int]]:
        """Model name -> {stream name: stream index in the request's layout} its executor owns
        (every model the machine uses appears, possibly with no stream)."""

    @abstractmethod
    def needs(self) -> list[Need]:
        """What the models must do this iteration (never empty while not done)."""

    @abstractmethod
    def consume(self, results: Sequence[object]) -> list[int]:
        """Take the results of :meth:`needs` (same order); return the tokens made final."""

    def lookahead(self, block: int) -> int:
        """Clip a block so no position passes the model context."""
        if self.context_budget is None:
            return max(1, block)
        return max(1, min(block, self.context_budget - len(self.committed)))

    def _commit(self, tokens: Sequence[int], logprobs: Sequence[DrawLogprob] | None = None) -> list[int]:
        tokens = [int(t) for t in tokens]
        self.committed.extend(tokens)
        if self.logprobs is not None:
            if logprobs is None or len(logprobs) != len(tokens):
                raise RuntimeError("log-probabilities were asked for but the iteration did not return one per token")
            self.token_logprobs.extend(logprobs)
        return tokens


class _Unsent:
    """Per model, how many committed tokens it has been told about (``append`` bookkeeping)."""

    def __init__(self, models: Sequence[str], committed: list[int]):
        self.synced = {name: 0 for name in models}
        self.committed = committed

    def take(self, model: str) -> tuple[int, ...]:
        tokens = tuple(self.committed[self.synced[model]:])
        self.synced[model] = len(self.committed)
        return tokens

    def mark(self, model: str | None) -> None:
        """``model`` committed the tokens itself (the verifier commits what it emits); None: no
        model did (a machine that verifies itself)."""
        if model is not None:
            self.synced[model] = len(self.committed)


class AutoregressiveMachine(DecodeMachine):
    """``ar``: the target alone; ``plain_tokens`` draws per iteration (``tokens_per_iteration`` at
    first; ``first_tokens``, when set, for the first iteration), one per token, stream 0 on the
    target (``verifiers.reference.autoregressive_generate``)."""

    def __init__(self, target: str, max_new_tokens: int, context_budget: int | None = None,
                 tokens_per_iteration: int = AR_TOKENS_PER_ITERATION, logprobs: int | None = None):
        super().__init__(max_new_tokens, context_budget, logprobs)
        self.target = target
        self.plain_tokens = int(tokens_per_iteration)  # draws per iteration (set per step by the scheduler)
        self.first_tokens: int | None = None  # draws of the first iteration, when set (its first chunk sooner)
        self.unsent = _Unsent([target], self.committed)

    def streams(self) -> dict[str, dict[str, int]]:
        return {self.target: {"sample": 0}}

    def needs(self) -> list[Need]:
        remaining = self.max_new_tokens - len(self.committed)
        draws = self.first_tokens if self.first_tokens and not self.committed else self.plain_tokens
        count = self.lookahead(min(draws, max(1, remaining)))
        return [Sample(self.target, self.unsent.take(self.target), count, logprobs=self.logprobs)]

    def consume(self, results: Sequence[object]) -> list[int]:
        (sampled,) = results
        return self._commit(sampled.tokens[0].tolist(), sampled.logprobs)


class SpeculativeMachine(DecodeMachine):
    """``sd`` / ``multi_draft`` (``verifiers.reference.speculative_generate``): each iteration the
    draft samples K x gamma tokens (stream 0 on the draft), the target scores and verifies them
    (stream 1 on the target) and emits the accepted prefix plus one token.

    ``adaptive``: when given, gamma is chosen before each draft from this request's accepted
    lengths so far (:mod:`verifiers.adaptive`, ``gamma: "auto"``) and ``gamma`` is unused;
    ``draft_lengths`` records the block drafted at each iteration either way. ``step_costs``: when
    set (with ``adaptive``), a callable giving the measured :class:`~verifiers.adaptive.StepCosts`
    of a step now (or None while unmeasured); the choice then weighs them and may be 0, a
    *plain step*: no draft, ``plain_tokens`` tokens sampled from the target on its
    verification stream (recorded as a 0 in ``draft_lengths``, no entry in
    ``accepted_lengths``).

    ``pre_drafting`` (K > 0, single-draft rules): while the target verifies a block, the draft
    drafts the next one (:class:`PreDraft`) after each of the K most likely values of the target's
    bonus token, so that when the block is accepted in full (and no greedy modification is
    pending) and the bonus is one of them, the next iteration verifies that chain right away: the
    draft's work leaves the critical path (PEARL, ICLR 2025: drafting during verification;
    drafting after predicted verification outcomes, as SSD / Saguaro, ICLR 2026). Lossless: the
    chain verified was drawn from the draft's law after the committed context (the bonus
    included) with randomness independent of the verification; which chain is used depends on
    the bonus token and the draft's rows only, and the next block's length is chosen before it
    is drafted (``tests/verifiers/test_pre_drafting.py``: exact enumeration).

    ``proposers`` (single draft, token / block rules): model-free proposers
    (:mod:`verifiers.proposers`) asked in order before each block; the first that proposes
    anything gives the block (``len <= gamma``), verified with one-hot draft rows
    (``ScoreVerify(draft_need=MODEL_FREE)``); when none does, the draft model drafts
    (``draft`` None: a plain step). ``proposed_tokens`` / ``accepted_proposed`` count the
    model-free tokens verified and accepted, per proposer. Lossless like any draft: every
    proposal is a function of the committed tokens (``tests/verifiers/test_proposers.py``)."""

    def __init__(self, draft: str | None, target: str, *, method: str, gamma: int, num_drafts: int,
                 max_new_tokens: int, context_budget: int | None = None, logprobs: int | None = None,
                 adaptive: AdaptiveGammaSettings | None = None, pre_drafting: int = 0,
                 proposers: Sequence[Proposer] = ()):
        super().__init__(max_new_tokens, context_budget, logprobs)
        self.plain_tokens = AR_TOKENS_PER_ITERATION  # draws of a plain step (set per step by the scheduler)
        if pre_drafting < 0:
            raise ValueError(f"pre_drafting must be >= 0 (candidate bonus tokens), got {pre_drafting}")
        rule = get_verifier(method)
        if not rule.multi_draft and num_drafts != 1:
            raise ValueError(f"method {method!r} is single-draft; num_drafts must be 1, got {num_drafts}")
        if proposers and method not in MODEL_FREE_METHODS:
            raise ValueError(f"model-free proposals are verified with {' or '.join(MODEL_FREE_METHODS)}, not {method!r}")
        self.proposers = list(proposers)
        self.proposed_tokens = [0] * len(self.proposers)
        self.accepted_proposed = [0] * len(self.proposers)
        self.proposer_used: int | None = None  # the proposer of this iteration's block (None: a model or plain)
        self.draft, self.target = draft, target
        self.method, self.gamma, self.num_drafts = method, gamma, num_drafts
        self.chooser = AdaptiveGamma(adaptive) if adaptive is not None else None
        # Stateful (greedy) rules carry a distribution modification over the positions after
        # the emitted tokens; the next block must cover them (gamma >= pending + 1).
        self.stateful = rule.stateful
        self.pending_positions = 0
        self.unsent = _Unsent([name for name in (draft, target) if name is not None], self.committed)
        self.draft_indices: list[int] = []
        self.draft_lengths: list[int] = []  # the block drafted at each iteration (0: a plain step)
        self.step_costs: Callable[[], StepCosts | None] | None = None
        self.pre_drafting = pre_drafting if num_drafts == 1 and draft is not None else 0
        self.carried: list[int] | None = None  # the pre-drafted chain this iteration verifies
        self.carried_chain = 0
        self.pre_draft_count = 0  # tokens per chain of this iteration's PreDraft (0: none)
        self.pre_drafted_iterations = 0  # iterations that verified a pre-drafted chain

    #: The target's worker verifies the block (ScoreVerify): what solo bursts, pre-drafting and
    #: the measured step costs of a draft / target pair assume.
    target_verifies: bool = True

    def streams(self) -> dict[str, dict[str, int]]:
        if self.draft is None:
            return {self.target: {"verify": 1}}
        return {self.draft: {"sample": 0}, self.target: {"verify": 1}}

    def next_gamma(self) -> int:
        """The block the next iteration drafts (chosen from the past only, clipped at the context end).
        No block leaves a stateful rule's pending modification uncovered."""
        block = self.gamma if self.chooser is None else self._choose()
        if block == 0:
            return 0
        block = self.lookahead(block)
        if self.stateful:
            # A greedy rule's pending modification must be covered, also where it reaches past
            # the room left at the context end: the block then runs past the end (positions never
            # emitted, since max_new_tokens fits the context; the slots' scratch columns hold
            # them), and the iteration stays the exact one of its block.
            block = max(block, self.pending_positions + 1)
        return block

    def _choose(self) -> int:
        """The chooser's block, with the measured step costs when there are any. A plain step
        (0) is offered only when no greedy modification is pending (it must be covered by a
        verified block). When the costs carry a step mode decided for every request of the step
        (:attr:`~verifiers.adaptive.StepCosts.mode`), it is followed: ``plain`` takes a plain step
        (where allowed), ``speculative`` a block of at least one draft (the step's ``block`` when
        it names one, clipped like any block by :meth:`next_gamma`)."""
        costs = self.step_costs() if self.step_costs is not None else None
        if costs is None:
            return self.chooser.choose()
        plain_allowed = self.pending_positions == 0
        if costs.mode == "plain" and plain_allowed:
            return 0
        if costs.mode == "speculative":
            return costs.block or self.chooser.choose(costs, allow_plain=False)
        recent = self.draft_lengths[-PLAIN_PROBE_EVERY:]
        probe = len(recent) == PLAIN_PROBE_EVERY and not any(recent)  # refresh the acceptance estimate
        return self.chooser.choose(costs, allow_plain=plain_allowed and not probe)

    def needs(self) -> list[Need]:
        if self.carried is not None:  # the block was drafted last iteration, after this bonus token
            self.draft_lengths.append(len(self.carried))
            self.pre_drafted_iterations += 1
            needs: list[Need] = [ScoreVerify(self.target, self.unsent.take(self.target), draft_need=PRE_DRAFTED,
                                             method=self.method, logprobs=self.logprobs, chain=self.carried_chain)]
            return needs + self._pre_draft(tuple(self.carried), None)
        gamma = self.next_gamma()
        self.proposer_used = None
        model_free = self._model_free_block(gamma)
        if model_free is not None:
            return model_free
        if self.draft is None:  # no proposal and no draft model: a plain step
            gamma = 0
        self.draft_lengths.append(gamma)
        if gamma == 0:
            self.pre_draft_count = 0
            return self._plain_needs()
        return self._block_needs(gamma)

    def _plain_needs(self) -> list[Need]:
        """A plain step: the target samples on its own verification stream."""
        remaining = self.max_new_tokens - len(self.committed)
        count = self.lookahead(min(self.plain_tokens, max(1, remaining)))
        return [Sample(self.target, self.unsent.take(self.target), count, stream="verify", logprobs=self.logprobs)]

    def _block_needs(self, gamma: int) -> list[Need]:
        """A block of ``gamma`` drafts: the draft samples it, the target scores and verifies it."""
        return [
            Sample(self.draft, self.unsent.take(self.draft), gamma, self.num_drafts, return_logits=True),
            ScoreVerify(self.target, self.unsent.take(self.target), draft_need=0, method=self.method,
                        logprobs=self.logprobs),
        ] + self._pre_draft(None, 0)

    def _model_free_block(self, gamma: int) -> list[Need] | None:
        """The first model-free proposal of at most ``gamma`` tokens as this iteration's needs
        (None: no proposer proposes, or a plain step was chosen)."""
        if gamma == 0:
            return None
        for index, proposer in enumerate(self.proposers):
            block = proposer.propose(self.committed, gamma)
            if block:
                self.proposer_used = index
                self.pre_draft_count = 0
                self.draft_lengths.append(len(block))
                return [ScoreVerify(self.target, self.unsent.take(self.target), draft_need=MODEL_FREE,
                                    method=self.method, logprobs=self.logprobs, proposed=tuple(block))]
        return None

    def _pre_draft(self, block: tuple[int, ...] | None, block_from: int | None) -> list[Need]:
        """This iteration's :class:`PreDraft` (none when off, or when no next block is worth drafting)."""
        length = self.draft_lengths[-1]
        self.pre_draft_count = self._pre_draft_length(length)
        if self.pre_draft_count == 0:
            return []
        return [PreDraft(self.draft, self.unsent.take(self.draft), block, self.pre_draft_count, self.pre_drafting,
                         block_from=block_from)]

    def _pre_draft_length(self, block: int) -> int:
        """The next block's length, chosen now, before the block under verification is decided
        (from the past only, like every block); 0: do not pre-draft. Full acceptance commits
        ``block + 1`` tokens, and the next block must fit the context and the request after them."""
        if not self.pre_drafting:
            return 0
        after = len(self.committed) + block + 1
        if after >= self.max_new_tokens:
            return 0
        length = self.gamma if self.chooser is None else self._choose()
        if self.context_budget is not None:
            length = min(length, self.context_budget - after)
        return max(0, length)

    def consume(self, results: Sequence[object]) -> list[int]:
        if self.draft_lengths[-1] == 0:
            if self.chooser is not None:
                self.chooser.skip()
            return self._consume_plain(results)
        verified = self._verified(results)
        pre_drafted = results[-1] if self.pre_draft_count else None
        self.accepted_lengths.append(verified.num_accepted)
        if self.proposer_used is not None:
            self.proposed_tokens[self.proposer_used] += self.draft_lengths[-1]
            self.accepted_proposed[self.proposer_used] += verified.num_accepted
        gamma, emitted = self.draft_lengths[-1], verified.num_accepted + 1
        if self.chooser is not None:
            self.chooser.observe(gamma, verified.num_accepted)
        if self.stateful:
            self.pending_positions = max(self.pending_positions - emitted, gamma - emitted, 0)
        if verified.draft_index is not None:
            self.draft_indices.append(verified.draft_index)
        tokens = self._commit(verified.emitted, verified.logprobs)
        self.unsent.mark(self.target)  # the target's verifier committed them (an ensemble machine has no target)
        self._carry(pre_drafted, verified, gamma)
        return tokens

    def _consume_plain(self, results: Sequence[object]) -> list[int]:
        """A plain step's tokens (they reach the target as append)."""
        (sampled,) = results
        return self._commit(sampled.tokens[0].tolist(), sampled.logprobs)

    def _verified(self, results: Sequence[object]) -> Verified:
        """The block's verification: the target's :class:`ScoreVerify` result."""
        return next(result for result in results if isinstance(result, Verified))

    def _carry(self, pre_drafted: PreDrafted | None, verified: Verified, gamma: int) -> None:
        """Keep the pre-drafted chain drafted after the bonus token this iteration emitted, when the
        block was accepted in full and no greedy modification is pending."""
        self.carried = None
        if pre_drafted is None or verified.num_accepted != gamma or self.pending_positions:
            return
        bonus = verified.emitted[-1]
        if bonus in pre_drafted.guesses:
            self.carried_chain = pre_drafted.guesses.index(bonus)
            self.carried = pre_drafted.tokens[self.carried_chain].tolist()


class EnsembleLaw:
    """The ensemble function with the request's row transform: how member logits become the
    rows every ensemble strategy verifies against (float64)."""

    def __init__(self, num_members: int, *, ensemble: str, weights: Sequence[float] | None, mu: float,
                 temperature: float, top_k: int, top_p: float, penalties: Penalties = NO_PENALTIES,
                 prompt: Sequence[int] = ()):
        self.function = make_ensemble(ensemble, num_members, weights=weights, mu=mu)
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "penalties": penalties,
                         "prompt": tuple(prompt)}

    def ensemble_rows(self, member_logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """``member_logits [n, N, V]`` -> ensemble rows ``[N, V]`` (float64): the ensemble's
        logits, penalized with ``generated[i]`` (the tokens generated before row ``i``)."""
        logits = self.function.logits(member_logits.to(torch.float64))  # [N, V]
        return penalized_probs(logits, **self.sampling, generated=generated)

    def proposal_rows(self, logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """One proposer's ``logits [N, V]`` -> the rows it samples from (float64), penalized as
        its worker penalized them."""
        return penalized_probs(logits.to(torch.float64), **self.sampling, generated=generated)


class _EnsembleMachine(DecodeMachine):
    """Members, the ensemble function and the machine's own verification stream (stream n)."""

    def __init__(self, members: Sequence[str], *, ensemble: str, weights: Sequence[float] | None, mu: float,
                 temperature: float, top_k: int, top_p: float, own_source: RandomSource,
                 max_new_tokens: int, context_budget: int | None = None,
                 penalties: Penalties = NO_PENALTIES, prompt: Sequence[int] = (), logprobs: int | None = None):
        super().__init__(max_new_tokens, context_budget, logprobs)
        self.members = list(members)
        self.law = EnsembleLaw(len(self.members), ensemble=ensemble, weights=weights, mu=mu, temperature=temperature,
                               top_k=top_k, top_p=top_p, penalties=penalties, prompt=prompt)
        self.function = self.law.function
        self.own_source = own_source
        self.unsent = _Unsent(self.members, self.committed)

    def streams(self) -> dict[str, dict[str, int]]:
        return {name: {"sample": i} for i, name in enumerate(self.members)}

    def ensemble_rows(self, member_logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """``member_logits [n, N, V]`` -> ensemble rows ``[N, V]`` (:meth:`EnsembleLaw.ensemble_rows`)."""
        return self.law.ensemble_rows(member_logits, generated)

    def _logprobs_of(self, tokens: Sequence[int], rows: torch.Tensor) -> list[DrawLogprob] | None:
        """Token ``i``'s log-probability under ``rows[i]`` (the ensemble law), when asked for."""
        return _logprobs_under(self.logprobs, tokens, rows)

    def proposal_rows(self, logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """One member's ``logits [N, V]`` -> the rows it samples from (:meth:`EnsembleLaw.proposal_rows`)."""
        return self.law.proposal_rows(logits, generated)


def _logprobs_under(count: int | None, tokens: Sequence[int], rows: torch.Tensor) -> list[DrawLogprob] | None:
    """Token ``i``'s log-probability under ``rows[i]`` with ``count`` alternatives; None when not asked for."""
    if count is None:
        return None
    return [token_logprob(row, token, count) for token, row in zip(tokens, rows)]


def _plain_ensemble_draw(law: EnsembleLaw, results: Sequence[object], committed: Sequence[int],
                         source: RandomSource) -> tuple[int, torch.Tensor]:
    """The plain ensemble's step: every member's next logits (``results``, one ``[V]`` each) ->
    the ensemble row ``[V]`` (float64) and ONE ``source.categorical(row)``."""
    member_logits = torch.stack([torch.as_tensor(logits).to(torch.float64).cpu() for logits in results])  # [n, V]
    row = law.ensemble_rows(member_logits[:, None], [list(committed)])[0]  # [V]
    return int(source.categorical(row)), row


class EnsembleMachine(_EnsembleMachine):
    """``ensemble`` (``ensemble_autoregressive_generate``): every member scores every token;
    ONE ``own_source.categorical(row [V])`` per token from the ensemble row."""

    def needs(self) -> list[Need]:
        return [NextLogits(name, self.unsent.take(name)) for name in self.members]

    def consume(self, results: Sequence[object]) -> list[int]:
        token, row = _plain_ensemble_draw(self.law, results, self.committed, self.own_source)
        return self._commit([token], self._logprobs_of([token], row[None]))


@dataclass
class _Segment:
    """Consecutive queued tokens drawn by one member (its bonus token first, if any)."""

    producer: int
    tokens: list[int]


@dataclass
class SegmentQueue:
    """The unverified tokens (Alg. 2's ``S_c``) and each member's logits for them (``C_i``).

    ``member_logits[i]`` holds member i's logits ``[V]`` for queued positions ``0 ..
    coverage(i) - 1`` (its coverage always ends at a segment boundary)."""

    num_members: int
    segments: list[_Segment] = field(default_factory=list)
    member_logits: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.member_logits = [[] for _ in range(self.num_members)]

    def tokens(self) -> list[int]:
        return [t for segment in self.segments for t in segment.tokens]

    def coverage(self) -> list[int]:
        return [len(rows) for rows in self.member_logits]

    def add_segment(self, member: int, tokens: list[int], logits: Sequence[torch.Tensor]) -> None:
        # Invariant of the loop (docs/ensembles.md): a member never holds two segments.
        if any(segment.producer == member for segment in self.segments):
            raise RuntimeError(f"member {member} starts a second queued segment")
        self.segments.append(_Segment(member, list(tokens)))
        self.member_logits[member].extend(logits)

    def cover(self, member: int, queued_logits: Sequence[torch.Tensor]) -> None:
        """Member ``member`` scored the queue: its rows at every queued position."""
        if self.member_logits[member]:
            raise RuntimeError(f"member {member} scores while already covering queued positions")
        self.member_logits[member].extend(queued_logits)

    def first_segment_verifiable(self) -> bool:
        return bool(self.segments) and min(self.coverage()) >= len(self.segments[0].tokens)

    def pop_first(self) -> None:
        length = len(self.segments.pop(0).tokens)
        self.member_logits = [rows[length:] for rows in self.member_logits]

    def clear(self) -> None:
        self.segments = []
        self.member_logits = [[] for _ in range(self.num_members)]


class SpeculativeEnsembleMachine(_EnsembleMachine):
    """``se``: the alternate proposal framework (2 members) / n-model chain (Speculative Ensemble (arXiv:2502.01662), App. B.1
    Alg. 1 and B.2 Alg. 2; the loop is stated in ``verifiers.reference.ensemble.ensemble_generate``).

    One iteration = one member call: the default proposer proposing into an empty queue, or the
    member with the least coverage scoring the queue, drawing its bonus token and proposing
    after it (:class:`Extend`); then every verifiable segment is verified here with the own
    stream (:func:`verifiers.ensemble.verify_segment`).

    ``adaptive`` (``gamma: "auto"``): the iteration may instead be a *plain step*, the plain
    ensemble's (every member's next row, ONE ``own_source.categorical(row [V])``), when
    ``step_costs`` (set by the scheduler) names the step's mode ``plain``: the measured goodput
    of the cohort's steps says proposals do not pay. Unverified queued tokens are then dropped
    (as after a rejection, without a correction). ``speculative``, ``any`` or no costs: the
    members propose. The choice is made before anything of the iteration is drawn, from what is
    measured and committed, never from a queued token's value: tokens follow the ensemble law
    whatever it chooses (``tests/verifiers/test_ensemble.py``: exact enumeration with a
    scripted choice sequence, queues dropped). ``plain_steps`` counts them, ``dropped_tokens`` the
    queued tokens they dropped.
    """

    def __init__(self, members: Sequence[str], *, gammas: Sequence[int], method: str,
                 adaptive: AdaptiveGammaSettings | None = None, **kwargs):
        super().__init__(members, **kwargs)
        self.gammas = list(gammas)
        self.method = method
        self.proposer = default_proposer(self.gammas)
        self.queue = SegmentQueue(len(self.members))
        self.pending_member: int | None = None
        self.segment_lengths: list[int] = []
        self.proposers: list[int] = []
        self.adaptive = adaptive
        self.step_costs: Callable[[], StepCosts | None] | None = None
        self.plain_step = False  # this iteration is a plain ensemble step
        self.plain_steps = 0
        self.dropped_tokens = 0  # queued tokens dropped by plain steps

    def _plain_now(self) -> bool:
        """gamma "auto": whether the step's measured mode is ``plain``."""
        if self.adaptive is None or self.step_costs is None:
            return False
        costs = self.step_costs()
        return costs is not None and costs.mode == "plain"

    def needs(self) -> list[Need]:
        self.plain_step = self._plain_now()
        if self.plain_step:
            self.dropped_tokens += len(self.queue.tokens())
            self.queue.clear()  # unverified proposals dropped: decided without reading them
            self.pending_member = None
            return [NextLogits(name, self.unsent.take(name)) for name in self.members]
        queued = self.queue.tokens()
        room = self.max_new_tokens - len(self.committed) - len(queued)
        if not self.queue.segments:
            member, count = self.proposer, min(self.gammas[self.proposer], room)
        else:
            member = next_scorer(self.queue.coverage())
            count = min(self.gammas[member], room) if room >= 1 else 0
        self.pending_member = member
        name = self.members[member]
        return [Extend(name, self.unsent.take(name), tuple(queued), count)]

    def consume(self, results: Sequence[object]) -> list[int]:
        if self.plain_step:
            self.plain_steps += 1
            token, row = _plain_ensemble_draw(self.law, results, self.committed, self.own_source)
            return self._commit([token], self._logprobs_of([token], row[None]))
        (block,) = results
        member, self.pending_member = self.pending_member, None
        if self.queue.segments:
            self.queue.cover(member, list(block.queued_logits))
        if block.tokens.numel():
            self.queue.add_segment(member, block.tokens.tolist(), list(block.token_logits))
        committed: list[int] = []
        logprobs: list[DrawLogprob] = []
        while self.queue.first_segment_verifiable():
            tokens, token_logprobs = self._verify_first_segment()
            committed.extend(tokens)
            logprobs.extend(token_logprobs or [])
        return self._commit(committed, logprobs if self.logprobs is not None else None)

    def _verify_first_segment(self) -> tuple[list[int], list[DrawLogprob] | None]:
        """Verify the oldest segment against the ensemble rows; update the queue; return the
        committed tokens and their log-probabilities under the ensemble rows at their positions."""
        segment = self.queue.segments[0]
        length = len(segment.tokens)
        member_logits = torch.stack(
            [torch.stack(rows[:length]) for rows in self.queue.member_logits]
        ).to(torch.float64).cpu()  # [n, g, V]
        generated = [self.committed + segment.tokens[:j] for j in range(length)]  # before each position
        proposal_probs = self.proposal_rows(member_logits[segment.producer], generated)  # [g, V]
        ensemble_probs = self.ensemble_rows(member_logits, generated)  # [g, V]
        next_token = self.queue.segments[1].tokens[0] if len(self.queue.segments) > 1 else PAD_TOKEN
        verdict = verify_segment(
            torch.tensor([segment.tokens], dtype=torch.int64),  # [1, g]
            proposal_probs.unsqueeze(0),  # [1, g, V]
            ensemble_probs.unsqueeze(0),  # [1, g, V]
            torch.tensor([next_token], dtype=torch.int64),  # [1]
            method=self.method,
            generator=self.own_source,
        )
        self.accepted_lengths.append(int(verdict.num_accepted[0]))
        self.segment_lengths.append(length)
        self.proposers.append(segment.producer)
        if bool(verdict.fully_accepted[0]):
            self.queue.pop_first()
        else:
            self.queue.clear()
        emitted = verdict.emitted(0)
        return emitted, self._logprobs_of(emitted, ensemble_probs[: len(emitted)])


class EnsembleDraftMachine(SpeculativeMachine):
    """``se`` with a draft proposer: speculative decoding with the ensemble law as the target
    (Fu et al., "Speculative Ensemble: Fast Large Language Model Ensemble via Speculation",
    arXiv:2502.01662, Sec. 3.2: the "WE-SD" / "CD-SD" rows, a proposal model verified against
    the ensemble distribution of Eq. 4 / Eq. 5).

    Each iteration: ``proposer`` samples K x gamma tokens (:class:`Sample`, stream ``sample`` on
    its worker), every member scores the block in ONE forward (:class:`ScoreBlock`: all members
    in the same step, each on its own worker), and the block is verified here against the
    ensemble rows ``r`` (:class:`EnsembleLaw` of every member's ``[K, gamma+1]`` rows) with the
    request's rule through the verification core (:mod:`verifiers.blocks`), on the machine's own
    stream; after a fully accepted block the bonus token is drawn from ``r``'s last row, which
    every member scored. When the proposer is a member (the paper's WE-SD proposes with the
    smallest member), its draft rows are its member rows: it draws ``gamma + 1`` tokens and the
    last is dropped, so its row after the block comes from the same call (no scoring call).

    Everything else is :class:`SpeculativeMachine`: gamma or ``gamma: "auto"`` (from the
    request's acceptance so far), greedy rules' pending modifications, multi-draft rules with
    ``num_drafts``. A plain step (gamma 0, with measured step costs) is the plain ensemble's:
    every member's next row, ONE ``own_source.categorical(row [V])``. Lossless for any rule
    that is lossless in ``sd``: the proposal is drawn from rows the machine recomputes bit for
    bit (float64) with randomness independent of the verification, and the block length is a
    function of the past (``tests/verifiers/test_ensemble_draft.py``: exact enumeration).

    Streams: member i owns stream i (unused unless it proposes), the verification stream n is
    ``own_source``, a proposer that is not a member owns stream n + 1.
    """

    target_verifies = False

    def __init__(self, proposer: str, members: Sequence[str], *, method: str, gamma: int, num_drafts: int,
                 ensemble: str, weights: Sequence[float] | None, mu: float, temperature: float, top_k: int,
                 top_p: float, own_source: RandomSource, max_new_tokens: int, context_budget: int | None = None,
                 penalties: Penalties = NO_PENALTIES, prompt: Sequence[int] = (), logprobs: int | None = None,
                 adaptive: AdaptiveGammaSettings | None = None):
        super().__init__(proposer, None, method=method, gamma=gamma, num_drafts=num_drafts,
                         max_new_tokens=max_new_tokens, context_budget=context_budget, logprobs=logprobs,
                         adaptive=adaptive, pre_drafting=0)
        self.members = list(members)
        if len(set(self.members)) != len(self.members) or len(self.members) < 2:
            raise ValueError(f"an ensemble needs 2 or more distinct members, got {self.members}")
        self.proposer_is_member = proposer in self.members
        self.scorers = [name for name in self.members if name != proposer]  # members that score each block
        self.law = EnsembleLaw(len(self.members), ensemble=ensemble, weights=weights, mu=mu, temperature=temperature,
                               top_k=top_k, top_p=top_p, penalties=penalties, prompt=prompt)
        self.own_source = own_source
        self.unsent = _Unsent(list(dict.fromkeys([proposer, *self.members])), self.committed)
        self.verify_state = None  # a stateful (greedy) rule's state between blocks

    @property
    def proposer(self) -> str:
        return self.draft

    @property
    def pre_drafting(self) -> int:
        return 0  # the next block's proposer rows need the members' verdict first

    @pre_drafting.setter
    def pre_drafting(self, value: int) -> None:
        if value:
            raise ValueError("an ensemble with a draft proposer does not pre-draft")

    def streams(self) -> dict[str, dict[str, int]]:
        streams: dict[str, dict[str, int]] = {name: {} for name in self.members}
        index = self.members.index(self.draft) if self.proposer_is_member else len(self.members) + 1
        streams[self.draft] = {"sample": index}
        return streams

    def _plain_needs(self) -> list[Need]:
        """The plain ensemble's step: every member's next row."""
        return [NextLogits(name, self.unsent.take(name)) for name in self.members]

    def _consume_plain(self, results: Sequence[object]) -> list[int]:
        token, row = _plain_ensemble_draw(self.law, results, self.committed, self.own_source)
        return self._commit([token], _logprobs_under(self.logprobs, [token], row[None]))

    def _block_needs(self, gamma: int) -> list[Need]:
        """The proposer's block (one more draw when it is a member: its row after the block),
        then every other member's scoring of it."""
        count = gamma + 1 if self.proposer_is_member else gamma
        needs: list[Need] = [Sample(self.draft, self.unsent.take(self.draft), count, self.num_drafts,
                                    report_logits=True)]
        needs += [ScoreBlock(name, self.unsent.take(name), draft_need=0, gamma=gamma) for name in self.scorers]
        return needs

    def _verified(self, results: Sequence[object]) -> Verified:
        """Verify the block against the ensemble rows on the own stream (:mod:`verifiers.blocks`)."""
        from verifiers.blocks import block_inputs, verified_row, verify_blocks  # blocks imports this module

        sampled, scores = results[0], dict(zip(self.scorers, results[1:]))
        gamma = self.draft_lengths[-1]
        draft_tokens = sampled.tokens[:, :gamma]  # [K, gamma]
        proposer_logits = torch.as_tensor(sampled.logits).to(torch.float64).cpu()  # [K, count, V]
        num_drafts, vocab = draft_tokens.shape[0], proposer_logits.shape[-1]
        member_logits = torch.stack([
            proposer_logits[:, : gamma + 1] if name == self.draft else torch.as_tensor(scores[name]).to(torch.float64).cpu()
            for name in self.members
        ])  # [n, K, gamma+1, V]
        drafts = draft_tokens.tolist()
        target_after = [self.committed + draft[:j] for draft in drafts for j in range(gamma + 1)]
        target_probs = self.law.ensemble_rows(member_logits.reshape(len(self.members), -1, vocab), target_after)
        draft_after = [self.committed + draft[:j] for draft in drafts for j in range(gamma)]
        draft_probs = self.law.proposal_rows(proposer_logits[:, :gamma].reshape(-1, vocab), draft_after)
        spec = get_verifier(self.method)
        inputs = block_inputs(spec, draft_tokens, draft_probs.reshape(num_drafts, gamma, vocab),
                              target_probs.reshape(num_drafts, gamma + 1, vocab))
        result = verify_blocks(spec, [inputs], [self.own_source], state=self.verify_state)
        self.verify_state = result.state
        return verified_row(spec, inputs, result, 0, self.logprobs)
