"""The tasks of a worker step that score a proposal on this model.

:class:`ScoreVerifyTask`: verification runs here, next to the target rows (only tokens travel
back), with the registry's rule; single-draft blocks of many requests with one rule and block
length are verified in ONE call (:func:`verify_together`). :class:`ScoreBlockTask`: the rows go
back to the machine, which verifies (an ensemble member).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from actors.model.batch import RowWork, RunAttend
from actors.worker.rows import RowRequest, row_dtype, shared_vocab
from actors.worker.sessions import Session
from actors.worker.tasks import Task
from verifiers.blocks import block_inputs, block_key, verified_row, verify_blocks
from verifiers.machines.needs import MODEL_FREE, Sampled, ScoreBlock, ScoreVerify, Verified
from verifiers.proposers import one_hot_rows
from verifiers.registry import get_verifier


def columns_of(*runs: tuple[int, ...]) -> tuple[int, ...]:
    """The columns of several runs, in order."""
    return tuple(column for run in runs for column in run)


class ScoreVerifyTask(Task):
    """:class:`ScoreVerify`: ONE row with the pending tokens and the K draft chains after them,
    then the registry verifier on ``[K, gamma+1]`` target rows; the emitted tokens are
    committed to the session."""

    def __init__(self, session: Session, pending: list[int], need: ScoreVerify, proposal: Sampled):
        super().__init__(session, pending)
        if proposal is None or (proposal.logits is None and need.draft_need != MODEL_FREE):
            raise ValueError("verification needs the proposal's logits")
        self.need, self.proposal = need, proposal
        self.spec = get_verifier(need.method)
        self.source = session.source(need.stream)
        self.result: Verified | None = None
        #: Once the rows are taken and until verified: (draft tokens, draft rows, target rows) in
        #: the rule's batch layout (``[1, gamma]``, ``[1, gamma, V]``, ``[1, gamma+1, V]`` single-draft);
        #: the draft rows None while carried ones wait to be put together (:attr:`draft_rows`).
        self.inputs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        self.draft_rows: tuple[torch.Tensor, ...] | None = None  # carried (row_requests), one [K, V] per position

    @property
    def active(self) -> bool:
        return self.result is None and self.inputs is None

    def row(self) -> RowWork:
        session, pending = self.session, self.pending
        drafts = self.proposal.tokens.tolist()  # [K][gamma]
        gamma = len(drafts[0])
        base, chain_start = session.base, session.base + len(pending)
        pending_columns = tuple(range(base, chain_start))
        chain_columns = tuple(range(chain_start, chain_start + len(drafts) * gamma))  # chain k at chain_start + k * gamma
        chain_firsts = [chain_start + k * gamma for k in range(len(drafts)) for _ in range(gamma)]
        # The pending tokens see themselves causally; a chain token sees every pending token, then its chain.
        attend = RunAttend(
            first_start=[base] * len(columns_of(pending_columns, chain_columns)),
            first_end=[c + 1 for c in pending_columns] + [chain_start] * len(chain_columns),
            second_start=[0] * len(pending_columns) + chain_firsts,
            second_end=[0] * len(pending_columns) + [c + 1 for c in chain_columns],
        )
        return RowWork(
            slot=session.slot,
            prefix_length=base,
            token_ids=tuple(pending) + tuple(t for draft in drafts for t in draft),
            columns=pending_columns + chain_columns,
            positions=pending_columns + tuple(chain_start + j for _ in drafts for j in range(gamma)),
            attend=attend,
            keep=(len(pending) - 1,) + tuple(range(len(pending), len(pending) + len(chain_columns))),
        )

    def take(self, logits: torch.Tensor) -> None:
        """The target rows and the draft's rows of the block (each made alone), then
        :meth:`rows_taken`."""
        requests = self.row_requests(logits)
        started = time.perf_counter()
        rows = [request.alone() for request in requests]
        self.verify_s += time.perf_counter() - started
        self.rows_taken(rows)

    def row_requests(self, logits: torch.Tensor) -> list[RowRequest]:
        """The first half of :meth:`take`: the rows to make from this row's ``logits [1 + K*gamma, V]``
        (the engine makes every task's of a step together, :func:`actors.worker.rows.rows_together`):
        the target's ``[K, gamma+1, V]``, then, unless the proposal is model-free or carries the rows
        it was drawn from (:meth:`carried_rows`), the draft's ``[K, gamma, V]``, recomputed bit for bit
        from its logits by the same transform it sampled with (same request sampling parameters and
        penalty contexts, same code)."""
        session = self.session
        drafts = self.proposal.tokens.tolist()  # [K][gamma]
        num_drafts, gamma = len(drafts), len(drafts[0])
        self._pending_fed()
        if num_drafts == 1:  # the first row, then the chain's: the block's rows as they are
            target_logits = logits.reshape(1, gamma + 1, -1)  # [1, gamma+1, V]
        else:
            first = logits[:1].expand(num_drafts, 1, -1)  # [K, 1, V]: every draft's first row
            chained = logits[1:].reshape(num_drafts, gamma, -1)  # [K, gamma, V]
            target_logits = torch.cat([first, chained], dim=1)  # [K, gamma+1, V]
        requests = [RowRequest(session, target_logits, [draft[:j] for draft in drafts for j in range(gamma + 1)])]
        self.draft_rows = self.carried_rows()  # read by rows_taken: carried rows, or the draft's made here
        if self.proposal.logits is not None and self.draft_rows is None:
            requests.append(RowRequest(session, self.proposal.logits, [draft[:j] for draft in drafts for j in range(gamma)]))
        return requests

    def carried_rows(self) -> tuple[torch.Tensor, ...] | None:
        """The draft's rows as its proposal carries them (drawn in this process: :attr:`Sampled.rows`,
        ``gamma`` rows ``[K, V]``, one per position), where they are the rows :meth:`row_requests`
        would make from its logits (same precision and vocabulary: the same transform of the same
        logits); else None."""
        rows, logits = self.proposal.rows, self.proposal.logits
        if rows is None or logits is None or len(rows) != logits.shape[1]:
            return None
        shape, dtype = (logits.shape[0], shared_vocab(self.session, logits).shape[-1]), row_dtype(self.session.sampling.precision)
        if any(row.dtype != dtype or tuple(row.shape) != shape for row in rows):
            return None
        return tuple(rows)

    def rows_taken(self, rows: list[torch.Tensor]) -> None:
        """The second half of :meth:`take`: ``rows`` (those of :meth:`row_requests`) into the rule's
        inputs; a rule the engine verifies for many requests at once (:attr:`batch_key`) waits for
        :func:`verify_together`, any other is verified here."""
        started = time.perf_counter()
        target_probs = rows[0]  # [K, gamma+1, V]
        if self.proposal.logits is None:  # a model-free proposal: one-hot rows
            draft_probs = one_hot_rows(self.proposal.tokens.to(target_probs.device), target_probs.shape[-1],
                                       target_probs.dtype)  # [K, gamma, V]
        elif self.draft_rows is None:
            draft_probs = rows[1]  # [K, gamma, V]
        else:  # carried (row_requests): put together once, by verify_together for a batched rule
            draft_probs = None if block_key(self.need.method, self.spec, (self.proposal.tokens,)) else self.stacked_draft_rows()
        self.inputs = block_inputs(self.spec, self.proposal.tokens, draft_probs, target_probs)
        self.verify_s += time.perf_counter() - started
        if self.batch_key is None:
            self.verify_alone()

    @property
    def batch_key(self) -> tuple[str, int] | None:
        """Requests whose blocks one verifier call takes together: a stateless single-draft rule
        (token, block) and the block length; None: verified alone (multi-draft and greedy rules)."""
        if self.inputs is None:
            return None
        return block_key(self.need.method, self.spec, self.inputs)

    def verify_alone(self) -> None:
        """Verify this block by itself on the request's verification stream, and commit."""
        self.finish(*self.verified_alone())

    def stacked_draft_rows(self) -> torch.Tensor:
        """The carried draft rows (:meth:`carried_rows`) as one ``[K, gamma, V]`` tensor."""
        return torch.stack(self.draft_rows, dim=1)

    def verified_alone(self) -> tuple[Any, int]:
        """The verifier's result of this block by itself (on the request's verification stream)
        and its row in it, to :meth:`finish`."""
        started = time.perf_counter()
        if self.inputs[1] is None:
            self.inputs = block_inputs(self.spec, self.inputs[0], self.stacked_draft_rows(), self.inputs[2])
        result = verify_blocks(self.spec, [self.inputs], [self.source], state=self.session.verify_state)
        self.verify_s += time.perf_counter() - started
        return result, 0

    def finish(self, result: Any, row: int) -> None:
        """Take batch row ``row`` of the verifier's ``result``: commit the emitted tokens."""
        session = self.session
        draft_tokens = self.proposal.tokens  # [K, gamma]
        session.verify_state = result.state
        self.result = verified_row(self.spec, self.inputs, result, row, self.need.logprobs)
        session.chain_start, session.chain_stride = session.base, draft_tokens.shape[-1]
        session.chains = draft_tokens.tolist()
        session.context.extend(self.result.emitted)
        self.inputs, self.draft_rows = None, None

    def outcome(self) -> tuple[Any, Any]:
        return self.result, None


