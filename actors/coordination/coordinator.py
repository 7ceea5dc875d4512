"""Coordinator: the async Ray actor that decodes requests on a group of ModelWorkers.

``Coordinator.generate(request)`` is an async generator method: callers stream it with
``coordinator.generate.options(num_returns="streaming").remote(request)`` and get one
:class:`actors.request_schema.GenerationChunk` per batch of accepted tokens; the last chunk has
``finished=True``, ``finish_reason`` and ``stats``. An invalid request raises
:class:`actors.request_schema.InvalidRequestError` (field + message) before any model work, so the
serving layer can answer 400; a failure during decoding (e.g. a worker error) ends the stream
with a chunk whose ``error`` is set (``finish_reason="error"``). Either way every session the
request opened is released on every worker, and other requests are unaffected.

Requests are decoded together by the step scheduler (:mod:`actors.coordination.scheduler`): each request
is a state machine (:mod:`verifiers.machines`, built by :mod:`actors.coordination.strategies`), and every
step each model worker gets one call with the work of every request in flight. A request
beyond ``max_concurrent_requests`` (at most the KV cache slots of the group's smallest worker,
:func:`running_limit`) waits its turn; beyond ``max_queued_requests`` more it is
refused with :class:`actors.coordination.admission.OverloadedError` (429 / RESOURCE_EXHAUSTED). A client
that goes away leaves at the next step. The coordinator itself holds no decoding math; a request
is checked against the deployment and its state built by :mod:`actors.coordination.preparation`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from actors.request_schema import GenerationChunk, GenerationRequest, InvalidRequestError, RequestStats, TokenLogprob
from actors.messages import WorkerInfo
from actors.coordination.metrics import (
    NO_METHOD,
    RAY_EXPORT_PERIOD_S,
    GroupIdentity,
    MetricsRecorder,
    RayMetricsExporter,
    RequestClock,
    SchedulerMetrics,
    group_snapshot,
    plan_labels,
)
from actors.coordination.plan import DecodingPlan
from actors.tokenizer import load_tokenizer
from actors.coordination.prompt_scoring import law_models, prompt_log_rows, prompt_logprobs
from actors.coordination.preparation import RequestPreparer
from actors.coordination.row_transport import RowTransport
from actors.coordination.scheduler import Scheduler, background_task
from actors.vocabulary import group_vocabulary, tokenizer_identity
from actors.worker.bursts import PROBE_GROUP

logger = logging.getLogger(__name__)

#: Seconds a metrics snapshot waits for each worker's counters (a busy worker answers after its
#: current step); a worker that does not answer in time is left out and counted as failed.
WORKER_METRICS_TIMEOUT_S = 2.0
DEFAULT_MODEL_GROUP = "specserve"


def _inside_ray_actor() -> bool:
    """True when this code runs in a Ray actor (where ``ray.util.metrics`` export works)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray here: nothing to export to
        return False


