"""``sd`` / ``multi_draft``'s machine: a draft model (or model-free proposers) proposes, the
target verifies; gamma "auto", plain steps and pre-drafting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from verifiers.adaptive import AdaptiveGamma, AdaptiveGammaSettings, StepCosts
from verifiers.machines.base import AR_TOKENS_PER_ITERATION, DecodeMachine, Unsent
from verifiers.machines.needs import MODEL_FREE, PRE_DRAFTED, Need, PreDraft, PreDrafted, Sample, ScoreVerify, Verified
from verifiers.proposers import MODEL_FREE_METHODS, Proposer
from verifiers.registry import get_verifier

#: After this many plain steps in a row, gamma "auto" with step costs drafts once (a probe): plain
#: steps observe no acceptance, so without it an early low estimate would never be revised.
PLAIN_PROBE_EVERY = 4


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
        self.unsent = Unsent([name for name in (draft, target) if name is not None], self.committed)
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