class ScoreBlockTask(ScoreVerifyTask):
    """:class:`ScoreBlock`: the row of :class:`ScoreVerifyTask` (pending tokens, then the K
    chains of the block's first ``gamma`` tokens), and the logits ``[K, gamma+1, V]`` back to the
    machine, which verifies (an ensemble member); the chains stay fed, uncommitted."""

    def __init__(self, session: Session, pending: list[int], need: ScoreBlock, proposal: Sampled):
        Task.__init__(self, session, pending)
        if proposal is None:
            raise ValueError("scoring needs the proposal's tokens")
        self.need = need
        self.proposal = Sampled(proposal.tokens[:, : need.gamma])  # [K, gamma]
        self.logits: torch.Tensor | None = None
        self.result = None  # nothing to verify here

    @property
    def active(self) -> bool:
        return self.logits is None

    def take(self, logits: torch.Tensor) -> None:
        session = self.session
        draft_tokens = self.proposal.tokens  # [K, gamma]
        num_drafts, gamma = draft_tokens.shape
        self._pending_fed()
        first = logits[:1].expand(num_drafts, 1, -1)  # [K, 1, V]: every draft's first row
        chained = logits[1:].reshape(num_drafts, gamma, -1)  # [K, gamma, V]
        self.logits = shared_vocab(session, torch.cat([first, chained], dim=1)).clone()  # [K, gamma+1, V]
        session.chain_start, session.chain_stride = session.base, gamma
        session.chains = draft_tokens.tolist()

    @property
    def batch_key(self) -> None:
        return None

    def outcome(self) -> tuple[Any, Any]:
        return self.logits, None


