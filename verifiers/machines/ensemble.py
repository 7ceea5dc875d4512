"""The ensemble law and the machines whose members propose: ``ensemble`` (every member scores
every token) and ``se`` (members propose segments, verified against the ensemble rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from verifiers.adaptive import AdaptiveGamma, AdaptiveGammaSettings, StepCosts
from verifiers.alternate_gammas import best_alternate_gammas
from verifiers.ensemble import default_proposer, make_ensemble, next_scorer, verify_segment
from verifiers.machines.base import DecodeMachine, Unsent
from verifiers.machines.needs import DrawLogprob, Extend, Need, NextLogits
from verifiers.penalties import NO_PENALTIES, Penalties, penalized_probs
from verifiers.randomness import RandomSource
from verifiers.sampling import token_logprob
from verifiers.types import PAD_TOKEN


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
        self.unsent = Unsent(self.members, self.committed)

    def streams(self) -> dict[str, dict[str, int]]:
        return {name: {"sample": i} for i, name in enumerate(self.members)}

    def ensemble_rows(self, member_logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """``member_logits [n, N, V]`` -> ensemble rows ``[N, V]`` (:meth:`EnsembleLaw.ensemble_rows`)."""
        return self.law.ensemble_rows(member_logits, generated)

    def _logprobs_of(self, tokens: Sequence[int], rows: torch.Tensor) -> list[DrawLogprob] | None:
        """Token ``i``'s log-probability under ``rows[i]`` (the ensemble law), when asked for."""
        return logprobs_under(self.logprobs, tokens, rows)

    def proposal_rows(self, logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """One member's ``logits [N, V]`` -> the rows it samples from (:meth:`EnsembleLaw.proposal_rows`)."""
        return self.law.proposal_rows(logits, generated)


def logprobs_under(count: int | None, tokens: Sequence[int], rows: torch.Tensor) -> list[DrawLogprob] | None:
    """Token ``i``'s log-probability under ``rows[i]`` with ``count`` alternatives; None when not asked for."""
    if count is None:
        return None
    return [token_logprob(row, token, count) for token, row in zip(tokens, rows)]


def plain_ensemble_draw(law: EnsembleLaw, results: Sequence[object], committed: Sequence[int],
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
        token, row = plain_ensemble_draw(self.law, results, self.committed, self.own_source)
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
        # gamma auto: each member's acceptance of its proposed tokens (per-member lengths)
        self.acceptance = [AdaptiveGamma(adaptive) for _ in self.members] if adaptive is not None else []
        self.chosen_gammas = list(self.gammas)  # the lengths of the last proposing iteration
        self.step_costs: Callable[[], StepCosts | None] | None = None
        self.plain_step = False  # this iteration is a plain ensemble step
        self.plain_steps = 0
        self.dropped_tokens = 0  # queued tokens dropped by plain steps

    def _step_costs(self) -> StepCosts | None:
        """gamma "auto": the step's costs (read once per iteration), else None."""
        if self.adaptive is None or self.step_costs is None:
            return None
        return self.step_costs()

    def _lengths(self, costs: StepCosts | None) -> list[int]:
        """The members' proposal lengths for this iteration: chosen from the measured calls and
        the members' acceptance (gamma "auto"), else the fixed ``gammas``."""
        if costs is None or not costs.member_call_s:
            return self.gammas
        chosen = best_alternate_gammas(self.members, [member.acceptance for member in self.acceptance],
                                       costs.member_call_s, self.adaptive.gamma_max, current=self.gammas)
        return chosen if chosen is not None else self.gammas

    def needs(self) -> list[Need]:
        costs = self._step_costs()
        self.plain_step = costs is not None and costs.mode == "plain"
        if self.plain_step:
            self.dropped_tokens += len(self.queue.tokens())
            self.queue.clear()  # unverified proposals dropped: decided without reading them
            self.pending_member = None
            return [NextLogits(name, self.unsent.take(name)) for name in self.members]
        queued = self.queue.tokens()
        room = self.max_new_tokens - len(self.committed) - len(queued)
        lengths = self.chosen_gammas = list(self._lengths(costs))
        if not self.queue.segments:
            self.proposer = default_proposer(lengths)
            member, count = self.proposer, min(lengths[self.proposer], room)
        else:
            member = next_scorer(self.queue.coverage())
            count = min(lengths[member], room) if room >= 1 else 0
        self.pending_member = member
        name = self.members[member]
        return [Extend(name, self.unsent.take(name), tuple(queued), count)]

    def consume(self, results: Sequence[object]) -> list[int]:
        if self.plain_step:
            self.plain_steps += 1
            token, row = plain_ensemble_draw(self.law, results, self.committed, self.own_source)
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
        if self.acceptance:
            self.acceptance[segment.producer].observe(length, int(verdict.num_accepted[0]))
        self.segment_lengths.append(length)
        self.proposers.append(segment.producer)
        if bool(verdict.fully_accepted[0]):
            self.queue.pop_first()
        else:
            self.queue.clear()
        emitted = verdict.emitted(0)
        return emitted, self._logprobs_of(emitted, ensemble_probs[: len(emitted)])
