"""Runners of the specserve cases: on separate Ray actors, and with every model in this process.

* :class:`RayRunner` (mode ``ray``) is the production path: ``cluster.serving.bringup.start_model_group``
  starts one ModelWorker actor per model and a Coordinator actor; each request streams
  through ``Coordinator.generate`` exactly as the serving layer calls it.
* :class:`LocalRunner` (mode ``local``) runs the *same* Coordinator and ModelWorker classes in
  this process: each worker is a plain object behind :class:`LocalActorHandle`, whose
  ``method.remote(...)`` runs the method right away and returns a completed asyncio future
  (what the coordinator awaits), resolving futures passed as arguments the way Ray resolves
  ObjectRefs. The decoding logic, the calls and the stats are identical; what is missing is
  exactly the distribution: processes, Ray calls and object transfers. The ratio of the two
  modes' tokens/s is the distribution overhead.

Both send ``prompt_ids`` (tokenized once by the harness), the case's speculation overrides,
``temperature`` with no top-k / top-p, the per-prompt seed, and ``ignore_eos=True`` so every
case generates exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from actors.request_schema import GenerationChunk, GenerationRequest, SamplingParams
from benchmarks.reports.records import RunRecord, record_from_stats
from benchmarks.served.suite import BenchCase

logger = logging.getLogger(__name__)

_request_counter = itertools.count()


def make_request(case: BenchCase, prompt_ids: list[int], *, seed: int, max_tokens: int, temperature: float) -> GenerationRequest:
    """The request every specserve mode sends for ``case`` on one prompt."""
    return GenerationRequest(
        request_id=f"bench-{next(_request_counter)}",
        prompt_ids=list(prompt_ids),
        sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True),
        speculation=case.speculation,
    )


class _ChunkCollector:
    """Accumulates streamed chunks; raises on an error chunk."""

    def __init__(self, case: BenchCase):
        self.case = case
        self.token_ids: list[int] = []
        self.final: GenerationChunk | None = None

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.error is not None:
            raise RuntimeError(f"{self.case.key} failed: {chunk.error}")
        self.token_ids.extend(chunk.token_ids)
        if chunk.finished:
            self.final = chunk

    def record(self, *, wall_s: float, prompt_id: str, prompt_kind: str, repeat: int, seed: int) -> RunRecord:
        if self.final is None or self.final.stats is None:
            raise RuntimeError(f"{self.case.key}: the stream ended without a final chunk with stats")
        return record_from_stats(
            case=self.case.key, prompt_id=prompt_id, prompt_kind=prompt_kind, repeat=repeat, seed=seed,
            wall_s=wall_s, num_tokens=len(self.token_ids), stats=self.final.stats,
        )


class RayRunner:
    """Mode ``ray``: a model group of separate Ray actors (joins ``RAY_ADDRESS`` when set)."""

    mode = "ray"

    def __init__(self, group_args: Any, *, temperature: float):
        import ray

        from cluster.serving.bringup import init_ray, start_model_group

        self.temperature = temperature
        self._started_ray = not ray.is_initialized()
        init_ray()
        self.group = start_model_group(group_args)

    def run(self, case: BenchCase, prompt_ids: list[int], *, seed: int, max_tokens: int,
            prompt_id: str, prompt_kind: str, repeat: int) -> RunRecord:
        import ray

        request = make_request(case, prompt_ids, seed=seed, max_tokens=max_tokens, temperature=self.temperature)
        collector = _ChunkCollector(case)
        started = time.perf_counter()
        stream = self.group.coordinator.generate.options(num_returns="streaming").remote(request)
        for ref in stream:
            collector.add(ray.get(ref))
        wall_s = time.perf_counter() - started
        return collector.record(wall_s=wall_s, prompt_id=prompt_id, prompt_kind=prompt_kind, repeat=repeat, seed=seed)

    def close(self) -> None:
        import ray

        self.group.shutdown()
        if self._started_ray:
            ray.shutdown()


class _LocalMethod:
    def __init__(self, method, num_returns: int = 1):
        self._method = method
        self._num_returns = num_returns

    def remote(self, *args, **kwargs) -> asyncio.Future | tuple[asyncio.Future, ...] | _LocalStream:
        if self._num_returns == "streaming":
            return _LocalStream(self._method(*(_resolve(a) for a in args), **{k: _resolve(v) for k, v in kwargs.items()}))
        loop = asyncio.get_running_loop()
        futures = tuple(loop.create_future() for _ in range(self._num_returns))
        try:
            args = tuple(_resolve(a) for a in args)
            kwargs = {k: _resolve(v) for k, v in kwargs.items()}
            result = self._method(*args, **kwargs)
            values = (result,) if self._num_returns == 1 else tuple(result)
            for future, value in zip(futures, values):
                future.set_result(value)
        except Exception as error:  # noqa: BLE001 - delivered to whoever awaits the futures, as Ray would
            for future in futures:
                future.set_exception(error)
        return futures[0] if self._num_returns == 1 else futures

    def options(self, num_returns: int | str = 1, **_ignored) -> _LocalMethod:
        """Ray's ``num_returns``: an int gives that many futures, ``"streaming"`` an async
        iterator of futures over a generator method; other options do not apply here."""
        return _LocalMethod(self._method, num_returns if isinstance(num_returns, int) or num_returns == "streaming" else 1)


class _LocalStream:
    """An in-process stand-in for Ray's ObjectRefGenerator: each item of a generator method, run
    step by step in the caller's loop, as a resolved future. The loop runs its other tasks before
    each item (as the items of a Ray stream arrive while the caller's loop runs): a request that
    arrives meanwhile is submitted, and a burst's stop signal reaches the generator."""

    def __init__(self, generator: Any):
        self._generator = generator

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> asyncio.Future:
        await asyncio.sleep(0)
        try:
            value = next(self._generator)
        except StopIteration:
            raise StopAsyncIteration from None
        future = asyncio.get_running_loop().create_future()
        future.set_result(value)
        return future


def _resolve(value: Any) -> Any:
    """A future passed as an argument, or inside a list argument, is replaced by its value (as
    Ray's ObjectRefs are by Ray, or by the worker that reads them)."""
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value.result() if isinstance(value, asyncio.Future) else value


class LocalActorHandle:
    """An in-process stand-in for a Ray actor handle: ``handle.method.remote(*args)``."""

    def __init__(self, instance: Any):
        self._instance = instance

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._instance, name))


