"""Decoding strategies of the Coordinator, one class per ``actors.api.Strategy`` value.

Each strategy drives the ModelWorker actors of one request and returns, per ``step()``, the
tokens that became final (possibly none). It contains no verification math: verifiers come
from ``verifiers.registry.get_verifier`` (run inside the target worker, next to the target
rows), ensemble laws and segment verification from ``verifiers.ensemble``. Each strategy
reproduces a reference loop token for token with the same seed (``verifiers.reference`` /
``verifiers.reference_ensemble``) by giving every random stream of the reference's layout
(``verifiers.randomness.stream_seeds``) to the actor that makes those draws, and making the
same draws in the same order:

* ``ar``          -- ``autoregressive_generate``: stream 0 on the target worker.
* ``sd``          -- ``speculative_generate`` (token / block / greedy_block): stream 0 (drafting)
                     on the draft worker, stream 1 (verification) on the target worker.
* ``multi_draft`` -- ``speculative_generate`` with ``num_drafts=K`` (spectr / spectr_gbv): same
                     layout; the draft worker samples the K drafts in one batched forward per
                     step, the target scores the K x (gamma+1) positions in one forward.
* ``ensemble``    -- ``ensemble_autoregressive_generate``: the coordinator combines the members'
                     logits and draws from stream n.
* ``se``          -- ``ensemble_generate``: member i draws its proposals and bonus tokens from
                     stream i on its own worker; segments are verified in the coordinator
                     with stream n.

Probability rows move as ObjectRefs from the worker that makes them to the one that consumes
them: in ``sd`` / ``multi_draft`` the draft's Proposal ref goes straight to the target worker,
which verifies and returns only tokens. Ensemble strategies verify in the coordinator, which
is where the members' rows meet (they are float32 logits, the smallest exact form).

Stats: ``target_calls`` counts forward passes of the target (ar, sd, multi_draft); for the
ensemble strategies it is the call count of the busiest member (every member runs on its own
actor, so that is the critical path; the standard ensemble has one call per member per token,
hence block efficiency 1). ``model_calls`` has every model's forward passes, ``bytes_moved``
the bytes of probability rows / logits that travelled between actors.

Why the target verifies (measured, not assumed): with V = 4096, gamma = 4, two tiny Llamas on
this 2-core CPU, 6 interleaved requests of 64 tokens each, the median time per sd iteration was
26.9 ms with verification in the target worker (draft rows travel once, target rows never) and
29.4 ms with verification in the coordinator (draft rows and target rows both travel to it),
with identical tokens. The gap grows with V and gamma (bytes moved) and with K.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.messages import CallTiming, RowSampling
from actors.plan import DecodingPlan
from verifiers.ensemble import default_proposer, make_ensemble, member_probs, next_scorer, verify_segment
from verifiers.randomness import TorchRandomSource, stream_seeds
from verifiers.types import PAD_TOKEN

AR_TOKENS_PER_CALL = 4  # ar: tokens sampled per worker call (streaming granularity vs call overhead)


@dataclass
class StatsRecorder:
    """Per-request counters, turned into ``actors.api.RequestStats`` at the end."""

    model_calls: dict[str, int] = field(default_factory=dict)
    target_calls: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    time_draft_s: float = 0.0
    time_target_s: float = 0.0
    time_verify_s: float = 0.0
    bytes_moved: int = 0

    def count(self, model: str, timing: CallTiming) -> None:
        self.model_calls[model] = self.model_calls.get(model, 0) + timing.forward_calls


@dataclass
class RunContext:
    """Everything a strategy needs for one request."""

    session_id: str
    plan: DecodingPlan
    workers: dict[str, Any]  # model name -> ModelWorker actor handle
    sampling: RowSampling
    seed: int
    prompt_ids: list[int]
    max_new_tokens: int
    max_context: int
    stats: StatsRecorder

    def worker(self, model: str) -> Any:
        return self.workers[model]


class StrategyRun(ABC):
    """One request decoded with one strategy."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.committed: list[int] = []  # tokens made final so far (as the reference emits them)

    @abstractmethod
    def session_streams(self) -> dict[str, dict[str, int]]:
        """Model name -> the seeds of the random streams its session owns (every model the
        strategy calls gets a session, possibly with no stream)."""

    @abstractmethod
    async def step(self) -> list[int]:
        """Advance; return the tokens that became final in this step (may be empty)."""

    def context_length(self) -> int:
        return len(self.ctx.prompt_ids) + len(self.committed)

    def lookahead(self, block: int) -> int:
        """Clip a block so no position passes the model context (only near the very end of
        the context; the reference loops have no context limit)."""
        return max(1, min(block, self.ctx.max_context - self.context_length()))


