"""``se`` with a draft proposer: speculative decoding with the ensemble law as the target."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.blocks import block_inputs, verified_row, verify_blocks
from verifiers.machines.base import Unsent
from verifiers.machines.ensemble import EnsembleLaw, logprobs_under, plain_ensemble_draw
from verifiers.machines.needs import Need, NextLogits, Sample, ScoreBlock, Verified
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.penalties import NO_PENALTIES, Penalties
from verifiers.randomness import RandomSource
from verifiers.registry import get_verifier


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
        self.unsent = Unsent(list(dict.fromkeys([proposer, *self.members])), self.committed)
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
        token, row = plain_ensemble_draw(self.law, results, self.committed, self.own_source)
        return self._commit([token], logprobs_under(self.logprobs, [token], row[None]))

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