class LocalRunner:
    """Mode ``local``: the Coordinator and every ModelWorker in this process."""

    mode = "local"

    def __init__(self, group_args: Any, *, temperature: float):
        from actors.coordination.coordinator import Coordinator
        from actors.model.eagle3_serving import hosting, is_eagle3_checkpoint
        from actors.worker.model_worker import ModelWorker

        from cluster.serving.bringup import worker_sessions

        config = group_args.freeze()
        self.temperature = temperature
        # The worker settings production passes (cluster.serving.bringup): slots, KV budget and context.
        loaded: dict[str, ModelWorker] = {}
        with hosting(loaded):  # one process: an EAGLE-3 head's target is loaded before it
            for m in sorted(config.models, key=lambda m: is_eagle3_checkpoint(m.path)):
                loaded[m.name] = ModelWorker(m, config.session_idle_timeout_s, max_sessions=worker_sessions(config),
                                             prefix_caching=config.prefix_caching, kv_cache_memory=config.kv_cache_memory,
                                             max_model_len=config.max_model_len,
                                             max_tokens_per_step=config.max_tokens_per_step)
        self.workers = {m.name: LocalActorHandle(loaded[m.name]) for m in config.models}
        self.coordinator = Coordinator(self.workers, config)
        self.loop = asyncio.new_event_loop()

    async def _collect(self, request: GenerationRequest, collector: _ChunkCollector) -> None:
        async for chunk in self.coordinator.generate(request):
            collector.add(chunk)

    def run(self, case: BenchCase, prompt_ids: list[int], *, seed: int, max_tokens: int,
            prompt_id: str, prompt_kind: str, repeat: int) -> RunRecord:
        request = make_request(case, prompt_ids, seed=seed, max_tokens=max_tokens, temperature=self.temperature)
        collector = _ChunkCollector(case)
        started = time.perf_counter()
        self.loop.run_until_complete(self._collect(request, collector))
        wall_s = time.perf_counter() - started
        return collector.record(wall_s=wall_s, prompt_id=prompt_id, prompt_kind=prompt_kind, repeat=repeat, seed=seed)

    def close(self) -> None:
        self.loop.run_until_complete(self.coordinator.scheduler.close())
        self.loop.close()
