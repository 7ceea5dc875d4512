"""The worker engine: one step = the needs of every request on this model, batched.

:class:`WorkerEngine.run_step` takes the work items of one scheduler step (a :mod:`verifiers.machines`
need per request, with the session to run it in) and runs them together: every forward pass
of the step is ONE ragged forward over every session that still has tokens to feed
(:class:`actors.model.batch.RowWork` rows in a :class:`actors.model.backends.SlotBackend`), cut by length
where padding would cost more than another forward (:func:`actors.worker.forward_plan.forward_groups`). A step makes
as many forwards as its longest item needs: one for scoring / verification / next logits,
``count`` for sampling ``count`` tokens (the sampling items drop out as they finish).

Each item is a small task (:mod:`actors.worker.tasks`, :mod:`actors.worker.verify_tasks`) that
says which row it needs in the next forward and takes that row's logits. Draws use the session's
own random streams in the order the machine's contract states, so a request's tokens do not
depend on its neighbours. Verification runs here, next to the target rows (only tokens travel
back); logits leave the device once per forward (one copy of the kept rows of every session), and
rows are computed with the one sampling path on the host (:mod:`actors.worker.rows`), which is
where the verifiers run, in the request's precision.

Prompt log-probabilities: a session opened with ``OpenSession.prompt_logits`` keeps the logits
of every prompt position in the forward that feeds its prompt (:func:`keep_prompt_positions`),
and its outcome carries them (``ItemOutcome.prompt_logits``); such a session reuses no cached
prefix, so every position is computed fresh.

Chunked prefill: a :class:`actors.messages.Prefill` item feeds the next chunk of a new
session's prompt. A step's token budget (``max_tokens_per_step``) goes first to the rows of the
other items (decoding, verification, short prompts), and what is left to the prefill chunks, in
item order (:func:`actors.worker.forward_plan.prefill_grants`); the first prompt in line always gets at least
a share of the budget, so no prompt waits forever behind running streams. A
chunk is an ordinary causal row at the session's own columns and positions, so the keys/values
it writes are those a one-shot prefill writes; the prompt's last token stays pending, and the
decoding machine's first need computes the row after the prompt once the whole prompt is cached.

Failures stay with their request: an item that fails (bad state, a forward that raises for
its row) gets an error outcome and its session is freed; the other items of the step go on (a
batched forward, draw or verification that raises is run again for each request alone:
:mod:`actors.worker.isolation`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from actors.messages import CallTiming, ItemOutcome, OpenSession, Prefill, RowSampling, WorkItem
from actors.model.batch import RowWork
from actors.worker.forward_plan import forward_groups, prefill_grants
from actors.worker.isolation import batched_then_alone
from actors.worker.prefix_cache import PrefixCache
from actors.worker.rows import shared_vocab
from actors.worker.sessions import Session, SessionNotFoundError, SessionStore
from actors.worker.tasks import ExtendTask, NextLogitsTask, PreDraftTask, PrefillTask, SampleTask, Task
from actors.worker.verify_tasks import ScoreBlockTask, ScoreVerifyTask, verify_together
from verifiers.machines import (
    MODEL_FREE,
    Extend,
    NextLogits,
    PreDraft,
    PreDrafted,
    Sample,
    Sampled,
    ScoreBlock,
    ScoreVerify,
)
from verifiers.randomness import categorical_together

logger = logging.getLogger(__name__)

#: ``engine.max_tokens_per_step`` when unset: tokens one worker step feeds at most (the rows of
#: its first forward round), prefill chunks included.
DEFAULT_MAX_TOKENS_PER_STEP = 512

def keep_prompt_positions(row: RowWork, count: int) -> RowWork:
    """``row`` (which starts with the whole prompt: its session fed nothing yet) also keeping
    its first ``count`` positions, before its own kept positions (all of which lie at or after
    the prompt's last token, so none is kept twice)."""
    if row.prefix_length != 0 or any(index < count for index in row.keep):
        raise ValueError("prompt logits need the whole prompt in the session's first row")
    return dataclasses.replace(row, keep=tuple(range(count)) + tuple(row.keep))


class ProposalLost(RuntimeError):
    """The worker that proposed for this step died: the request can be sent again."""


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
        tasks: list[Task | None] = []
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
    def _task(self, item: WorkItem, source_payloads: Sequence[Sequence[Any]]) -> Task:
        if item.open is not None:
            self._open(item.session_id, item.open)
        session = self.sessions.get(item.session_id)
        task = self._need_task(item, session, source_payloads)
        if item.open is not None and item.open.prompt_logits and not isinstance(task, PrefillTask):
            task.prompt_positions = session.prompt_length - 1
        return task

    def _grant_prefills(self, tasks: Sequence[Task | None]) -> None:
        """Share the step's token budget: the other tasks' first rows first, then the prefill
        chunks in item order (:func:`prefill_grants`)."""
        prefills = [task for task in tasks if isinstance(task, PrefillTask)]
        if not prefills:
            return
        other_tokens = 0
        for task in tasks:
            if task is not None and not isinstance(task, PrefillTask) and task.active:
                try:
                    other_tokens += len(task.row())
                except Exception:  # noqa: BLE001 - the row fails again, and is reported, in the forward
                    pass
        grants = prefill_grants(other_tokens, [task.remaining for task in prefills], self.max_tokens_per_step)
        for task, grant in zip(prefills, grants):
            task.grant = grant

    def _need_task(self, item: WorkItem, session: Session, source_payloads: Sequence[Sequence[Any]]) -> Task:
        need = item.need
        pending = session.sync(need.append, self.backend.copy_columns)
        if isinstance(need, Sample):
            if need.count < 1 or need.num_drafts < 1:
                raise ValueError(f"count and num_drafts must be >= 1, got {need.count}, {need.num_drafts}")
            return SampleTask(session, pending, need)
        if isinstance(need, ScoreVerify) and need.draft_need == MODEL_FREE:
            return ScoreVerifyTask(session, pending, need, Sampled(tokens=torch.tensor([need.proposed], dtype=torch.int64)))
        if isinstance(need, (ScoreVerify, ScoreBlock)):
            source_call, source_item = item.proposal_source
            source = source_payloads[source_call]
            if not isinstance(source, (list, tuple)):  # the proposing worker's call could not be read
                raise ProposalLost(f"the proposals of this step were lost ({getattr(source, 'error', source)})")
            proposal = source[source_item]
            if isinstance(proposal, ItemOutcome):  # the proposing item failed
                raise RuntimeError(f"the proposal failed: {proposal.error}")
            if isinstance(need, ScoreBlock):
                return ScoreBlockTask(session, pending, need, proposal)
            if isinstance(proposal, PreDrafted):  # drafted in the previous step: the chain after this bonus
                proposal = proposal.chain(need.chain)
            return ScoreVerifyTask(session, pending, need, proposal)
        if isinstance(need, PreDraft):
            return PreDraftTask(session, pending, need)
        if isinstance(need, Extend):
            return ExtendTask(session, pending, need)
        if isinstance(need, NextLogits):
            return NextLogitsTask(session, pending, need)
        if isinstance(need, Prefill):
            return PrefillTask(session, pending, need)
        raise TypeError(f"unknown need {type(need).__name__}")

    def _open(self, session_id: str, spec: OpenSession) -> None:
        self.sessions.open(session_id, list(spec.prompt_ids), spec.sampling, dict(spec.seeds),
                           reuse=not spec.prompt_logits)

    def _run_forwards(self, tasks: list[Task | None], errors: dict[int, str], items: Sequence[WorkItem]) -> float:
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
                    if isinstance(task, SampleTask):
                        sampling[i] = task.rows_to_draw(row_logits)
                    else:
                        task.take(row_logits)
                except Exception as error:  # noqa: BLE001 - reported to the one request
                    fail(i, error)
            self._draw_together(sampling, tasks, fail)
            self._verify_waiting(tasks, fail)

    def _draw_together(self, sampling: dict[int, torch.Tensor], tasks: list[Task | None],
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

    def _verify_waiting(self, tasks: list[Task | None], fail: Callable[[int, Exception], None]) -> None:
        """Verify the blocks waiting after this forward, one verifier call per rule and block
        length (:func:`verify_together`); if a call raises, each block alone, failing only the
        requests whose verification fails (:func:`batched_then_alone`)."""
        groups: dict[tuple[str, int], list[int]] = {}
        for i, task in enumerate(tasks):
            if isinstance(task, ScoreVerifyTask) and task.result is None and task.batch_key is not None:
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

    def _failer(self, tasks: list[Task | None], errors: dict[int, str],
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
        self, items: Sequence[WorkItem], tasks: list[Task | None], errors: dict[int, str], lost: set[int], forward_s: float,
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