def merge_chunks(chunks: list[GenerationChunk]) -> GenerationChunk:
    """Consecutive chunks of one request as one (tokens and text in order; the last one's
    finish, stats and error). Under load a client's stream then costs one message per read,
    not one per scheduler step."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    logprobs = None if last.logprobs is None and chunks[0].logprobs is None else [
        entry for c in chunks for entry in (c.logprobs or [])
    ]
    return last.model_copy(
        update={"token_ids": [t for c in chunks for t in c.token_ids], "text": "".join(c.text for c in chunks),
                "logprobs": logprobs}
    )


def running_limit(max_concurrent: int, infos: dict[str, WorkerInfo]) -> int:
    """Requests run at once: ``limits.max_concurrent_requests``, at most the KV cache slots of the
    group's smallest worker (one slot per request on each worker; :mod:`actors.model.kv_budget`), so a
    request waits for a free slot instead of failing for lack of one."""
    slots = [info.kv_slots for info in infos.values() if info.kv_slots is not None]
    return min([int(max_concurrent), *slots])


class Coordinator:
    """Decodes requests with one strategy each over the workers of one model group.

    Use as an async Ray actor: ``ray.remote(Coordinator).options(...).remote(workers, config)``.

    workers: model name -> ModelWorker actor handle.
    config:  a :class:`cluster.config.GroupConfig` (roles, defaults, tokenizer path, limits);
             ``tokenizer_path=None`` runs on token ids only (no text, no stop strings).
    eos_token_ids: overrides the tokenizer's EOS id(s).
    identity: the group's metric labels (served model name, owning replica).
    export_to_ray: copy the metrics into ``ray.util.metrics`` every few seconds (default: when
    running as a Ray actor).
    """

    def __init__(self, workers: dict[str, Any], config: Any, eos_token_ids: list[int] | None = None,
                 identity: GroupIdentity | None = None, export_to_ray: bool | None = None):
        self.workers = dict(workers)
        self.config = config
        self.roles = dict(config.roles)
        missing = sorted(set(self.roles) - set(self.workers))
        if missing:
            raise ValueError(f"no worker for models {missing}")
        self.tokenizer = self._load_tokenizer(config.tokenizer_path)
        if eos_token_ids is not None:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        elif self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = frozenset([int(self.tokenizer.eos_token_id)])
        else:
            self.eos_token_ids = frozenset()
        self.preparer = RequestPreparer(config, self.tokenizer, self.eos_token_ids)
        self.identity = identity if identity is not None else GroupIdentity(DEFAULT_MODEL_GROUP)
        self.export_to_ray = _inside_ray_actor() if export_to_ray is None else export_to_ray
        self.metrics = SchedulerMetrics(MetricsRecorder(keep_pending=self.export_to_ray))
        self.scheduler = Scheduler(
            self.workers,
            max_running=config.max_concurrent_requests,
            max_waiting=config.max_queued_requests,
            cohorts=2 if config.uses_overlap else 1,
            request_timeout_s=config.request_timeout_s,
            metrics=self.metrics,
            goodput=config.goodput_gamma,
            pre_drafting=config.pre_drafting,
            max_tokens_per_step=config.max_tokens_per_step,
            burst_s=config.burst_ms / 1e3,
            step_tokens=config.step_tokens,
            first_step_tokens=config.first_step_tokens,
        )
        self.scheduler.calls.transport = RowTransport(getattr(config, "row_transport", "auto"))
        self.worker_infos: dict[str, WorkerInfo] | None = None
        self._infos_fetch: asyncio.Future | None = None  # the first fetch of the infos, while it runs
        self.vocab_limit: int | None = None  # the group's real tokens (actors.vocabulary), set with the infos
        self._export_task: asyncio.Task | None = None

    @staticmethod
    def _load_tokenizer(path: str | None):
        return None if path is None else load_tokenizer(path)

    # ------------------------------------------------------------------ info
    async def infos(self) -> dict[str, WorkerInfo]:
        """Every worker's :class:`WorkerInfo` (fetched once: callers that ask while the first fetch
        runs wait for it, so a burst of first requests makes one round of ``info`` calls and one
        vocabulary check, not one each; a fetch that failed is retried by the next caller)."""
        if self.worker_infos is None:
            if self._infos_fetch is None or self._infos_fetch.done():  # none yet, or the last one failed
                self._infos_fetch = asyncio.ensure_future(self._fetch_infos())
            return await asyncio.shield(self._infos_fetch)  # a cancelled caller leaves the fetch to the others
        return self.worker_infos

    async def _fetch_infos(self) -> dict[str, WorkerInfo]:
        """Ask every worker for its info; check the group's vocabulary (VocabularyMismatchError:
        bring-up asks for the infos before it serves, so a mismatched group never starts), set
        the limits that follow from the infos, then :attr:`worker_infos`."""
        names = list(self.workers)
        results = await asyncio.gather(*(self.workers[name].info.remote() for name in names))
        infos = dict(zip(names, results))
        self.vocab_limit = group_vocabulary(
            {name: info.vocab_size for name, info in infos.items()},
            {name: info.tokenizer for name, info in infos.items()},
            tokenizer_identity(self.tokenizer) if self.tokenizer is not None else None,
        )
        self.scheduler.max_running = running_limit(self.config.max_concurrent_requests, infos)
        self.scheduler.admission.kv_pools = {name: info.kv_pool for name, info in infos.items()
                                             if getattr(info, "kv_pool", None) is not None}
        self.worker_infos = infos  # set before the fetch completes: a done fetch without it failed
        return infos

    async def describe(self) -> dict[str, Any]:
        """Models (name, role, vocabulary, context, device), defaults and limits of the group."""
        infos = await self.infos()
        return {
            "models": {name: {"role": info.role, "vocab_size": info.vocab_size, "max_context": info.max_context,
                              "device": info.device, "gpu_ids": list(info.gpu_ids)} for name, info in infos.items()},
            "defaults": self.config.defaults.model_dump(),
            "max_concurrent_requests": self.config.max_concurrent_requests,
            "max_running": self.scheduler.max_running,
            "kv_slots": {name: info.kv_slots for name, info in infos.items()},
            "kv_blocks": await self._kv_blocks(),
            "preemptions": self.scheduler.admission.preemptions,
            "active_requests": sorted(self.scheduler.active_session_ids()),
        }

    async def _kv_blocks(self) -> dict[str, dict[str, int]]:
        """Each worker's KV blocks now: ``{"used", "free"}`` (workers without a pool, or that do
        not answer in time, are left out)."""
        totals, _failed = await self._worker_metrics()
        return {name: {"used": int(t["kv_blocks_used"]), "free": int(t["kv_blocks_free"])}
                for name, t in totals.items() if "kv_blocks_used" in t}

    async def engine_stats(self) -> dict[str, Any]:
        """Scheduler counters: steps, solo bursts, running and waiting requests, recent batch sizes
        and step seconds, how draft rows move (``engine.row_transport``), its fallbacks and the time
        recent steps' proposals took to reach their verifier (seconds)."""
        return {
            "steps": self.scheduler.steps,
            "bursts": self.scheduler.bursts,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "batch_sizes": list(self.scheduler.batch_sizes),
            "step_seconds": list(self.scheduler.step_seconds),
            "row_transport": self.scheduler.calls.transport.backend or "object_store",
            "row_fallbacks": self.scheduler.calls.transport.counters.fallbacks,
            "row_moving_s": list(self.scheduler.calls.transport.moving_s),
        }

    # ------------------------------------------------------------------ metrics
    async def metrics_snapshot(self) -> dict[str, Any]:
        """The group's metrics now (:func:`actors.coordination.metrics.group_snapshot`): the recorded
        families, running / waiting requests and every worker's cumulative counters (workers that
        do not answer within :data:`WORKER_METRICS_TIMEOUT_S` are left out and counted)."""
        self._ensure_export()
        worker_totals, failed = await self._worker_metrics()
        return self._snapshot(worker_totals, failed)

    def _snapshot(self, worker_totals: dict[str, dict[str, float]], failed: int) -> dict[str, Any]:
        return group_snapshot(self.identity, self.metrics.recorder, len(self.scheduler.running),
                              len(self.scheduler.waiting), worker_totals, failed)

    async def _worker_metrics(self) -> tuple[dict[str, dict[str, float]], int]:
        """Each worker's ``metrics()`` (name -> totals) and how many did not answer in time."""
        names = list(self.workers)

        async def one(name: str) -> dict[str, float]:
            probe = self.workers[name].metrics.options(concurrency_group=PROBE_GROUP)
            return await asyncio.wait_for(probe.remote(), timeout=WORKER_METRICS_TIMEOUT_S)

        results = await asyncio.gather(*(one(name) for name in names), return_exceptions=True)
        totals = {name: result for name, result in zip(names, results) if isinstance(result, dict)}
        for name, result in zip(names, results):
            if not isinstance(result, dict):
                logger.warning("metrics of worker %s unavailable: %s", name, type(result).__name__)
        return totals, len(names) - len(totals)

    def _ensure_export(self) -> None:
        """Start the periodic copy into ``ray.util.metrics`` (once, in the running event loop)."""
        if not self.export_to_ray or (self._export_task is not None and not self._export_task.done()):
            return
        self._export_task = background_task(self._export_forever())  # its worker calls are no request's

    async def _export_forever(self) -> None:
        exporter = RayMetricsExporter(self.identity)
        while True:
            await asyncio.sleep(RAY_EXPORT_PERIOD_S)
            try:
                worker_totals, failed = await self._worker_metrics()
                exporter.export(self._snapshot(worker_totals, failed), self.metrics.recorder.take_pending())
            except Exception:
                logger.exception("exporting metrics to Ray failed")

    async def health(self) -> bool:
        """True when every worker answers."""
        await asyncio.gather(*(worker.num_sessions.remote() for worker in self.workers.values()))
        return True

    # ------------------------------------------------------------------ validation
    async def _prepare(self, request: GenerationRequest, plan: DecodingPlan) -> tuple[list[int], int, int]:
        """Check everything about a request under its resolved plan against the group's workers
        (:meth:`RequestPreparer.prepare`); raises InvalidRequestError."""
        infos = await self.infos()
        return self.preparer.prepare(request, plan, infos, self.vocab_limit)

    async def validate(self, request: GenerationRequest | dict) -> dict[str, Any]:
        """Check a request without running it: the resolved plan and the prompt length, or
        InvalidRequestError naming the field."""
        request = self._parse(request)
        plan = self.preparer.plan(request)
        prompt_ids, vocab_limit, max_context = await self._prepare(request, plan)
        return {"plan": vars(plan), "prompt_tokens": len(prompt_ids), "max_context": max_context}

    @staticmethod
    def _parse(request: GenerationRequest | dict) -> GenerationRequest:
        if isinstance(request, GenerationRequest):
            return request
        return GenerationRequest.parse(request)

    # ------------------------------------------------------------------ decoding
    async def generate(self, request: GenerationRequest | dict) -> AsyncIterator[GenerationChunk]:
        """Stream the request's output (see the module docstring)."""
        self._ensure_export()
        plan: DecodingPlan | None = None
        try:
            request = self._parse(request)
            plan = self.preparer.plan(request)
            prompt_ids, vocab_limit, max_context = await self._prepare(request, plan)
        except InvalidRequestError:
            self.metrics.refused(plan_labels(plan), "invalid")
            raise
        prompt_entries = None
        if request.sampling.prompt_logprobs is not None:
            if request.sampling.max_tokens == 0:  # the prompt alone: no decoding
                yield await self._score_prompt_only(request, plan, prompt_ids, vocab_limit)
                return
            prompt_entries = await self._score_prompt(request, plan, prompt_ids, vocab_limit)
        state = self.preparer.request_state(request, plan, prompt_ids, vocab_limit, max_context)
        self.scheduler.submit(state)  # OverloadedError when the waiting line is full
        try:
            while True:
                chunks = [await state.chunks.get()]
                while not state.chunks.empty():  # the consumer fell behind: one chunk for all of them
                    chunks.append(state.chunks.get_nowait())
                chunk = merge_chunks(chunks)
                if prompt_entries is not None:  # the first chunk carries the prompt's
                    chunk = chunk.model_copy(update={"prompt_token_ids": prompt_ids, "prompt_logprobs": prompt_entries})
                    prompt_entries = None
                yield chunk
                if chunk.finished:
                    return
        finally:
            self.scheduler.cancel(state)  # no-op when finished; else it leaves at the next step

    async def _score_prompt_only(
        self, request: GenerationRequest, plan: DecodingPlan, prompt_ids: list[int], vocab_limit: int
    ) -> GenerationChunk:
        """A ``max_tokens: 0`` request: the prompt's log-probabilities alone, never seen by the
        scheduler, so counted here as it counts a request: admitted at once with its prompt
        tokens, ended ``length`` (``cancelled`` / ``error`` when it does not finish)."""
        labels, clock, submitted = plan_labels(plan), RequestClock(), time.perf_counter()
        self.metrics.admitted(labels, clock, len(prompt_ids), 0.0)
        try:
            entries = await self._score_prompt(request, plan, prompt_ids, vocab_limit)
        except BaseException as error:  # the client went away (cancelled) or the scoring failed
            status = "cancelled" if isinstance(error, asyncio.CancelledError) else "error"
            self.metrics.ended(labels, clock, status, time.perf_counter(), submitted)
            raise
        self.metrics.ended(labels, clock, "length", time.perf_counter(), submitted)
        stats = RequestStats(strategy=plan.strategy, method=plan.method, prompt_tokens=len(prompt_ids))
        return GenerationChunk(request_id=request.request_id, prompt_token_ids=prompt_ids, prompt_logprobs=entries,
                               finished=True, finish_reason="length", stats=stats)

    async def _score_prompt(
        self, request: GenerationRequest, plan: DecodingPlan, prompt_ids: list[int], vocab_limit: int
    ) -> list[TokenLogprob]:
        """The prompt's log-probabilities under the request's raw law (:mod:`actors.coordination.prompt_scoring`):
        every law model scores the prompt in one forward, concurrently."""
        models = law_models(plan)
        session_id = f"{request.request_id}/prompt-{uuid.uuid4().hex[:12]}"
        logits = await asyncio.gather(
            *(self.workers[name].prompt_logits.remote(session_id, prompt_ids, vocab_limit) for name in models)
        )
        rows = prompt_log_rows(plan, dict(zip(models, logits)))  # [P-1, V]
        return prompt_logprobs(rows, prompt_ids, request.sampling.prompt_logprobs)

    def count_invalid(self) -> None:
        """A request the ingress refused as invalid (400) before it reached here."""
        self.metrics.refused((NO_METHOD, NO_METHOD), "invalid")

    async def generate_all(self, request: GenerationRequest | dict) -> list[GenerationChunk]:
        """Non-streaming convenience: every chunk of :meth:`generate` in a list."""
        return [chunk async for chunk in self.generate(request)]
