"""The tasks of a worker step that feed a session and draw from it.

Each work item of a step (:mod:`actors.worker.engine`) is a small task (:class:`Task`) that says
which row it needs in the next forward and takes that row's logits. Draws use the session's own
random streams in the order the machine's contract states, so a request's tokens do not depend on
its neighbours. The tasks that score a proposal (and verify it) are in :mod:`actors.worker.verify_tasks`.

Chunked prefill: a :class:`PrefillTask` feeds the next chunk of a new session's prompt, as an
ordinary causal row at the session's own columns and positions, so the keys/values it writes are
those a one-shot prefill writes; the prompt's last token stays pending, and the decoding machine's
first need computes the row after the prompt once the whole prompt is cached.
"""

from __future__ import annotations

from typing import Any

import torch

from actors.messages import Prefill, PrefillProgress
from actors.model.batch import RowWork, RunAttend, linear_row
from actors.worker.rows import RowRequest, session_rows, shared_vocab
from actors.worker.sessions import Session
from verifiers.machines.needs import Extend, MemberBlock, NextLogits, PreDraft, PreDrafted, Sample, Sampled, bonus_guesses
from verifiers.sampling import token_logprob


class Task:
    """One work item in progress: rows to feed, then a result."""

    def __init__(self, session: Session, pending: list[int]):
        self.session = session
        self.pending = pending
        self.forwards = 0
        self.tokens_fed = 0
        self.verify_s = 0.0
        self.prompt_positions = 0  # prompt positions whose logits to keep in the first forward
        self.prompt_logits: torch.Tensor | None = None  # [prompt_positions, V] once taken

    @property
    def active(self) -> bool:
        """Whether the task needs a row in the next forward."""
        raise NotImplementedError

    def row(self) -> RowWork:
        raise NotImplementedError

    def take(self, logits: torch.Tensor) -> None:
        """Consume the kept logits ``[len(row.keep), V]`` of the last row."""
        raise NotImplementedError

    def outcome(self) -> tuple[Any, Any]:
        """(summary for the scheduler, payload for a dependent need or None)."""
        raise NotImplementedError

    def _feed_pending(self) -> RowWork:
        """The pending tokens as a linear row keeping the last position."""
        session = self.session
        return linear_row(session.slot, session.base, self.pending, session.base, keep=[len(self.pending) - 1])

    def _pending_fed(self) -> None:
        self.session.base += len(self.pending)
        self.pending = []


class SampleTask(Task):
    """:class:`Sample`: the pending tokens, then one forward per further draft position with the
    K chains' newest tokens (each seeing only its own chain)."""

    def __init__(self, session: Session, pending: list[int], need: Sample):
        super().__init__(session, pending)
        self.need = need
        self.drafts: list[list[int]] = [[] for _ in range(need.num_drafts)]
        self.position_logits: list[torch.Tensor] = []
        self.position_rows: list[torch.Tensor] = []  # [K, V] each: what the payload's tokens were drawn from
        self.logprobs: list = []  # draft 0's draws, when the need asks for them
        self.source = session.source(need.stream)

    @property
    def active(self) -> bool:
        return len(self.drafts[0]) < self.need.count

    def row(self) -> RowWork:
        if self.pending:
            return self._feed_pending()
        session, depth = self.session, len(self.drafts[0]) - 1  # feed draft token `depth` of each chain
        stride = self.need.count - 1
        columns = [session.base + k * stride + depth for k in range(self.need.num_drafts)]
        return RowWork(
            slot=session.slot,
            prefix_length=session.base,
            token_ids=tuple(draft[depth] for draft in self.drafts),
            columns=tuple(columns),
            positions=(session.base + depth,) * len(columns),
            attend=RunAttend([c - depth for c in columns], [c + 1 for c in columns]),  # each its own chain
            keep=tuple(range(len(columns))),
        )

    def take(self, logits: torch.Tensor) -> None:
        rows = self.rows_to_draw(logits)
        self.drawn(rows, self.source.categorical(rows))

    def rows_to_draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The first half of :meth:`take`: this position's rows ``[K, V]`` (float64), to be drawn
        from :attr:`source` (the engine draws every sampling task of a forward together,
        :func:`verifiers.randomness.categorical_together`); then :meth:`drawn`."""
        return self.row_request(logits).alone()

    def row_request(self, logits: torch.Tensor) -> RowRequest:
        """The rows :meth:`rows_to_draw` makes, as a request (the engine makes every task's of a
        forward together, :func:`actors.worker.rows.rows_together`)."""
        if self.pending:
            self._pending_fed()
            logits = logits.expand(self.need.num_drafts, -1)  # [K, V]: the K drafts share the first row
        logits = shared_vocab(self.session, logits)  # [K, V]
        if self.need.return_logits or self.need.report_logits:
            self.position_logits.append(logits)
        # A block the machine verifies itself: drawn from float64 rows, which it recomputes so.
        dtype = torch.float64 if self.need.report_logits else None
        return RowRequest(self.session, logits, [list(draft) for draft in self.drafts], dtype)  # rows [K, V]

    def drawn(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The second half of :meth:`take`: the tokens ``[K]`` drawn from this position's ``rows``."""
        if self.need.logprobs is not None:
            self.logprobs.append(token_logprob(rows[0], int(tokens[0]), self.need.logprobs))
        if self.need.return_logits:
            self.position_rows.append(rows)
        for draft, token in zip(self.drafts, tokens.tolist()):
            draft.append(int(token))

    def outcome(self) -> tuple[Any, Any]:
        session, stride = self.session, self.need.count - 1
        session.chain_start, session.chain_stride = session.base, stride
        session.chains = [draft[:stride] for draft in self.drafts] if stride else []
        session.last_draft = list(self.drafts[0])
        tokens = torch.tensor(self.drafts, dtype=torch.int64)  # [K, n]
        logprobs = self.logprobs if self.need.logprobs is not None else None
        if not (self.need.return_logits or self.need.report_logits):
            return Sampled(tokens, logprobs=logprobs), None
        logits = torch.stack(self.position_logits, dim=1)  # [K, n, V]
        summary = Sampled(tokens, logits if self.need.report_logits else None, logprobs=logprobs)
        if not self.need.return_logits:
            return summary, Sampled(tokens)
        return summary, Sampled(tokens, logits, rows=tuple(self.position_rows))  # n rows [K, V]