def verify_together(tasks: Sequence[ScoreVerifyTask]) -> list[tuple[Any, int]]:
    """ONE verifier call for the blocks of many requests with the same rule and block length
    (their :attr:`ScoreVerifyTask.batch_key`): rows stacked ``[B, gamma]`` / ``[B, gamma, V]`` /
    ``[B, gamma+1, V]``, each row drawing from its own request's verification stream
    (:func:`verifiers.blocks.verify_blocks`: the draws a call of batch 1 would make), so every
    request gets the tokens it would get verified alone. Returns each task's (result, row), to
    :meth:`ScoreVerifyTask.finish`; the call's time is shared evenly."""
    if len(tasks) == 1:
        return [tasks[0].verified_alone()]
    started = time.perf_counter()
    if any(task.inputs[1] is None for task in tasks):
        draft_rows_together(tasks)
    result = verify_blocks(tasks[0].spec, [task.inputs for task in tasks], [task.source for task in tasks])
    share = (time.perf_counter() - started) / len(tasks)
    for task in tasks:
        task.verify_s += share
    return [(result, row) for row in range(len(tasks))]


def draft_rows_together(tasks: Sequence[ScoreVerifyTask]) -> None:
    """The draft rows of single-draft blocks verified together, in ONE ``[B, gamma, V]`` tensor
    (carried rows copied in once, position by position), each task's a view of its batch row, so
    :func:`verifiers.blocks.verify_blocks` stacks them without another copy."""
    first = tasks[0].inputs[2]  # [1, gamma+1, V]
    if any(task.inputs[2].dtype != first.dtype or (task.inputs[1] is not None and task.inputs[1].dtype != first.dtype)
           for task in tasks):  # rows of another precision: each block's own
        for task in tasks:
            if task.inputs[1] is None:
                task.inputs = (task.inputs[0], task.stacked_draft_rows(), task.inputs[2])
        return
    together = torch.empty(len(tasks), first.shape[1] - 1, first.shape[2], dtype=first.dtype)  # [B, gamma, V]
    for b, task in enumerate(tasks):
        if task.inputs[1] is None:
            for position, row in enumerate(task.draft_rows):  # [1, V] each
                together[b, position].copy_(row[0])
        else:
            together[b].copy_(task.inputs[1][0])
        task.inputs = (task.inputs[0], together[b: b + 1], task.inputs[2])