class AutoregressiveRun(StrategyRun):
    """``ar``: the target alone, ``AR_TOKENS_PER_CALL`` tokens per call, one draw per token."""

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.target = ctx.plan.target
        self.unsent: list[int] = []

    def session_streams(self) -> dict[str, dict[str, int]]:
        (sample_seed,) = stream_seeds(self.ctx.seed, 1)
        return {self.target: {"sample": sample_seed}}

    async def step(self) -> list[int]:
        remaining = self.ctx.max_new_tokens - len(self.committed)
        count = self.lookahead(min(AR_TOKENS_PER_CALL, max(1, remaining)))
        proposal = await self.ctx.worker(self.target).propose.remote(
            self.ctx.session_id, self.unsent, count, 1, False, "sample"
        )
        tokens = proposal.tokens[0].tolist()
        self.unsent = tokens
        self.committed.extend(tokens)
        stats = self.ctx.stats
        stats.count(self.target, proposal.timing)
        stats.target_calls += proposal.timing.forward_calls
        stats.time_target_s += proposal.timing.forward_s
        return tokens


class SpeculativeRun(StrategyRun):
    """``sd`` and ``multi_draft``: the draft proposes K x gamma tokens in one call; its Proposal
    ObjectRef goes straight to the target worker, which scores and verifies it there."""

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        plan = ctx.plan
        self.draft, self.target = plan.draft, plan.target
        self.draft_unsent: list[int] = []

    def session_streams(self) -> dict[str, dict[str, int]]:
        draft_seed, verify_seed = stream_seeds(self.ctx.seed, 2)
        return {self.draft: {"sample": draft_seed}, self.target: {"verify": verify_seed}}

    async def step(self) -> list[int]:
        plan, ctx = self.ctx.plan, self.ctx
        gamma = self.lookahead(plan.gamma)
        proposal_ref = ctx.worker(self.draft).propose.remote(
            ctx.session_id, self.draft_unsent, gamma, plan.num_drafts, True, "sample"
        )
        outcome = await ctx.worker(self.target).score_and_verify.remote(ctx.session_id, [], proposal_ref, plan.method)
        self.draft_unsent = outcome.emitted
        self.committed.extend(outcome.emitted)
        stats = ctx.stats
        stats.count(self.draft, outcome.proposal_timing)
        stats.count(self.target, outcome.timing)
        stats.target_calls += outcome.timing.forward_calls
        stats.accepted_lengths.append(outcome.num_accepted)
        stats.time_draft_s += outcome.proposal_timing.forward_s
        stats.time_target_s += outcome.timing.forward_s
        stats.time_verify_s += outcome.timing.verify_s
        stats.bytes_moved += outcome.bytes_moved
        return outcome.emitted