class PreDraftTask(Task):
    """:class:`PreDraft`: ONE row with the pending tokens and the block under verification (fed
    but not committed: the linear part ends before the block, which stays as chain 0 so that an
    accepted prefix of it is kept), then one forward per drafted position over the K chains, chain
    k starting with candidate k right after the block (each sees the context, the block and its
    own chain: columns ``after_block + k * count + j`` at positions ``base + len(block) + j``)."""

    def __init__(self, session: Session, pending: list[int], need: PreDraft):
        super().__init__(session, pending)
        block = need.block if need.block is not None else session.last_draft
        if not block:
            raise ValueError("a PreDraft needs the block under verification (no Sample drafted one this step)")
        if need.count < 1 or need.guesses < 1:
            raise ValueError(f"count and guesses must be >= 1, got {need.count}, {need.guesses}")
        self.need, self.block = need, [int(t) for t in block]
        self.guesses: list[int] | None = None
        self.chains: list[list[int]] = []  # chain k: candidate k, then its draws
        self.position_logits: list[torch.Tensor] = []
        self.source = session.source(need.stream)

    @property
    def active(self) -> bool:
        return self.guesses is None or len(self.chains[0]) <= self.need.count

    def row(self) -> RowWork:
        session = self.session
        if self.guesses is None:
            tokens = self.pending + self.block
            return linear_row(session.slot, session.base, tokens, session.base, keep=[len(tokens) - 1])
        depth = len(self.chains[0]) - 1  # feed token `depth` of each chain (0: the candidate)
        after_block = session.base + len(self.block)
        columns = [after_block + k * self.need.count + depth for k in range(len(self.chains))]
        return RowWork(
            slot=session.slot,
            prefix_length=after_block,
            token_ids=tuple(chain[depth] for chain in self.chains),
            columns=tuple(columns),
            positions=(after_block + depth,) * len(columns),
            attend=RunAttend([c - depth for c in columns], [c + 1 for c in columns]),  # each its own chain
            keep=tuple(range(len(columns))),
        )

    def take(self, logits: torch.Tensor) -> None:
        session = self.session
        if self.guesses is None:  # the row after the block: the candidates for the bonus token
            self._pending_fed()
            row = session_rows(session, logits, [self.block])[0]  # [V]
            self.guesses = bonus_guesses(row, self.need.guesses)
            self.chains = [[guess] for guess in self.guesses]
            return
        logits = shared_vocab(session, logits)  # [K, V]
        rows = session_rows(session, logits, [self.block + chain for chain in self.chains])  # [K, V]
        for chain, token in zip(self.chains, self.source.categorical(rows).tolist()):
            chain.append(int(token))
        self.position_logits.append(logits)

    def outcome(self) -> tuple[Any, Any]:
        session = self.session
        session.chain_start, session.chain_stride, session.chains = session.base, len(self.block), [self.block]
        tokens = torch.tensor([chain[1:] for chain in self.chains], dtype=torch.int64)  # [K, count]
        logits = torch.stack(self.position_logits, dim=1)  # [K, count, V]
        return PreDrafted(self.guesses, tokens), PreDrafted(self.guesses, tokens, logits)


