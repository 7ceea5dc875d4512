"""A request inside the scheduler: :class:`RequestState` and its counters (:class:`StatsRecorder`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from actors.coordination.metrics import RequestClock, plan_labels
from actors.coordination.output import OutputTracker
from actors.coordination.plan import DecodingPlan
from actors.messages import CallTiming, OpenSession
from verifiers.machines.base import DecodeMachine


@dataclass
class StatsRecorder:
    """Per-request counters, turned into ``actors.request_schema.RequestStats`` at the end."""

    model_calls: dict[str, int] = field(default_factory=dict)
    time_draft_s: float = 0.0
    time_target_s: float = 0.0
    time_verify_s: float = 0.0
    bytes_moved: int = 0

    def count(self, model: str, timing: CallTiming) -> None:
        self.model_calls[model] = self.model_calls.get(model, 0) + timing.forward_calls


@dataclass
class RequestState:
    """One request inside the scheduler."""

    request_id: str
    session_id: str
    plan: DecodingPlan
    machine: DecodeMachine
    output: OutputTracker
    prompt_ids: list[int]
    opens: dict[str, OpenSession]  # model -> how to open its session (removed once opened)
    vocab_limit: int
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    stats: StatsRecorder = field(default_factory=StatsRecorder)
    opened: set[str] = field(default_factory=set)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    empty_iterations: int = 0
    last_needs: list = field(default_factory=list)
    pre_drafted: tuple[Any, int] | None = None  # (payloads of the call, index) of the last PreDraft
    cancelled: bool = False
    finished: bool = False
    prefilling: set[str] = field(default_factory=set)  # models whose session does not hold the prompt yet
    clock: RequestClock = field(default_factory=RequestClock)
    preempted: int = 0  # times its KV blocks did not fit and it went back to the waiting line
    grammar: Any = None  # the structured-output constraint (verifiers.grammar.GrammarConstraint), if any

    @property
    def labels(self) -> tuple[str, str]:
        """The request's metric labels: (strategy, method)."""
        return plan_labels(self.plan)


def board_key(request: RequestState) -> tuple:
    """A speculative request's key in the acceptance board: its pair (the members for an
    ensemble target), rule and drafts per step."""
    plan = request.plan
    return plan.draft, plan.target or plan.members, plan.method, plan.num_drafts
