"""The worker engine: one step = the needs of every request on this model, batched.

:class:`WorkerEngine.run_step` takes the work items of one scheduler step (a :mod:`verifiers.machines`
need per request, with the session to run it in) and runs them together: every forward pass
of the step is ONE ragged forward over every session that still has tokens to feed
(:class:`actors.model.batch.RowWork` rows in a :class:`actors.model.backends.SlotBackend`), cut by length
where padding would cost more than another forward (:func:`forward_groups`). A step makes
as many forwards as its longest item needs: one for scoring / verification / next logits,
``count`` for sampling ``count`` tokens (the sampling items drop out as they finish).

Each item is a small task (:class:`_Task`) that says which row it needs in the next forward
and takes that row's logits. Draws use the session's own random streams in the order the
machine's contract states, so a request's tokens do not depend on its neighbours. Verification
runs here, next to the target rows (only tokens travel back); logits leave the device once per
forward (one copy of the kept rows of every session), and rows are computed with the one
sampling path (:func:`verifiers.sampling.logits_to_probs`) on the host, which is where the
verifiers run, in the request's precision (``RowSampling.precision``: float64, or float32 where
``engine.sampling_precision`` settles so; draws and single-draft verification keep it).

Prompt log-probabilities: a session opened with ``OpenSession.prompt_logits`` keeps the logits
of every prompt position in the forward that feeds its prompt (:func:`keep_prompt_positions`),
and its outcome carries them (``ItemOutcome.prompt_logits``); such a session reuses no cached
prefix, so every position is computed fresh.

Chunked prefill: a :class:`actors.messages.Prefill` item feeds the next chunk of a new
session's prompt. A step's token budget (``max_tokens_per_step``) goes first to the rows of the
other items (decoding, verification, short prompts), and what is left to the prefill chunks, in
item order (:func:`prefill_grants`); the first prompt in line always gets at least
:data:`MIN_PREFILL_SHARE` of the budget, so no prompt waits forever behind running streams. A
chunk is an ordinary causal row at the session's own columns and positions, so the keys/values
it writes are those a one-shot prefill writes; the prompt's last token stays pending, and the
decoding machine's first need computes the row after the prompt once the whole prompt is cached.

Failures stay with their request: an item that fails (bad state, a forward that raises for
its row) gets an error outcome and its session is freed; the other items of the step go on (a
forward that raises is retried row by row to find the rows that fail).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from actors.model.batch import RowWork, RunAttend, linear_row
from actors.messages import CallTiming, ItemOutcome, OpenSession, Prefill, PrefillProgress, RowSampling, WorkItem
from actors.worker.isolation import batched_then_alone
from actors.worker.prefix_cache import PrefixCache
from actors.worker.sessions import Session, SessionNotFoundError, SessionStore
from verifiers.machines import (
    MODEL_FREE,
    Extend,
    MemberBlock,
    NextLogits,
    PreDraft,
    PreDrafted,
    Sample,
    Sampled,
    ScoreBlock,
    ScoreVerify,
    Verified,
    bonus_guesses,
)
from verifiers.blocks import block_inputs, block_key, verified_row, verify_blocks
from verifiers.randomness import categorical_together
from verifiers.registry import get_verifier
from verifiers.penalties import penalized_probs
from verifiers.proposers import one_hot_rows
from verifiers.sampling import token_logprob

logger = logging.getLogger(__name__)

#: ``engine.max_tokens_per_step`` when unset: tokens one worker step feeds at most (the rows of
#: its first forward round), prefill chunks included.
DEFAULT_MAX_TOKENS_PER_STEP = 512

#: The first prefill chunk in line gets at least this share of the budget even when the step's
#: other rows take it all.
MIN_PREFILL_SHARE = 0.25


def session_rows(session: Session, logits: torch.Tensor, after: list[list[int]],
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """The one logits -> rows path of a worker: shared-vocabulary truncation, then the request's
    penalties (row ``i`` penalized with the generated tokens followed by ``after[i]``, the
    uncommitted tokens before its position) and temperature / top-k / top-p
    (:func:`verifiers.penalties.penalized_probs`), in ``dtype`` (default: the request's
    ``RowSampling.precision``)."""
    sampling = session.sampling
    generated = None
    if sampling.penalties.active:
        committed = session.generated()
        generated = [committed + list(tokens) for tokens in after]
    return penalized_probs(
        shared_vocab(session, logits), temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        penalties=sampling.penalties, prompt=session.context[: session.prompt_length], generated=generated,
        dtype=dtype if dtype is not None else row_dtype(sampling.precision),
    )


def row_dtype(precision: str) -> torch.dtype:
    """``RowSampling.precision`` ("float64" / "float32") -> the torch dtype of the rows."""
    if precision not in ("float64", "float32"):
        raise ValueError(f"RowSampling.precision must be 'float64' or 'float32', got {precision!r}")
    return getattr(torch, precision)


def shared_vocab(session: Session, logits: torch.Tensor) -> torch.Tensor:
    limit = session.sampling.vocab_limit
    return logits if limit is None else logits[..., :limit]


def columns_of(*runs: tuple[int, ...]) -> tuple[int, ...]:
    """The columns of several runs, in order."""
    return tuple(column for run in runs for column in run)


def keep_prompt_positions(row: RowWork, count: int) -> RowWork:
    """``row`` (which starts with the whole prompt: its session fed nothing yet) also keeping
    its first ``count`` positions, before its own kept positions (all of which lie at or after
    the prompt's last token, so none is kept twice)."""
    if row.prefix_length != 0 or any(index < count for index in row.keep):
        raise ValueError("prompt logits need the whole prompt in the session's first row")
    return dataclasses.replace(row, keep=tuple(range(count)) + tuple(row.keep))


class ProposalLost(RuntimeError):
    """The worker that proposed for this step died: the request can be sent again."""


class _Task:
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


class _SampleTask(_Task):
    """:class:`Sample`: the pending tokens, then one forward per further draft position with the
    K chains' newest tokens (each seeing only its own chain)."""

    def __init__(self, session: Session, pending: list[int], need: Sample):
        super().__init__(session, pending)
        self.need = need
        self.drafts: list[list[int]] = [[] for _ in range(need.num_drafts)]
        self.position_logits: list[torch.Tensor] = []
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
        if self.pending:
            self._pending_fed()
            logits = logits.expand(self.need.num_drafts, -1)  # [K, V]: the K drafts share the first row
        logits = shared_vocab(self.session, logits)  # [K, V]
        if self.need.return_logits or self.need.report_logits:
            self.position_logits.append(logits)
        # A block the machine verifies itself: drawn from float64 rows, which it recomputes so.
        dtype = torch.float64 if self.need.report_logits else None
        return session_rows(self.session, logits, self.drafts, dtype)  # [K, V]

    def drawn(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The second half of :meth:`take`: the tokens ``[K]`` drawn from this position's ``rows``."""
        if self.need.logprobs is not None:
            self.logprobs.append(token_logprob(rows[0], int(tokens[0]), self.need.logprobs))
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
        return summary, Sampled(tokens, logits if self.need.return_logits else None)


class _ScoreVerifyTask(_Task):
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
        #: the rule's batch layout (``[1, gamma]``, ``[1, gamma, V]``, ``[1, gamma+1, V]`` single-draft).
        self.inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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
        """The target rows and the draft's rows of the block; a rule the engine verifies for many
        requests at once (:attr:`batch_key`) waits for :func:`verify_together`, any other is
        verified here."""
        session = self.session
        draft_tokens = self.proposal.tokens  # [K, gamma]
        num_drafts, gamma = draft_tokens.shape
        self._pending_fed()
        started = time.perf_counter()
        first = logits[:1].expand(num_drafts, 1, -1)  # [K, 1, V]: every draft's first row
        chained = logits[1:].reshape(num_drafts, gamma, -1)  # [K, gamma, V]
        drafts = draft_tokens.tolist()
        target_after = [draft[:j] for draft in drafts for j in range(gamma + 1)]
        target_probs = session_rows(session, torch.cat([first, chained], dim=1), target_after)  # [K, gamma+1, V]
        if self.proposal.logits is None:  # a model-free proposal: one-hot rows
            draft_probs = one_hot_rows(draft_tokens.to(target_probs.device), target_probs.shape[-1],
                                       target_probs.dtype)  # [K, gamma, V]
        else:
            # The draft's rows, recomputed bit for bit from its logits by the same transform it
            # sampled with (same request sampling parameters and penalty contexts, same code).
            draft_after = [draft[:j] for draft in drafts for j in range(gamma)]
            draft_probs = session_rows(session, self.proposal.logits, draft_after)  # [K, gamma, V]
        self.inputs = block_inputs(self.spec, draft_tokens, draft_probs, target_probs)
        self.verify_s = time.perf_counter() - started
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

    def verified_alone(self) -> tuple[Any, int]:
        """The verifier's result of this block by itself (on the request's verification stream)
        and its row in it, to :meth:`finish`."""
        started = time.perf_counter()
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
        self.inputs = None

    def outcome(self) -> tuple[Any, Any]:
        return self.result, None


class _ScoreBlockTask(_ScoreVerifyTask):
    """:class:`ScoreBlock`: the row of :class:`_ScoreVerifyTask` (pending tokens, then the K
    chains of the block's first ``gamma`` tokens), and the logits ``[K, gamma+1, V]`` back to the
    machine, which verifies (an ensemble member); the chains stay fed, uncommitted."""

    def __init__(self, session: Session, pending: list[int], need: ScoreBlock, proposal: Sampled):
        _Task.__init__(self, session, pending)
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


def verify_together(tasks: Sequence[_ScoreVerifyTask]) -> list[tuple[Any, int]]:
    """ONE verifier call for the blocks of many requests with the same rule and block length
    (their :attr:`_ScoreVerifyTask.batch_key`): rows stacked ``[B, gamma]`` / ``[B, gamma, V]`` /
    ``[B, gamma+1, V]``, each row drawing from its own request's verification stream
    (:func:`verifiers.blocks.verify_blocks`: the draws a call of batch 1 would make), so every
    request gets the tokens it would get verified alone. Returns each task's (result, row), to
    :meth:`_ScoreVerifyTask.finish`; the call's time is shared evenly."""
    if len(tasks) == 1:
        return [tasks[0].verified_alone()]
    started = time.perf_counter()
    result = verify_blocks(tasks[0].spec, [task.inputs for task in tasks], [task.source for task in tasks])
    share = (time.perf_counter() - started) / len(tasks)
    for task in tasks:
        task.verify_s += share
    return [(result, row) for row in range(len(tasks))]


class _PreDraftTask(_Task):
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


class _ExtendTask(_Task):
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


class _NextLogitsTask(_Task):
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


class _PrefillTask(_Task):
    """:class:`Prefill`: the next ``grant`` tokens of the session's prompt as one causal row (the
    prompt's last token stays pending). ``grant`` is set by :func:`prefill_grants` before the
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


def prefill_grants(other_tokens: int, remaining: Sequence[int], budget: int) -> list[int]:
    """The prefill chunk of each prompt in line, in order: what ``budget`` leaves after the
    ``other_tokens`` of the step's other rows, first come first served; the first prompt gets at
    least ``MIN_PREFILL_SHARE`` of the budget (one token at least) whatever the others take.
    ``remaining``: the prompt tokens each still has to feed."""
    left = max(0, budget - other_tokens)
    floor = max(1, int(budget * MIN_PREFILL_SHARE))
    grants = []
    for index, wanted in enumerate(remaining):
        grant = min(wanted, max(left, floor) if index == 0 else left)
        grants.append(grant)
        left = max(0, left - grant)
    return grants


def forward_groups(rows: dict[int, RowWork], overhead_tokens: int) -> list[dict[int, RowWork]]:
    """Split one forward's rows into the forwards that cost least.

    A batch is padded to its longest row, so a prompt's prefill next to fifteen one-token rows
    would make every row cost the prompt's length, and two prompts of 60 and 190 tokens in one
    forward cost 380 positions for 250 tokens. Modelled cost of a forward: ``overhead_tokens``
    plus its padded positions (rows x longest row). Rows sorted by length are cut into the
    contiguous runs of least total cost (exact, by dynamic programming over the cut points);
    runs are returned longest rows first.
    """
    if not rows:
        return []
    order = sorted(rows, key=lambda i: len(rows[i]))  # indices, shortest row first
    lengths = [len(rows[i]) for i in order]
    best = [0] + [float("inf")] * len(order)  # best[j]: least cost of the first j rows
    cut = [0] * (len(order) + 1)  # cut[j]: where the last forward of that best split starts
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + overhead_tokens + (end - start) * lengths[end - 1]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append({i: rows[i] for i in order[cut[end]:end]})
        end = cut[end]
    return groups


class WorkerEngine:
    """Sessions + a slot backend + the batched step. Thread-safe (one step at a time)."""

    def __init__(self, backend: Any, name: str, idle_timeout_s: float = 300.0, prefix_caching: bool = True,
                 max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP):
        if int(max_tokens_per_step) < 1:
            raise ValueError(f"engine.max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        self.backend = backend
        self.name = name
        self.max_tokens_per_step = int(max_tokens_per_step)
        self.prefix_cache = PrefixCache(backend, enabled=prefix_caching)
        self.sessions = SessionStore(self.prefix_cache, idle_timeout_s, name)
        self.steps = 0
        self.rows_per_forward: list[int] = []  # recent batch sizes (for metrics)
        # Cumulative since the worker started (monotonic; read at scrape time, see metrics()).
        self.forward_seconds_total = 0.0
        self.step_seconds_total = 0.0
        self.forward_passes_total = 0

    def metrics(self) -> dict[str, float]:
        """Cumulative counters: seconds in forward passes and in step calls, steps, forward
        passes, prompt tokens opened and reused from the prefix cache, and the open sessions now
        (``actors.coordination.metrics.WORKER_KEYS``)."""
        return {
            "forward_seconds_total": self.forward_seconds_total,
            "step_seconds_total": self.step_seconds_total,
            "steps": self.steps,
            "forward_passes_total": self.forward_passes_total,
            "sessions": len(self.sessions),
            "prompt_tokens_total": self.prefix_cache.prompt_tokens_total,
            "prefix_reused_tokens_total": self.prefix_cache.reused_tokens_total,
        }

    def prompt_logits(self, session_id: str, prompt_ids: Sequence[int], vocab_limit: int | None = None) -> torch.Tensor:
        """The raw logits ``[P - 1, V]`` (float32, the first ``vocab_limit`` ids) at every
        prompt position but the last, row ``j`` predicting prompt token ``j + 1``: one step of a
        session of its own whose prompt forward keeps every position (``OpenSession.prompt_logits``).
        The session is then released; its slot is parked with the prompt, so a decode session of
        the same prompt that follows reuses it instead of computing it again (prefix caching)."""
        spec = OpenSession(tuple(int(t) for t in prompt_ids), RowSampling(vocab_limit=vocab_limit), prompt_logits=True)
        if len(spec.prompt_ids) > self.max_tokens_per_step:
            return self._chunked_prompt_logits(session_id, spec)
        outcomes, _ = self.run_step([WorkItem(session_id, NextLogits(self.name, ()), open=spec)])
        self.sessions.release(session_id)
        outcome = outcomes[0]
        if outcome.error is not None:
            raise RuntimeError(f"{self.name}: scoring the prompt failed: {outcome.error}")
        if outcome.prompt_logits is None:  # a one-token prompt: nothing to score
            return torch.empty(0, outcome.value.shape[-1], dtype=torch.float32)
        return outcome.prompt_logits

    def _chunked_prompt_logits(self, session_id: str, spec: OpenSession) -> torch.Tensor:
        """:meth:`prompt_logits` of a prompt longer than the step budget: one step per chunk
        (other sessions' steps run in between), the rows of every chunk in order."""
        chunks: list[torch.Tensor] = []  # [fed, V] each
        try:
            while True:
                item = WorkItem(session_id, Prefill(self.name, keep_logits=True), open=spec if not chunks else None)
                outcome = self.run_step([item])[0][0]
                if outcome.error is not None:
                    raise RuntimeError(f"{self.name}: scoring the prompt failed: {outcome.error}")
                if outcome.prompt_logits is not None:
                    chunks.append(outcome.prompt_logits)
                if outcome.value.remaining == 0:
                    return torch.cat(chunks)  # [P - 1, V]
        finally:
            self.sessions.release(session_id)

    def run_step(
        self, items: Sequence[WorkItem], releases: Sequence[str] = (), source_payloads: Sequence[Sequence[Any]] = ()
    ) -> tuple[list[ItemOutcome], list[Any]]:
        """Run this worker's call of one step; returns (outcomes aligned with ``items``, payloads
        aligned with ``items``). ``source_payloads[i][j]`` is the payload of item j of the i-th
        source call."""
        with self.sessions.lock:
            started = time.perf_counter()
            try:
                return self._run_step(items, releases, source_payloads)
            finally:
                self.step_seconds_total += time.perf_counter() - started

    def _run_step(
        self, items: Sequence[WorkItem], releases: Sequence[str], source_payloads: Sequence[Sequence[Any]]
    ) -> tuple[list[ItemOutcome], list[Any]]:
        """The body of :meth:`run_step` (under the session lock)."""
        for session_id in releases:
            self.sessions.release(session_id)
        tasks: list[_Task | None] = []
        errors: dict[int, str] = {}
        lost: set[int] = set()
        for index, item in enumerate(items):
            try:
                tasks.append(self._task(item, source_payloads))
            except Exception as error:  # noqa: BLE001 - reported to the one request
                tasks.append(None)
                errors[index] = self._fail(item.session_id, error)
                if isinstance(error, (SessionNotFoundError, ProposalLost)):
                    lost.add(index)
        self._grant_prefills(tasks)
        started = time.perf_counter()
        forward_s = self._run_forwards(tasks, errors, items)
        self.steps += 1
        return self._outcomes(items, tasks, errors, lost, forward_s, time.perf_counter() - started)

    # ------------------------------------------------------------------ internals
    def _task(self, item: WorkItem, source_payloads: Sequence[Sequence[Any]]) -> _Task:
        if item.open is not None:
            self._open(item.session_id, item.open)
        session = self.sessions.get(item.session_id)
        task = self._need_task(item, session, source_payloads)
        if item.open is not None and item.open.prompt_logits and not isinstance(task, _PrefillTask):
            task.prompt_positions = session.prompt_length - 1
        return task

    def _grant_prefills(self, tasks: Sequence[_Task | None]) -> None:
        """Share the step's token budget: the other tasks' first rows first, then the prefill
        chunks in item order (:func:`prefill_grants`)."""
        prefills = [task for task in tasks if isinstance(task, _PrefillTask)]
        if not prefills:
            return
        other_tokens = 0
        for task in tasks:
            if task is not None and not isinstance(task, _PrefillTask) and task.active:
                try:
                    other_tokens += len(task.row())
                except Exception:  # noqa: BLE001 - the row fails again, and is reported, in the forward
                    pass
        grants = prefill_grants(other_tokens, [task.remaining for task in prefills], self.max_tokens_per_step)
        for task, grant in zip(prefills, grants):
            task.grant = grant

    def _need_task(self, item: WorkItem, session: Session, source_payloads: Sequence[Sequence[Any]]) -> _Task:
        need = item.need
        pending = session.sync(need.append, self.backend.copy_columns)
        if isinstance(need, Sample):
            if need.count < 1 or need.num_drafts < 1:
                raise ValueError(f"count and num_drafts must be >= 1, got {need.count}, {need.num_drafts}")
            return _SampleTask(session, pending, need)
        if isinstance(need, ScoreVerify) and need.draft_need == MODEL_FREE:
            return _ScoreVerifyTask(session, pending, need, Sampled(tokens=torch.tensor([need.proposed], dtype=torch.int64)))
        if isinstance(need, (ScoreVerify, ScoreBlock)):
            source_call, source_item = item.proposal_source
            source = source_payloads[source_call]
            if not isinstance(source, (list, tuple)):  # the proposing worker's call could not be read
                raise ProposalLost(f"the proposals of this step were lost ({getattr(source, 'error', source)})")
            proposal = source[source_item]
            if isinstance(proposal, ItemOutcome):  # the proposing item failed
                raise RuntimeError(f"the proposal failed: {proposal.error}")
            if isinstance(need, ScoreBlock):
                return _ScoreBlockTask(session, pending, need, proposal)
            if isinstance(proposal, PreDrafted):  # drafted in the previous step: the chain after this bonus
                proposal = proposal.chain(need.chain)
            return _ScoreVerifyTask(session, pending, need, proposal)
        if isinstance(need, PreDraft):
            return _PreDraftTask(session, pending, need)
        if isinstance(need, Extend):
            return _ExtendTask(session, pending, need)
        if isinstance(need, NextLogits):
            return _NextLogitsTask(session, pending, need)
        if isinstance(need, Prefill):
            return _PrefillTask(session, pending, need)
        raise TypeError(f"unknown need {type(need).__name__}")

    def _open(self, session_id: str, spec: OpenSession) -> None:
        self.sessions.open(session_id, list(spec.prompt_ids), spec.sampling, dict(spec.seeds),
                           reuse=not spec.prompt_logits)

    def _run_forwards(self, tasks: list[_Task | None], errors: dict[int, str], items: Sequence[WorkItem]) -> float:
        fail = self._failer(tasks, errors, items)
        forward_s = 0.0
        while True:
            live = [i for i, task in enumerate(tasks) if task is not None and task.active]
            if not live:
                return forward_s
            rows: dict[int, RowWork] = {}
            for i in live:
                try:
                    rows[i] = tasks[i].row()
                    if tasks[i].prompt_positions and tasks[i].prompt_logits is None:
                        rows[i] = keep_prompt_positions(rows[i], tasks[i].prompt_positions)
                except Exception as error:  # noqa: BLE001 - reported to the one request
                    fail(i, error)
            started = time.perf_counter()
            logits: dict[int, torch.Tensor] = {}
            for group in forward_groups(rows, self.backend.forward_overhead_tokens):
                logits.update(self._forward(group, fail))
                self.rows_per_forward.append(len(group))
                self.forward_passes_total += 1
            elapsed = time.perf_counter() - started
            forward_s += elapsed
            self.forward_seconds_total += elapsed
            del self.rows_per_forward[:-256]
            sampling: dict[int, torch.Tensor] = {}  # task -> its rows [K, V], to draw together
            for i, row_logits in logits.items():
                task = tasks[i]
                task.forwards += 1
                task.tokens_fed += len(rows[i])
                task.session.forward_calls += 1
                task.session.tokens_fed += len(rows[i])
                if task.prompt_positions and task.prompt_logits is None:
                    count = task.prompt_positions  # [count + own keeps, V] -> the prompt's, the task's
                    task.prompt_logits = shared_vocab(task.session, row_logits[:count]).clone()
                    row_logits = row_logits[count:]
                try:
                    if isinstance(task, _SampleTask):
                        sampling[i] = task.rows_to_draw(row_logits)
                    else:
                        task.take(row_logits)
                except Exception as error:  # noqa: BLE001 - reported to the one request
                    fail(i, error)
            self._draw_together(sampling, tasks, fail)
            self._verify_waiting(tasks, fail)

    def _draw_together(self, sampling: dict[int, torch.Tensor], tasks: list[_Task | None],
                       fail: Callable[[int, Exception], None]) -> None:
        """Draw this forward's tokens of every sampling task (``sampling``: task -> its rows
        ``[K, V]``) in ONE call (:func:`verifiers.randomness.categorical_together`: each task's
        stream draws what its own call would); if that call raises, each task alone, failing only
        the tasks that fail (:func:`batched_then_alone`)."""
        batched_then_alone(
            list(sampling),
            lambda indices: categorical_together([(tasks[i].source, sampling[i]) for i in indices]),
            lambda i: tasks[i].source.categorical(sampling[i]),
            lambda i, tokens: tasks[i].drawn(sampling[i], tokens),
            fail, f"{self.name}: drawing tokens together",
        )

    def _verify_waiting(self, tasks: list[_Task | None], fail: Callable[[int, Exception], None]) -> None:
        """Verify the blocks waiting after this forward, one verifier call per rule and block
        length (:func:`verify_together`); if a call raises, each block alone, failing only the
        requests whose verification fails (:func:`batched_then_alone`)."""
        groups: dict[tuple[str, int], list[int]] = {}
        for i, task in enumerate(tasks):
            if isinstance(task, _ScoreVerifyTask) and task.result is None and task.batch_key is not None:
                groups.setdefault(task.batch_key, []).append(i)
        for indices in groups.values():
            batched_then_alone(
                indices,
                lambda keys: verify_together([tasks[i] for i in keys]),
                lambda i: tasks[i].verified_alone(),
                lambda i, verified: tasks[i].finish(*verified),
                fail, f"{self.name}: verifying blocks together",
            )

    def _forward(self, rows: dict[int, RowWork], fail: Callable[[int, Exception], None]) -> dict[int, torch.Tensor]:
        """One batched forward -> each row's logits on the host; if it raises, each row alone,
        failing only the rows that fail (:func:`batched_then_alone`)."""
        logits: dict[int, torch.Tensor] = {}
        batched_then_alone(
            list(rows),
            lambda indices: self._to_host(self.backend.forward([rows[i] for i in indices])),
            lambda i: self._to_host(self.backend.forward([rows[i]]))[0],
            logits.__setitem__,
            fail, f"{self.name}: a batched forward",
        )
        return logits

    @staticmethod
    def _to_host(logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per row logits -> host memory in one copy."""
        if not logits or logits[0].device.type == "cpu":
            return logits
        host = torch.cat(logits).cpu()
        return list(host.split([len(x) for x in logits]))

    def _failer(self, tasks: list[_Task | None], errors: dict[int, str],
                items: Sequence[WorkItem]) -> Callable[[int, Exception], None]:
        """``fail(i, error)``: item ``i`` of the step failed with ``error``: its task is dropped,
        its session freed and its outcome is the error (:meth:`_fail`)."""

        def fail(i: int, error: Exception) -> None:
            tasks[i] = None
            errors[i] = self._fail(items[i].session_id, error)

        return fail

    def _fail(self, session_id: str, error: Exception) -> str:
        self.sessions.release(session_id)
        logger.error("%s: work on session %s failed; session freed: %s: %s", self.name, session_id,
                     type(error).__name__, error, exc_info=error)
        return f"{type(error).__name__}: {error}"

    def _outcomes(
        self, items: Sequence[WorkItem], tasks: list[_Task | None], errors: dict[int, str], lost: set[int], forward_s: float,
        call_s: float = 0.0,
    ) -> tuple[list[ItemOutcome], list[Any]]:
        outcomes: list[ItemOutcome] = []
        payloads: list[Any] = []
        for index, task in enumerate(tasks):
            if task is None:
                outcome = ItemOutcome(error=errors[index], retryable=index in lost)
                outcomes.append(outcome)
                payloads.append(outcome)
                continue
            summary, payload = task.outcome()
            timing = CallTiming(forward_s=forward_s, verify_s=task.verify_s, forward_calls=task.forwards,
                                tokens_fed=task.tokens_fed, call_s=call_s)
            outcomes.append(ItemOutcome(value=summary, timing=timing, prompt_logits=task.prompt_logits))
            payloads.append(payload)
        return outcomes, payloads