class ExtendTask(Task):
    """:class:`Extend`: one row with the pending tokens and the queued tokens as a chain (rows
    at every queued position and after the queue), then one forward per further draw."""

    def __init__(self, session: Session, pending: list[int], need: Extend):
        super().__init__(session, pending)
        self.need = need
        self.queued = [int(t) for t in need.queued]
        self.source = session.source(need.stream) if need.count else None
        self.queued_logits: torch.Tensor | None = None
        self.next_logits: torch.Tensor | None = None
        self.tokens: list[int] = []
        self.token_logits: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        return self.queued_logits is None or len(self.tokens) < self.need.count

    def row(self) -> RowWork:
        session = self.session
        if self.queued_logits is None:
            pending, chain_start = self.pending, session.base + len(self.pending)
            columns = tuple(range(session.base, chain_start + len(self.queued)))
            return RowWork(
                slot=session.slot,
                prefix_length=session.base,
                token_ids=tuple(pending) + tuple(self.queued),
                columns=columns,
                positions=columns,
                attend=RunAttend.causal(session.base, len(columns)),  # pending, then queued: one causal run
                keep=tuple(range(len(pending) - 1, len(columns))),
            )
        column = session.base + len(self.queued) + len(self.tokens) - 1  # feed the newest draw
        return RowWork(
            slot=session.slot,
            prefix_length=session.base,
            token_ids=(self.tokens[-1],),
            columns=(column,),
            positions=(column,),
            attend=RunAttend([session.base], [column + 1]),
            keep=(0,),
        )

    def take(self, logits: torch.Tensor) -> None:
        logits = shared_vocab(self.session, logits)
        if self.queued_logits is None:
            self._pending_fed()
            self.queued_logits, self.next_logits = logits[:-1], logits[-1]  # [Q, V], [V]
        else:
            self.next_logits = logits[0]  # [V]
        if len(self.tokens) < self.need.count:
            # float64 whatever the precision: the ensemble's machine recomputes this member's rows
            # on the coordinator in float64 to verify the proposal, and must see the rows drawn from.
            row = session_rows(self.session, self.next_logits[None], [self.queued + self.tokens],
                               dtype=torch.float64)  # [1, V]
            token = int(self.source.categorical(row)[0])
            self.tokens.append(token)
            self.token_logits.append(self.next_logits)

    def outcome(self) -> tuple[Any, Any]:
        session = self.session
        fed = self.queued + self.tokens[:-1]
        session.chain_start, session.chain_stride, session.chains = session.base, len(fed), [fed]
        vocab = self.queued_logits.shape[-1]
        block = MemberBlock(
            queued_logits=self.queued_logits.clone(),
            tokens=torch.tensor(self.tokens, dtype=torch.int64),
            token_logits=torch.stack(self.token_logits) if self.token_logits else torch.empty(0, vocab, dtype=self.queued_logits.dtype),
        )
        return block, None


class NextLogitsTask(Task):
    """:class:`NextLogits`: the pending tokens, the row after them."""

    def __init__(self, session: Session, pending: list[int], need: NextLogits):
        super().__init__(session, pending)
        self.logits: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.logits is None

    def row(self) -> RowWork:
        return self._feed_pending()

    def take(self, logits: torch.Tensor) -> None:
        self._pending_fed()
        self.logits = shared_vocab(self.session, logits[0]).clone()  # [V]

    def outcome(self) -> tuple[Any, Any]:
        return self.logits, None


class PrefillTask(Task):
    """:class:`Prefill`: the next ``grant`` tokens of the session's prompt as one causal row (the
    prompt's last token stays pending). ``grant`` is set by :func:`actors.worker.forward_plan.prefill_grants` before the
    step's forwards; a task granted nothing feeds nothing this step."""

    def __init__(self, session: Session, pending: list[int], need: Prefill):
        super().__init__(session, pending)
        if session.base + len(pending) != session.prompt_length or session.chains:
            raise ValueError(f"session {session.session_id!r} is past its prompt: nothing to prefill")
        self.need = need
        self.grant = 0
        self.fed = 0

    @property
    def remaining(self) -> int:
        """Prompt tokens still to feed, the last one (always pending) not counted."""
        return len(self.pending) - 1

    @property
    def active(self) -> bool:
        return self.grant > 0 and not self.fed

    def row(self) -> RowWork:
        session, chunk = self.session, self.pending[: self.grant]
        keep = range(len(chunk)) if self.need.keep_logits else [len(chunk) - 1]
        return linear_row(session.slot, session.base, chunk, session.base, keep=keep)

    def take(self, logits: torch.Tensor) -> None:
        if self.need.keep_logits:  # [grant, V]: rows at prompt positions base .. base + grant - 1
            self.prompt_logits = shared_vocab(self.session, logits).clone()
        self.session.base += self.grant
        self.pending = self.pending[self.grant:]
        self.fed = self.grant

    def outcome(self) -> tuple[Any, Any]:
        return PrefillProgress(fed=self.fed, remaining=self.remaining), None