class _EnsembleRunBase(StrategyRun):
    """Shared parts of the ensemble strategies: members, ensemble function, verify stream."""

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        plan = ctx.plan
        self.members = list(plan.members)
        self.function = make_ensemble(plan.ensemble, len(self.members), weights=plan.weights, mu=plan.mu)
        seeds = stream_seeds(ctx.seed, len(self.members) + 1)
        self.member_seeds = seeds[:-1]
        self.verify_source = TorchRandomSource(torch.Generator().manual_seed(seeds[-1]))
        self.synced = [0] * len(self.members)  # committed tokens each member's session has seen

    def session_streams(self) -> dict[str, dict[str, int]]:
        return {name: {"sample": seed} for name, seed in zip(self.members, self.member_seeds)}

    def unsent(self, member: int) -> list[int]:
        tokens = self.committed[self.synced[member]:]
        self.synced[member] = len(self.committed)
        return tokens

    def ensemble_rows(self, member_logits: torch.Tensor) -> torch.Tensor:
        """``member_logits [n, ..., V]`` -> ensemble rows ``[..., V]`` (verifiers.ensemble)."""
        s = self.ctx.sampling
        return self.function.probs(member_logits.to(torch.float64), temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

    def proposal_rows(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.ctx.sampling
        return member_probs(logits.to(torch.float64), temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


class EnsembleRun(_EnsembleRunBase):
    """``ensemble``: every member scores every token; the coordinator draws from the ensemble
    row with stream n (the standard ensemble, baseline of ``se``)."""

    async def step(self) -> list[int]:
        ctx = self.ctx
        results = await asyncio.gather(
            *(ctx.worker(name).next_logits.remote(ctx.session_id, self.unsent(i)) for i, name in enumerate(self.members))
        )
        started = time.perf_counter()
        member_logits = torch.stack([logits.to(torch.float64) for logits, _ in results])  # [n, V]
        row = self.ensemble_rows(member_logits)  # [V]
        token = int(self.verify_source.categorical(row))
        stats = ctx.stats
        stats.time_verify_s += time.perf_counter() - started
        for name, (logits, timing) in zip(self.members, results):
            stats.count(name, timing)
            stats.time_target_s += timing.forward_s
            stats.bytes_moved += logits.numel() * logits.element_size()
        stats.target_calls = max(stats.model_calls.values())
        self.committed.append(token)
        return [token]


@dataclass
class _Segment:
    producer: int
    tokens: list[int]


class SpeculativeEnsembleRun(_EnsembleRunBase):
    """``se``: the alternate proposal framework (2 members) / n-model chain of
    ``verifiers.reference_ensemble.ensemble_generate``, with the members on their own workers.

    State (as in the reference): a queue of unverified segments, each drawn by one member, and
    per member the logits rows it computed for a prefix of the queue (its coverage). One step =
    one member call (the default proposer proposing into an empty queue, or the member with the
    least coverage scoring the queue, drawing its bonus token and proposing after it, all in
    ONE worker call), then every verifiable segment is verified here with stream n.
    """

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.gammas = list(ctx.plan.gammas)
        self.proposer = default_proposer(self.gammas)
        self.segments: list[_Segment] = []
        self.member_rows: list[list[torch.Tensor]] = [[] for _ in self.members]  # logits [V] per queued position

    def queued(self) -> list[int]:
        return [t for segment in self.segments for t in segment.tokens]

    async def step(self) -> list[int]:
        queued = self.queued()
        room = self.ctx.max_new_tokens - len(self.committed) - len(queued)
        if not self.segments:
            member, count = self.proposer, min(self.gammas[self.proposer], room)
        else:
            member = next_scorer([len(rows) for rows in self.member_rows])
            count = min(self.gammas[member], room) if room >= 1 else 0
        await self._member_call(member, queued, count)
        committed: list[int] = []
        while self._first_segment_verifiable():
            committed.extend(self._verify_first_segment())
        self.committed.extend(committed)
        return committed

    async def _member_call(self, member: int, queued: list[int], count: int) -> None:
        ctx = self.ctx
        name = self.members[member]
        block = await ctx.worker(name).extend.remote(ctx.session_id, self.unsent(member), queued, count, "sample")
        covered = len(self.member_rows[member])
        self.member_rows[member].extend(block.queued_logits[covered:])  # rows at queued positions
        if count:
            self.segments.append(_Segment(member, block.tokens.tolist()))
            self.member_rows[member].extend(block.token_logits)
        stats = ctx.stats
        stats.count(name, block.timing)
        stats.bytes_moved += block.nbytes
        if queued:
            stats.time_target_s += block.timing.forward_s
        else:
            stats.time_draft_s += block.timing.forward_s
        stats.target_calls = max(stats.model_calls.values())

    def _first_segment_verifiable(self) -> bool:
        return bool(self.segments) and min(len(rows) for rows in self.member_rows) >= len(self.segments[0].tokens)

    def _verify_first_segment(self) -> list[int]:
        started = time.perf_counter()
        segment = self.segments[0]
        length = len(segment.tokens)
        member_logits = torch.stack([torch.stack(rows[:length]) for rows in self.member_rows]).to(torch.float64)  # [n, g, V]
        proposal_probs = self.proposal_rows(member_logits[segment.producer])  # [g, V]
        ensemble_probs = self.ensemble_rows(member_logits)  # [g, V]
        next_token = self.segments[1].tokens[0] if len(self.segments) > 1 else PAD_TOKEN
        verdict = verify_segment(
            torch.tensor([segment.tokens], dtype=torch.int64),  # [1, g]
            proposal_probs.unsqueeze(0),  # [1, g, V]
            ensemble_probs.unsqueeze(0),  # [1, g, V]
            torch.tensor([next_token], dtype=torch.int64),  # [1]
            method=self.ctx.plan.method,
            generator=self.verify_source,
        )
        if bool(verdict.fully_accepted[0]):
            self.segments.pop(0)
            self.member_rows = [rows[length:] for rows in self.member_rows]
        else:
            self.segments = []
            self.member_rows = [[] for _ in self.members]
        self.ctx.stats.accepted_lengths.append(int(verdict.num_accepted[0]))
        self.ctx.stats.time_verify_s += time.perf_counter() - started
        return verdict.emitted(0)


#: The strategy registry: ``actors.api.Strategy`` value -> implementation.
STRATEGIES: dict[str, type[StrategyRun]] = {
    "ar": AutoregressiveRun,
    "sd": SpeculativeRun,
    "multi_draft": SpeculativeRun,
    "ensemble": EnsembleRun,
    "se": SpeculativeEnsembleRun,
}
