"""One worker step in progress (:class:`Step`): a task per work item, forward rounds until no task
needs a row, the draws and verifications after each forward, then the outcomes.

Each forward round is ONE ragged forward over the row of every task that still needs one, cut by
length where padding would cost more than another forward
(:func:`actors.worker.forward_plan.forward_groups`); logits leave the device once per forward (one
copy of the kept rows of every session). After each forward the rows of every sampling and verifying
task are made in one call (:func:`batch_rows`), the tokens of every sampling task are drawn in one
call and the waiting blocks verified, one verifier call per rule and block length.

Prompt log-probabilities: a session opened with ``OpenSession.prompt_logits`` keeps the logits
of every prompt position in the forward that feeds its prompt (:func:`keep_prompt_positions`),
and its outcome carries them (``ItemOutcome.prompt_logits``); such a session reuses no cached
prefix, so every position is computed fresh.

Failures stay with their request: an item that fails (bad state, a forward that raises for
its row) gets an error outcome and its session is freed; the other items of the step go on (a
batched forward, draw or verification that raises is run again for each request alone:
:mod:`actors.worker.isolation`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from actors.messages import CallTiming, ItemOutcome, Prefill, WorkItem
from actors.model.batch import RowWork
from actors.model.device_health import raise_if_device_broken
from actors.worker.forward_plan import forward_groups, prefill_grants
from actors.worker.isolation import batched_then_alone
from actors.worker.prefill_pacer import PrefillPacer, paced
from actors.worker.rows import RowRequest, byte_chunks, rows_together, shared_vocab
from actors.worker.sessions import Session, SessionNotFoundError, SessionStore
from actors.worker.tasks import ExtendTask, NextLogitsTask, PreDraftTask, PrefillTask, SampleTask, Task
from actors.worker.verify_tasks import ScoreBlockTask, ScoreVerifyTask, verify_together
from verifiers.machines.needs import MODEL_FREE, Extend, NextLogits, PreDraft, PreDrafted, Sample, Sampled, ScoreBlock, ScoreVerify
from verifiers.randomness import categorical_together

logger = logging.getLogger(__name__)

#: Batch sizes of the most recent forwards a worker keeps (``WorkerEngine.rows_per_forward``).
RECENT_FORWARDS = 256


def keep_prompt_positions(row: RowWork, count: int) -> RowWork:
    """``row`` (which starts with the whole prompt: its session fed nothing yet) also keeping
    its first ``count`` positions, before its own kept positions (all of which lie at or after
    the prompt's last token, so none is kept twice)."""
    if row.prefix_length != 0 or any(index < count for index in row.keep):
        raise ValueError("prompt logits need the whole prompt in the session's first row")
    return dataclasses.replace(row, keep=tuple(range(count)) + tuple(row.keep))


class ProposalLost(RuntimeError):
    """The worker that proposed for this step died: the request can be sent again."""


def need_task(item: WorkItem, session: Session, source_payloads: Sequence[Sequence[Any]], backend: Any) -> Task:
    """The task of ``item``'s need in ``session`` (whose uncommitted columns are first synced to
    the need's appended tokens on ``backend``); a scoring need reads its proposal in
    ``source_payloads``."""
    need = item.need
    pending = session.sync(need.append, backend.copy_columns)
    backend.truncate(session.slot, session.base)  # rollback: the blocks past the kept columns go back
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


def to_host(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per row logits -> host memory in one copy."""
    if not logits or logits[0].device.type == "cpu":
        return logits
    host = torch.cat(logits).cpu()
    return list(host.split([len(x) for x in logits]))


def batch_rows(requests: Sequence[Sequence[RowRequest]]) -> list[list[torch.Tensor]]:
    """The rows of many tasks (``requests[t]``: task ``t``'s row requests) in ONE
    :func:`actors.worker.rows.rows_together` call -> each task's rows, aligned with its requests.
    The requests go in by their place in a task, then by task (every task's first request, then
    every second one), so the blocks of tasks with the same settings come out adjacent, and
    the verifier stacks them without a copy (:func:`verifiers.blocks.verify_blocks`)."""
    order = [(t, k) for k in range(max((len(r) for r in requests), default=0)) for t in range(len(requests))
             if k < len(requests[t])]
    made = rows_together([requests[t][k] for t, k in order])
    rows: list[list[torch.Tensor]] = [[None] * len(r) for r in requests]  # type: ignore[list-item]
    for (t, k), row in zip(order, made):
        rows[t][k] = row
    return rows


class StepHost(Protocol):
    """What a :class:`Step` reads and counts on the engine it runs in
    (:class:`actors.worker.engine.WorkerEngine`): the backend, the sessions, the step budget and
    the worker's counters."""

    name: str
    backend: Any
    sessions: SessionStore
    max_tokens_per_step: int
    prefill_pacer: PrefillPacer
    steps: int
    rows_per_forward: list[int]
    forward_seconds_total: float
    forward_passes_total: int


class Step:
    """One call of :meth:`actors.worker.engine.WorkerEngine.run_step` on ``engine`` (under its
    session lock): ``tasks[i]`` is item ``i``'s task, None once the item failed (``errors[i]`` says
    why; ``lost``: the failed items the request may send again)."""

    def __init__(self, engine: StepHost, items: Sequence[WorkItem], source_payloads: Sequence[Sequence[Any]]):
        self.engine = engine
        self.items = list(items)
        self.tasks: list[Task | None] = []
        self.errors: dict[int, str] = {}
        self.lost: set[int] = set()
        self.prefill_tokens = 0  # granted to this step's prefill chunks
        self.prefill_context = 0.0  # the positions their tokens attend to on average (token-weighted mid-context)
        self.prefill_s = 0.0  # seconds of the forwards that carried them
        for index, item in enumerate(self.items):
            try:
                self.tasks.append(self._task(item, source_payloads))
            except Exception as error:  # noqa: BLE001 - reported to the one request
                self.tasks.append(None)
                self.fail(index, error)
                if isinstance(error, (SessionNotFoundError, ProposalLost)):
                    self.lost.add(index)

    def run(self) -> tuple[list[ItemOutcome], list[Any]]:
        """Feed every task, then (outcomes, payloads), both aligned with the items."""
        self._grant_prefills()
        started = time.perf_counter()
        forward_s, first_round_s = self._run_forwards(started)
        self.engine.steps += 1
        call_s = time.perf_counter() - started
        others = sum(1 for task in self.tasks if task is not None and not isinstance(task, PrefillTask))
        self.engine.prefill_pacer.observe(call_s, others, self.prefill_tokens, self.prefill_s, self.prefill_context)
        return self._outcomes(forward_s, call_s, first_round_s)

    def fail(self, i: int, error: Exception) -> None:
        """Item ``i`` failed with ``error``: its task is dropped, its session freed and its outcome
        is the error; unless the error is a broken device's, no request's own: that raises
        :class:`~actors.model.device_health.DeviceBrokenError` (the worker restarts)."""
        raise_if_device_broken(error, self.engine.name)
        session_id = self.items[i].session_id
        self.tasks[i] = None
        self.engine.sessions.release(session_id)
        logger.error("%s: work on session %s failed; session freed: %s: %s", self.engine.name, session_id,
                     type(error).__name__, error, exc_info=error)
        self.errors[i] = f"{type(error).__name__}: {error}"

    # ------------------------------------------------------------------ the tasks
    def _task(self, item: WorkItem, source_payloads: Sequence[Sequence[Any]]) -> Task:
        sessions = self.engine.sessions
        if item.open is not None:
            spec = item.open
            sessions.open(item.session_id, list(spec.prompt_ids), spec.sampling, dict(spec.seeds),
                          reuse=not spec.prompt_logits)
        session = sessions.get(item.session_id)
        task = need_task(item, session, source_payloads, self.engine.backend)
        if item.open is not None and item.open.prompt_logits and not isinstance(task, PrefillTask):
            task.prompt_positions = session.prompt_length - 1
        return task

    def _grant_prefills(self) -> None:
        """Share the step's token budget: the other tasks' first rows first, then the prefill
        chunks in item order (:func:`prefill_grants`), paced to the measured step costs while
        other rows run (:class:`~actors.worker.prefill_pacer.PrefillPacer`)."""
        prefills = [task for task in self.tasks if isinstance(task, PrefillTask)]
        if not prefills:
            return
        other_tokens = 0
        for task in self.tasks:
            if task is not None and not isinstance(task, PrefillTask) and task.active:
                try:
                    other_tokens += len(task.row())
                except Exception:  # noqa: BLE001 - the row fails again, and is reported, in the forward
                    pass
        remaining = [task.remaining for task in prefills]
        grants = prefill_grants(other_tokens, remaining, self.engine.max_tokens_per_step)
        grants = paced(grants, self.engine.prefill_pacer.allowed(other_tokens, prefills[0].session.base), remaining)
        for task, grant in zip(prefills, grants):
            task.grant = grant
        self.prefill_tokens = sum(grants)
        if self.prefill_tokens:
            self.prefill_context = sum(grant * (task.session.base + grant / 2)
                                       for task, grant in zip(prefills, grants)) / self.prefill_tokens

    # ------------------------------------------------------------------ the forwards
    def _run_forwards(self, started: float) -> tuple[float, float]:
        """Forward rounds until no task needs a row; returns the seconds spent in forwards and the
        seconds from ``started`` to the end of the first round (its rows, forward and sampling)."""
        forward_s, first_round_s = 0.0, 0.0
        while live := [i for i, task in enumerate(self.tasks) if task is not None and task.active]:
            rows = self._rows(live)
            forward_started = time.perf_counter()
            logits = self._forward_rows(rows)
            elapsed = time.perf_counter() - forward_started
            forward_s += elapsed
            self.engine.forward_seconds_total += elapsed
            self._take(rows, logits)
            first_round_s = first_round_s or time.perf_counter() - started
        return forward_s, first_round_s

    def _rows(self, live: list[int]) -> dict[int, RowWork]:
        """The next row of each task in ``live`` (with the prompt's positions where its logits are kept)."""
        rows: dict[int, RowWork] = {}
        for i in live:
            task = self.tasks[i]
            try:
                rows[i] = task.row()
                if task.prompt_positions and task.prompt_logits is None:
                    rows[i] = keep_prompt_positions(rows[i], task.prompt_positions)
            except Exception as error:  # noqa: BLE001 - reported to the one request
                self.fail(i, error)
        return rows

    def _forward_rows(self, rows: dict[int, RowWork]) -> dict[int, torch.Tensor]:
        """The logits of every row: the rows cut into forwards (:func:`forward_groups`)."""
        engine = self.engine
        logits: dict[int, torch.Tensor] = {}
        for group in forward_groups(rows, engine.backend.forward_overhead_tokens):
            if engine.forward_threads is not None:  # resources.one_thread_below (actors.worker.cpu_binding)
                engine.forward_threads.apply(sum(len(rows[i]) for i in group))
            started = time.perf_counter()
            logits.update(self._forward(group))
            if any(isinstance(self.tasks[i], PrefillTask) for i in group):  # what the pacer learns a token's cost from
                self.prefill_s += time.perf_counter() - started
            engine.rows_per_forward.append(len(group))
            engine.forward_passes_total += 1
        del engine.rows_per_forward[:-RECENT_FORWARDS]
        return logits

    def _forward(self, rows: dict[int, RowWork]) -> dict[int, torch.Tensor]:
        """One batched forward -> each row's logits on the host; if it raises, each row alone,
        failing only the rows that fail (:func:`batched_then_alone`)."""
        backend = self.engine.backend
        logits: dict[int, torch.Tensor] = {}
        batched_then_alone(
            list(rows),
            lambda indices: to_host(backend.forward([rows[i] for i in indices])),
            lambda i: to_host(backend.forward([rows[i]]))[0],
            logits.__setitem__,
            self.fail, f"{self.engine.name}: a batched forward",
        )
        return logits

    def _take(self, rows: dict[int, RowWork], logits: dict[int, torch.Tensor]) -> None:
        """Hand each task its row's logits, make the rows of every sampling and verifying task
        together (:meth:`_rows_together`), then draw the sampling tasks' tokens together and verify
        the waiting blocks."""
        requests: dict[int, list[RowRequest]] = {}  # task -> the rows it needs made
        for i, row_logits in logits.items():
            task = self.tasks[i]
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
                    requests[i] = [task.row_request(row_logits)]
                elif type(task) is ScoreVerifyTask:
                    requests[i] = task.row_requests(row_logits)
                else:
                    task.take(row_logits)
            except Exception as error:  # noqa: BLE001 - reported to the one request
                self.fail(i, error)
        sampling: dict[int, torch.Tensor] = {}  # task -> its rows [K, V], to draw together
        self._rows_together(requests, sampling)
        self._draw_together(sampling)
        self._verify_waiting()

    def _rows_together(self, requests: dict[int, list[RowRequest]], sampling: dict[int, torch.Tensor]) -> None:
        """Make the rows of every task of ``requests`` in ONE call (:func:`batch_rows`); a sampling
        task's rows go to ``sampling``, a verifying task takes its own (:meth:`ScoreVerifyTask.rows_taken`).
        If that call raises, each task's alone, failing only the tasks that fail."""
        tasks = self.tasks
        share = [0.0]  # the batched call's seconds per task, counted in each verifying task's verify_s

        def batched(keys: list[int]) -> list[list[torch.Tensor]]:
            started = time.perf_counter()
            made = batch_rows([requests[i] for i in keys])
            share[0] = (time.perf_counter() - started) / len(keys)
            return made

        def use(i: int, made: list[torch.Tensor]) -> None:
            if isinstance(tasks[i], SampleTask):
                sampling[i] = made[0]
            else:
                tasks[i].verify_s += share[0]
                tasks[i].rows_taken(made)

        batched_then_alone(list(requests), batched, lambda i: [request.alone() for request in requests[i]],
                           use, self.fail, f"{self.engine.name}: making rows together")

    def _draw_together(self, sampling: dict[int, torch.Tensor]) -> None:
        """Draw this forward's tokens of every sampling task (``sampling``: task -> its rows
        ``[K, V]``) in ONE call (:func:`verifiers.randomness.categorical_together`: each task's
        stream draws what its own call would); if that call raises, each task alone, failing only
        the tasks that fail (:func:`batched_then_alone`)."""
        tasks = self.tasks
        batched_then_alone(
            list(sampling),
            lambda indices: categorical_together([(tasks[i].source, sampling[i]) for i in indices]),
            lambda i: tasks[i].source.categorical(sampling[i]),
            lambda i, tokens: tasks[i].drawn(sampling[i], tokens),
            self.fail, f"{self.engine.name}: drawing tokens together",
        )

    def _verify_waiting(self) -> None:
        """Verify the blocks waiting after this forward, one verifier call per rule and block
        length (:func:`verify_together`; cut where its rows would pass ``STEP_TENSOR_BYTES``); if a
        call raises, each block alone, failing only the requests whose verification fails
        (:func:`batched_then_alone`)."""
        tasks = self.tasks
        groups: dict[tuple[str, int], list[int]] = {}
        for i, task in enumerate(tasks):
            if isinstance(task, ScoreVerifyTask) and task.result is None and task.batch_key is not None:
                groups.setdefault(task.batch_key, []).append(i)
        chunks = [chunk for indices in groups.values()  # each call's tensors below the step's largest
                  for chunk in byte_chunks(indices, [tasks[i].inputs[2].numel() * tasks[i].inputs[2].itemsize
                                                     for i in indices])]
        for indices in chunks:
            batched_then_alone(
                indices,
                lambda keys: verify_together([tasks[i] for i in keys]),
                lambda i: tasks[i].verified_alone(),
                lambda i, verified: tasks[i].finish(*verified),
                self.fail, f"{self.engine.name}: verifying blocks together",
            )

    # ------------------------------------------------------------------ the outcomes
    def _outcomes(self, forward_s: float, call_s: float = 0.0, first_round_s: float = 0.0,
                  ) -> tuple[list[ItemOutcome], list[Any]]:
        outcomes: list[ItemOutcome] = []
        payloads: list[Any] = []
        for index, task in enumerate(self.tasks):
            if task is None:
                outcome = ItemOutcome(error=self.errors[index], retryable=index in self.lost)
                outcomes.append(outcome)
                payloads.append(outcome)
                continue
            summary, payload = task.outcome()
            timing = CallTiming(forward_s=forward_s, verify_s=task.verify_s, forward_calls=task.forwards,
                                tokens_fed=task.tokens_fed, call_s=call_s, first_round_s=first_round_s)
            outcomes.append(ItemOutcome(value=summary, timing=timing, prompt_logits=task.prompt_logits))
            payloads.append(payload)
        return outcomes, payloads
