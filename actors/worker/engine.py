"""The worker engine: one step = the needs of every request on this model, batched.

:class:`WorkerEngine.run_step` takes the work items of one scheduler step (a :mod:`verifiers.machines`
need per request, with the session to run it in) and runs them together (:class:`actors.worker.step.Step`):
every forward pass of the step is ONE ragged forward over every session that still has tokens to
feed (:class:`actors.model.batch.RowWork` rows in a :class:`actors.model.backends.SlotBackend`), cut
by length where padding would cost more than another forward
(:func:`actors.worker.forward_plan.forward_groups`). A step makes as many forwards as its longest
item needs: one for scoring / verification / next logits, ``count`` for sampling ``count`` tokens
(the sampling items drop out as they finish).

Each item is a small task (:mod:`actors.worker.tasks`, :mod:`actors.worker.verify_tasks`) that
says which row it needs in the next forward and takes that row's logits. Draws use the session's
own random streams in the order the machine's contract states, so a request's tokens do not
depend on its neighbours. Verification runs here, next to the target rows (only tokens travel
back); logits leave the device once per forward (one copy of the kept rows of every session), and
rows are computed with the one sampling path on the host (:mod:`actors.worker.rows`), which is
where the verifiers run, in the request's precision.

Chunked prefill: a :class:`actors.messages.Prefill` item feeds the next chunk of a new
session's prompt. A step's token budget (``max_tokens_per_step``) goes first to the rows of the
other items (decoding, verification, short prompts), and what is left to the prefill chunks, in
item order (:func:`actors.worker.forward_plan.prefill_grants`); the first prompt in line always
gets at least a share of the budget, so no prompt waits forever behind running streams; while
other rows run, the chunks are also paced to the measured step costs
(:mod:`actors.worker.prefill_pacer`). A
chunk is an ordinary causal row at the session's own columns and positions, so the keys/values
it writes are those a one-shot prefill writes; the prompt's last token stays pending, and the
decoding machine's first need computes the row after the prompt once the whole prompt is cached.

Prompt log-probabilities (:meth:`WorkerEngine.prompt_logits`) and failures, which stay with their
request: :mod:`actors.worker.step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from actors.messages import ItemOutcome, OpenSession, Prefill, RowSampling, WorkItem
from actors.model.device_health import DeviceBrokenError
from actors.worker.cpu_binding import ForwardThreads, follow_torch_threads
from actors.worker.prefill_pacer import PrefillPacer
from actors.worker.prefix_cache import PrefixCache
from actors.worker.sessions import SessionStore
from actors.worker.step import Step
from verifiers.machines.needs import NextLogits

#: ``engine.max_tokens_per_step`` when unset: tokens one worker step feeds at most (the rows of
#: its first forward round), prefill chunks included.
DEFAULT_MAX_TOKENS_PER_STEP = 512


class WorkerEngine:
    """Sessions + a slot backend + the batched step (:class:`actors.worker.step.Step`) and the
    worker's counters. Thread-safe (one step at a time)."""

    def __init__(self, backend: Any, name: str, idle_timeout_s: float = 300.0, prefix_caching: bool = True,
                 max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP):
        if int(max_tokens_per_step) < 1:
            raise ValueError(f"engine.max_tokens_per_step must be >= 1, got {max_tokens_per_step}")
        self.backend = backend
        self.name = name
        self.max_tokens_per_step = int(max_tokens_per_step)
        self.prefill_pacer = PrefillPacer()  # decode first: prefill chunks sized from measured step costs
        self.prefix_cache = PrefixCache(backend, enabled=prefix_caching)
        self.sessions = SessionStore(self.prefix_cache, idle_timeout_s, name)
        self.steps = 0
        self.rows_per_forward: list[int] = []  # recent batch sizes (for metrics)
        self.forward_threads: ForwardThreads | None = None  # a CPU worker's threads per forward (cpu_binding)
        # Cumulative since the worker started (monotonic; read at scrape time, see metrics()).
        self.forward_seconds_total = 0.0
        self.step_seconds_total = 0.0
        self.forward_passes_total = 0
        # Called with the error when the device broke mid-step (actors.model.device_health); the
        # model worker ends its process there, for Ray to restart it. None: the error raises on.
        self.on_device_broken: Callable[[DeviceBrokenError], None] | None = None
        self.preemptions_total = 0  # sessions whose KV blocks went back to the pool (recomputed later)
        self._step_started = 0.0  # time.monotonic() when the running step began
        cache = getattr(backend, "cache", None)
        if cache is not None and hasattr(cache, "reclaim"):
            cache.reclaim = self._reclaim

    def metrics(self) -> dict[str, float]:
        """Cumulative counters: seconds in forward passes and in step calls, steps, forward
        passes, prompt tokens opened and reused from the prefix cache, failed lean forwards
        (:mod:`actors.model.device_health`), and the open sessions now
        (``actors.coordination.metrics.WORKER_KEYS``)."""
        return {
            "forward_seconds_total": self.forward_seconds_total,
            "step_seconds_total": self.step_seconds_total,
            "steps": self.steps,
            "forward_passes_total": self.forward_passes_total,
            "sessions": len(self.sessions),
            "prompt_tokens_total": self.prefix_cache.prompt_tokens_total,
            "prefix_reused_tokens_total": self.prefix_cache.reused_tokens_total,
            "lean_forward_failures_total": getattr(getattr(self.backend, "lean_failures", None), "total", 0),
            "preemptions_total": self.preemptions_total,
            **self.block_counts(),
        }

    def block_counts(self) -> dict[str, int]:
        """``kv_blocks_used`` / ``kv_blocks_free`` (free, or held only by freed slots) of the KV
        block pool; empty for a backend without one."""
        counts = getattr(self.backend, "block_counts", None)
        if counts is None:
            return {}
        with self.sessions.lock:  # not while a step changes the tables
            blocks = counts()
        return {"kv_blocks_used": blocks["used"], "kv_blocks_free": blocks["free"] + blocks["cached"]}

    def _reclaim(self) -> bool:
        """The KV pool ran dry inside a step: preempt the least recently used open session with no
        item in this step (the coordinator paused its request, or it has ended and waits for its
        release). Its blocks go back and its session keeps its committed context and random
        streams, so when it runs again it recomputes the same keys from its tokens and draws on
        as if nothing happened. -> whether there was one."""
        for session in self.sessions.idle(self._step_started):
            if self.backend.cache.held_blocks(session.slot):
                session.base, session.chains = 0, []
                self.backend.truncate(session.slot, 0)
                self.preemptions_total += 1
                return True
        return False

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
        follow_torch_threads()  # Ray may run this call on any of its threads (actors.worker.cpu_binding)
        with self.sessions.lock:
            started = time.perf_counter()
            try:
                return self._run_step(items, releases, source_payloads)
            except DeviceBrokenError as error:
                if self.on_device_broken is not None:
                    self.on_device_broken(error)
                raise
            finally:
                self.step_seconds_total += time.perf_counter() - started

    def _run_step(
        self, items: Sequence[WorkItem], releases: Sequence[str], source_payloads: Sequence[Sequence[Any]]
    ) -> tuple[list[ItemOutcome], list[Any]]:
        """The body of :meth:`run_step` (under the session lock)."""
        self._step_started = time.monotonic()  # the step's sessions are used from now on (not preempted)
        for session_id in releases:
            self.sessions.release(session_id)
        return Step(self, items, source_payloads).run()
