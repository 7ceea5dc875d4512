"""Plain data that moves between the actors of one model group (never to clients).

Probability rows travel inside :class:`Proposal` from the proposing worker straight to the
worker that verifies them (the coordinator forwards the ObjectRef, not the array), so the
coordinator only ever sees token ids, counts and timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RowSampling:
    """How a worker turns its logits into the rows it samples from / verifies against.

    ``vocab_limit`` is the vocabulary shared by every model of the group: logits past it are
    dropped before ``verifiers.sampling.logits_to_probs`` (models of one family may pad their
    embedding tables differently; the extra ids are never produced).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    vocab_limit: int | None = None


@dataclass(frozen=True)
class WorkerInfo:
    """What a ModelWorker reports about itself."""

    name: str
    role: str
    vocab_size: int
    max_context: int
    device: str
    gpu_ids: tuple[Any, ...] = ()
    node_id: str = ""
    pid: int = 0


@dataclass(frozen=True)
class CallTiming:
    """Where one worker call spent its time (seconds) and how much model work it did."""

    forward_s: float = 0.0
    verify_s: float = 0.0
    forward_calls: int = 0
    tokens_fed: int = 0


@dataclass(frozen=True)
class Proposal:
    """Tokens a worker sampled and what they were sampled from.

    tokens: [K, n] int64 -- K drafts (K = 1 for single-draft), n tokens each.
    logits: [K, n, V] or None -- the logits (shared vocabulary, model dtype) whose row
            ``logits_to_probs(logits[k, i], <request sampling>)`` token i of draft k was drawn
            from. The consumer recomputes those rows exactly with the same transform, so the
            logits are the smallest exact form of the rows (float32 for transformers models:
            half the bytes of float64 rows).
    """

    model: str
    tokens: torch.Tensor
    logits: torch.Tensor | None
    timing: CallTiming = field(default_factory=CallTiming)

    @property
    def nbytes(self) -> int:
        return 0 if self.logits is None else self.logits.numel() * self.logits.element_size()


@dataclass(frozen=True)
class VerifyOutcome:
    """What the verifying worker decided for one block (rows stay with the workers).

    emitted: the accepted draft prefix plus the correction-or-bonus token (num_accepted + 1
    tokens), already committed to the verifier's session context.
    """

    emitted: list[int]
    num_accepted: int
    draft_index: int | None
    timing: CallTiming
    proposal_timing: CallTiming
    bytes_moved: int


@dataclass(frozen=True)
class MemberBlock:
    """One ensemble member's call: its logits at queued (unverified) positions, then the tokens
    it drew after the queue and the logits they were drawn from.

    queued_logits: [Q, V] -- row j is the member's logits after context + queued[:j].
    tokens:        [m] int64 -- drawn after the queue (the first from the row after the queue).
    token_logits:  [m, V] -- row i is the logits token i was drawn from (through
                   ``logits_to_probs`` with the request's sampling parameters).
    Logits keep the model's dtype (float32 for transformers models: the smallest exact form).
    """

    model: str
    queued_logits: torch.Tensor
    tokens: torch.Tensor
    token_logits: torch.Tensor
    timing: CallTiming = field(default_factory=CallTiming)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.queued_logits, self.token_logits))


@dataclass(frozen=True)
class OpenSession:
    """Open a session on first use: the prompt, how rows are made, the seeds of the random
    streams this worker owns for the request (``verifiers.randomness.stream_seeds``)."""

    prompt_ids: tuple[int, ...]
    sampling: RowSampling
    seeds: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkItem:
    """One request's need (:mod:`verifiers.machines`) for one worker step.

    open: set on the request's first item on this worker (the session is opened, then the need
    runs; the prompt's prefill is the need's first row). proposal_source: for a ScoreVerify,
    ``(i, j)``: the proposal is item j's payload of the i-th source step passed to the call.
    """

    session_id: str
    need: Any
    open: OpenSession | None = None
    proposal_source: tuple[int, int] | None = None


@dataclass(frozen=True)
class ItemOutcome:
    """What one work item produced: a value (see each need's result type) or an error
    message (the item's session was freed), and the step's timing for it."""

    value: Any = None
    timing: CallTiming = field(default_factory=CallTiming)
    error: str | None = None
