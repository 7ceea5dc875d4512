"""A request's statistics: the counting of each step's outcomes into the request's
:class:`actors.coordination.request_state.StatsRecorder` (:func:`record_outcomes`) and the
:class:`actors.request_schema.RequestStats` its final chunk carries (:func:`request_stats`)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from actors.request_schema import RequestStats
from actors.coordination.plan import ALTERNATE, ENSEMBLE_STRATEGIES
from actors.coordination.request_state import RequestState
from actors.messages import ItemOutcome
from verifiers.machines.needs import Extend, NextLogits, PreDraft, Sample, ScoreBlock
from verifiers.machines.speculative import SpeculativeMachine

logger = logging.getLogger(__name__)


def record_outcomes(request: RequestState, outcomes: list[ItemOutcome]) -> None:
    """Count a decoding step's outcomes of ``request`` (one per need of ``request.last_needs``):
    calls per model, seconds by role (draft, target, verification), bytes moved."""
    stats, plan = request.stats, request.plan
    for outcome in outcomes:
        stats.time_verify_s += outcome.timing.verify_s
    for need, outcome in zip(request.last_needs, outcomes):
        stats.count(need.model, outcome.timing)
        if isinstance(need, Sample) and need.model != plan.target:  # a draft (plain steps sample on the target)
            stats.time_draft_s += outcome.timing.forward_s
            if need.return_logits or need.report_logits:
                stats.bytes_moved += need.count * need.num_drafts * request.vocab_limit * 4
        elif isinstance(need, PreDraft):
            stats.time_draft_s += outcome.timing.forward_s
            stats.bytes_moved += need.count * need.guesses * request.vocab_limit * 4
        elif isinstance(need, Extend) and not need.queued:
            stats.time_draft_s += outcome.timing.forward_s
            stats.bytes_moved += _nbytes(outcome.value)
        else:
            stats.time_target_s += outcome.timing.forward_s
            if isinstance(need, (Extend, NextLogits, ScoreBlock)):
                stats.bytes_moved += _nbytes(outcome.value)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    tensors = [getattr(value, name, None) for name in ("queued_logits", "token_logits")]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def stats_or_none(request: RequestState) -> RequestStats | None:
    """The request's stats for its final chunk, or None (logged) when computing them fails: a
    request's final chunk (its output, or its error) must reach its stream whatever its stats do,
    or the stream would wait for ever."""
    try:
        return request_stats(request)
    except Exception:  # reporting only: the output is delivered without it
        logger.exception("request %s: its statistics could not be computed; sent without them", request.session_id)
        return None


def request_stats(request: RequestState) -> RequestStats:
    """The request's :class:`RequestStats` so far."""
    stats, plan, output = request.stats, request.plan, request.output
    completion = len(output.token_ids)
    if plan.strategy in ENSEMBLE_STRATEGIES:  # the verifying calls: the members' (a draft proposer's are drafts)
        drafted = plan.strategy == "se" and plan.proposer != ALTERNATE
        scorers = [name for name in plan.members if not drafted or name != plan.proposer]
        target_calls = max((stats.model_calls.get(name, 0) for name in scorers), default=0)
    else:
        target_calls = stats.model_calls.get(plan.target, 0)
    elapsed = time.perf_counter() - (request.started or request.submitted)
    work = stats.time_draft_s + stats.time_target_s + stats.time_verify_s
    return RequestStats(
        strategy=plan.strategy,
        method=plan.method,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=completion,
        target_calls=target_calls,
        model_calls=dict(stats.model_calls),
        accepted_lengths=list(request.machine.accepted_lengths),
        draft_lengths=list(getattr(request.machine, "draft_lengths", ())),
        pre_drafted=getattr(request.machine, "pre_drafted_iterations", 0),
        block_efficiency=completion / target_calls if target_calls else 0.0,
        proposer=plan.proposer if plan.strategy in ("sd", "se") else None,
        tokens_per_second=completion / elapsed if elapsed > 0 else 0.0,
        time_draft_s=stats.time_draft_s,
        time_target_s=stats.time_target_s,
        time_verify_s=stats.time_verify_s,
        time_coordination_s=max(0.0, elapsed - work),
        bytes_moved=stats.bytes_moved,
        **proposer_counts(request.machine),
    )


def proposer_counts(machine: Any) -> dict[str, dict[str, int]]:
    """``proposed_tokens`` / ``accepted_proposed`` of the machine's model-free proposers, by name."""
    if not isinstance(machine, SpeculativeMachine) or not machine.proposers:
        return {"proposed_tokens": {}, "accepted_proposed": {}}
    names = [proposer.name for proposer in machine.proposers]
    return {"proposed_tokens": dict(zip(names, machine.proposed_tokens)),
            "accepted_proposed": dict(zip(names, machine.accepted_proposed))}
