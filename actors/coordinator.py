"""Coordinator: the async Ray actor that decodes requests on a group of ModelWorkers.

``Coordinator.generate(request)`` is an async generator method: callers stream it with
``coordinator.generate.options(num_returns="streaming").remote(request)`` and get one
:class:`actors.api.GenerationChunk` per batch of accepted tokens; the last chunk has
``finished=True``, ``finish_reason`` and ``stats``. An invalid request raises
:class:`actors.api.InvalidRequestError` (field + message) before any model work, so the
serving layer can answer 400; a failure during decoding (e.g. a worker error) ends the stream
with a chunk whose ``error`` is set (``finish_reason="error"``). Either way every session the
request opened is released on every worker, and other requests are unaffected.

The strategy comes from the registry in :mod:`actors.strategies` (keyed by the Strategy
literal); the coordinator itself holds no decoding math.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from actors.api import GenerationChunk, GenerationRequest, InvalidRequestError, RequestStats
from actors.messages import RowSampling, WorkerInfo
from actors.output import OutputTracker
from actors.plan import DecodingPlan, resolve_plan
from actors.strategies import STRATEGIES, RunContext, StatsRecorder, StrategyRun

logger = logging.getLogger(__name__)

MAX_EMPTY_STEPS = 64  # a strategy that makes no progress this many steps in a row is a bug


class Coordinator:
    """Decodes requests with one strategy each over the workers of one model group.

    Use as an async Ray actor: ``ray.remote(Coordinator).options(...).remote(workers, config)``.

    workers: model name -> ModelWorker actor handle.
    config:  a :class:`cluster.config.GroupConfig` (roles, defaults, tokenizer path, limits);
             ``tokenizer_path=None`` runs on token ids only (no text, no stop strings).
    eos_token_ids: overrides the tokenizer's EOS id(s).
    """

    def __init__(self, workers: dict[str, Any], config: Any, eos_token_ids: list[int] | None = None):
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
        self.admission = asyncio.Semaphore(config.max_concurrent_requests)
        self.worker_infos: dict[str, WorkerInfo] | None = None
        self.active_requests: set[str] = set()

    @staticmethod
    def _load_tokenizer(path: str | None):
        if path is None:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    # ------------------------------------------------------------------ info
    async def infos(self) -> dict[str, WorkerInfo]:
        """Every worker's :class:`WorkerInfo` (fetched once)."""
        if self.worker_infos is None:
            names = list(self.workers)
            results = await asyncio.gather(*(self.workers[name].info.remote() for name in names))
            self.worker_infos = dict(zip(names, results))
        return self.worker_infos

    async def describe(self) -> dict[str, Any]:
        """Models (name, role, vocabulary, context, device), defaults and limits of the group."""
        infos = await self.infos()
        return {
            "models": {name: {"role": info.role, "vocab_size": info.vocab_size, "max_context": info.max_context,
                              "device": info.device, "gpu_ids": list(info.gpu_ids)} for name, info in infos.items()},
            "defaults": vars(self.config.defaults) if hasattr(self.config.defaults, "__dict__") else {},
            "max_concurrent_requests": self.config.max_concurrent_requests,
            "active_requests": sorted(self.active_requests),
        }

    async def health(self) -> bool:
        """True when every worker answers."""
        await asyncio.gather(*(worker.num_sessions.remote() for worker in self.workers.values()))
        return True

    # ------------------------------------------------------------------ validation
    def _tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt_ids is not None:
            return [int(t) for t in request.prompt_ids]
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this deployment has no tokenizer; send prompt_ids")
        # The tokenizer's own convention (e.g. a BOS token for models trained with one), as
        # model.generate users would tokenize.
        return list(self.tokenizer(request.prompt)["input_ids"])

    async def _prepare(self, request: GenerationRequest) -> tuple[DecodingPlan, list[int], int, int]:
        """Resolve and check everything about a request; raises InvalidRequestError."""
        plan = resolve_plan(request.speculation, self.config.defaults, self.roles)
        infos = await self.infos()
        prompt_ids = self._tokenize(request)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt tokenizes to no tokens")
        vocab_limit = min(infos[name].vocab_size for name in plan.models)
        bad = [t for t in prompt_ids if not 0 <= t < vocab_limit]
        if bad:
            raise InvalidRequestError("prompt_ids", f"token ids must lie in [0, {vocab_limit}), got {bad[:5]}")
        max_context = min(infos[name].max_context for name in plan.models)
        if len(prompt_ids) >= max_context:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens; the model context is {max_context}"
            )
        sampling = request.sampling
        if len(prompt_ids) + sampling.max_tokens > max_context:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model context "
                f"({max_context}); at most {max_context - len(prompt_ids)}",
            )
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this deployment has none")
        return plan, prompt_ids, vocab_limit, max_context

    async def validate(self, request: GenerationRequest | dict) -> dict[str, Any]:
        """Check a request without running it: the resolved plan and the prompt length, or
        InvalidRequestError naming the field."""
        request = self._parse(request)
        plan, prompt_ids, vocab_limit, max_context = await self._prepare(request)
        return {"plan": vars(plan), "prompt_tokens": len(prompt_ids), "max_context": max_context}

    @staticmethod
    def _parse(request: GenerationRequest | dict) -> GenerationRequest:
        if isinstance(request, GenerationRequest):
            return request
        try:
            return GenerationRequest.model_validate(request)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "request"
            raise InvalidRequestError(field, f"{first['msg']} (got {first.get('input')!r})") from None

    # ------------------------------------------------------------------ decoding
    async def generate(self, request: GenerationRequest | dict) -> AsyncIterator[GenerationChunk]:
        """Stream the request's output (see the module docstring)."""
        request = self._parse(request)
        plan, prompt_ids, vocab_limit, max_context = await self._prepare(request)
        async with self.admission:
            async for chunk in self._decode(request, plan, prompt_ids, vocab_limit, max_context):
                yield chunk

    async def generate_all(self, request: GenerationRequest | dict) -> list[GenerationChunk]:
        """Non-streaming convenience: every chunk of :meth:`generate` in a list."""
        return [chunk async for chunk in self.generate(request)]

    async def _decode(
        self, request: GenerationRequest, plan: DecodingPlan, prompt_ids: list[int], vocab_limit: int, max_context: int
    ) -> AsyncIterator[GenerationChunk]:
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        session_id = f"{request.request_id}/{uuid.uuid4().hex[:12]}"
        stats = StatsRecorder()
        ctx = RunContext(
            session_id=session_id,
            plan=plan,
            workers=self.workers,
            sampling=RowSampling(sampling.temperature, sampling.top_k, sampling.top_p, vocab_limit),
            seed=seed,
            prompt_ids=prompt_ids,
            max_new_tokens=sampling.max_tokens,
            max_context=max_context,
            stats=stats,
        )
        run: StrategyRun = STRATEGIES[plan.strategy](ctx)
        output = OutputTracker(
            self.tokenizer,
            max_tokens=sampling.max_tokens,
            stop=sampling.stop,
            eos_token_ids=self.eos_token_ids,
            ignore_eos=sampling.ignore_eos,
        )
        streams = run.session_streams()
        opened: list[str] = []
        started = time.perf_counter()
        self.active_requests.add(session_id)
        try:
            opened = list(streams)
            await asyncio.gather(
                *(self.workers[name].open_session.remote(session_id, prompt_ids, ctx.sampling, seeds)
                  for name, seeds in streams.items())
            )
            empty_steps = 0
            while not output.finished:
                tokens = await run.step()
                delta = output.add(tokens)
                if not delta.token_ids and not output.finished:
                    empty_steps = empty_steps + 1 if not tokens else 0
                    if empty_steps > MAX_EMPTY_STEPS:
                        raise RuntimeError(f"strategy {plan.strategy} made no progress in {MAX_EMPTY_STEPS} steps")
                    continue
                empty_steps = 0
                if output.finished:
                    break
                yield GenerationChunk(request_id=request.request_id, token_ids=delta.token_ids, text=delta.text)
            final_stats = self._stats(plan, len(prompt_ids), output, stats, time.perf_counter() - started)
            yield GenerationChunk(
                request_id=request.request_id,
                token_ids=delta.token_ids,
                text=delta.text,
                finished=True,
                finish_reason=output.finish_reason,
                stats=final_stats,
            )
        except (asyncio.CancelledError, GeneratorExit):
            logger.info("request %s cancelled", session_id)
            raise
        except Exception as error:  # a worker failed: end this request only, with a clear error
            logger.exception("request %s failed", session_id)
            yield GenerationChunk(
                request_id=request.request_id,
                finished=True,
                finish_reason="error",
                error=f"{type(error).__name__}: {error}",
                stats=self._stats(plan, len(prompt_ids), output, stats, time.perf_counter() - started),
            )
        finally:
            self.active_requests.discard(session_id)
            for name in opened:
                self.workers[name].release.remote(session_id)  # fire and forget: also runs on cancel

    @staticmethod
    def _stats(plan: DecodingPlan, prompt_tokens: int, output: OutputTracker, stats: StatsRecorder, elapsed: float) -> RequestStats:
        completion = len(output.token_ids)
        work = stats.time_draft_s + stats.time_target_s + stats.time_verify_s
        return RequestStats(
            strategy=plan.strategy,
            method=plan.method,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            target_calls=stats.target_calls,
            model_calls=dict(stats.model_calls),
            accepted_lengths=list(stats.accepted_lengths),
            block_efficiency=completion / stats.target_calls if stats.target_calls else 0.0,
            tokens_per_second=completion / elapsed if elapsed > 0 else 0.0,
            time_draft_s=stats.time_draft_s,
            time_target_s=stats.time_target_s,
            time_verify_s=stats.time_verify_s,
            time_coordination_s=max(0.0, elapsed - work),
            bytes_moved=stats.bytes_moved,
        )
