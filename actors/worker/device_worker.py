"""DeviceWorker: several models that share one device, hosted by ONE Ray actor (one process).

Where models share a device (one GPU, or this CPU's cores), a process per model costs more than
it gives: two CUDA contexts, the memory split by fractions, kernels of two processes
time-sliced, and a hop between processes for every draft call. A DeviceWorker hosts each of its
models as a :class:`actors.worker.model_worker.ModelWorker` object in its own process, each with its
own backend, KV cache slots, sessions and random streams, exactly as a separate worker would.

The rest of the group still addresses a hosted model by its name: bring-up hands the
coordinator a :class:`HostedModel` per model, which forwards ``handle.method.options(...).remote(...)``
to the host with ``model=<name>``, so the scheduler, the machines and the verification core are
unchanged. Two things differ, both in-process:

* :meth:`DeviceWorker.run_steps`: the scheduler's calls of one step on several models of this
  host, in ONE actor call, run in the order given (the proposers' calls first); a verifier reads
  its proposer's payloads in this process (no pickling, no object store, no peer link), and only
  the payloads another worker or a later step reads are returned;
* :meth:`DeviceWorker.burst`: a solo burst whose draft lives here calls the draft's engine
  directly.

KV cache: one budget for the worker (``engine.kv_cache_memory``; on a GPU unset = 0.9 of the memory
free once EVERY model's weights are loaded), split across its models by what a request holds: one
slot in each model it uses, so each model gets ``budget // sum(slot bytes)`` slots
(:func:`shared_kv_slots`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from actors.worker.bursts import BurstRecord
from actors.worker.cpu_binding import bind_process, release_openmp_team
from actors.worker.engine import DEFAULT_MAX_TOKENS_PER_STEP
from actors.model.eagle3_serving import hosting, is_eagle3_checkpoint
from actors.model.kv_budget import KVCacheBudgetError, budget_bytes, worker_kv_cache_memory
from actors.messages import ItemOutcome, OpenSession, WorkerInfo, WorkItem
from actors.worker.model_worker import ModelWorker, resolve_source

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostCall:
    """One model's call of a step inside a :meth:`DeviceWorker.run_steps` call.

    ``sources``: the payload lists this call's ScoreVerify items read, in the order their
    ``proposal_source[0]`` indexes: ``("local", k)`` is the payloads of call k of the same
    ``run_steps`` (run earlier, in this process), ``("arg", i)`` is ``source_payloads[i]`` of the
    ``run_steps`` call (another worker's call or an earlier step's, as an ObjectRef).
    ``keep_payloads``: return this call's payloads (another worker or a later step reads them);
    otherwise None is returned in their place.
    """

    model: str
    items: tuple[WorkItem, ...]
    sources: tuple[tuple[str, int], ...] = ()
    keep_payloads: bool = False


def shared_kv_slots(budget: int, slot_bytes: dict[str, int], where: str) -> int:
    """Slots each model of a worker holds when a request holds one slot in each: ``budget`` bytes
    over the bytes of one slot of every model; :class:`KVCacheBudgetError` naming the numbers when
    not even one request fits."""
    per_request = sum(slot_bytes.values())
    slots = budget // per_request
    if slots < 1:
        parts = ", ".join(f"{name} {size}" for name, size in slot_bytes.items())
        raise KVCacheBudgetError(
            f"worker {where}: the KV cache budget ({budget} bytes, {budget / 2**30:.2f} GiB) holds no request: one "
            f"request holds one slot in each model ({parts} bytes; {per_request} in all); raise "
            f"engine.kv_cache_memory to at least {per_request} or lower engine.max_model_len"
        )
    return int(slots)


class DeviceWorker:
    """Hosts the models of one device; use as a Ray actor: ``ray.remote(DeviceWorker).options(...)
    .remote(specs, ...)``. ``specs``: the :class:`cluster.config.ModelSpec` of each model (the
    ModelWorker arguments otherwise); ``worker_cls``: the class each model is hosted as (tests
    substitute fake models); ``cpu_cores``: bind the process to these cores at start
    (``resources.cpu_affinity``; None: not bound)."""

    def __init__(self, specs: Sequence[Any], idle_timeout_s: float = 300.0, max_sessions: int = 64,
                 prefix_caching: bool = True, *, kv_cache_memory: int | float | None = None,
                 max_model_len: int | None = None, max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP,
                 worker_cls: type = ModelWorker, cpu_cores: Sequence[int] | None = None):
        if not specs:
            raise ValueError("a DeviceWorker hosts at least one model")
        self.names = [spec.name for spec in specs]
        if cpu_cores:  # resources.cpu_affinity (cluster.serving.cpu_affinity): the whole process, its models included
            bind_process(cpu_cores, f"worker {'+'.join(self.names)}")
        self.models: dict[str, ModelWorker] = {}
        budget = None
        with hosting(self.models):  # an EAGLE-3 head finds its target among the models loaded before it
            for spec in sorted(specs, key=lambda spec: is_eagle3_checkpoint(spec.path)):
                worker = worker_cls(spec, idle_timeout_s, max_sessions, prefix_caching, max_model_len=max_model_len,
                                    max_tokens_per_step=max_tokens_per_step, kv_cache_memory=kv_cache_memory,
                                    shared_kv_budget=True)
                self.models[spec.name] = worker
            budget = worker_kv_cache_memory(kv_cache_memory, worker.device)
        if budget is not None:  # after every model's weights are loaded
            self._split_kv_budget(budget)
            if worker.device == "cpu":  # the new caches' fill ran here: end this thread's OpenMP team again
                release_openmp_team()

    def _split_kv_budget(self, kv_cache_memory: int | float) -> None:
        first = self.models[self.names[0]]
        where = "+".join(self.names)
        budget = budget_bytes(kv_cache_memory, first.device, where)
        slot_bytes = {name: int(worker.backend.slot_bytes) for name, worker in self.models.items()}
        slots = shared_kv_slots(budget, slot_bytes, where)
        for worker in self.models.values():
            worker.backend.resize_slots(slots)
        logger.info("worker %s: KV cache budget %d bytes, %d slots per model (%s bytes a request)", where, budget,
                    slots, sum(slot_bytes.values()))

    # ------------------------------------------------------------------ one model's face
    def _model(self, model: str | None) -> ModelWorker:
        if model is None:
            if len(self.models) != 1:
                raise ValueError(f"this worker hosts {self.names}: name the model")
            return self.models[self.names[0]]
        return self.models[model]

    def info(self, model: str | None = None) -> WorkerInfo:
        return self._model(model).info()

    def run_step(self, items: Sequence[WorkItem], source_payloads: Sequence[Any] = (), releases: Sequence[str] = (),
                 model: str | None = None) -> tuple[list[ItemOutcome], list[Any]]:
        return self._model(model).run_step(items, source_payloads, releases)

    def prompt_logits(self, session_id: str, prompt_ids: list[int], vocab_limit: int | None = None,
                      model: str | None = None) -> Any:
        return self._model(model).prompt_logits(session_id, prompt_ids, vocab_limit)

    def release(self, session_id: str, model: str | None = None) -> bool:
        return self._model(model).release(session_id)

    def num_sessions(self, model: str | None = None) -> int:
        return self._model(model).num_sessions()

    def engine_stats(self, model: str | None = None) -> dict[str, Any]:
        return self._model(model).engine_stats()

    def metrics(self, model: str | None = None) -> dict[str, float]:
        return self._model(model).metrics()

    def reap_idle_sessions(self, model: str | None = None) -> list[str]:
        return self._model(model).reap_idle_sessions()

    # ------------------------------------------------------------------ several models, one call
    def run_steps(self, calls: Sequence[HostCall], source_payloads: Sequence[Any] = (),
                  releases: dict[str, Sequence[str]] | None = None) -> tuple[Any, ...]:
        """Run ``calls`` in order, each in its model's engine (:meth:`actors.worker.engine.WorkerEngine.run_step`);
        ``releases``: model -> sessions to free first. Returns ``(outcomes_0, payloads_0, outcomes_1,
        ...)``: call with ``.options(num_returns=2 * len(calls))``."""
        releases = dict(releases or {})
        external = [resolve_source(source) for source in source_payloads]
        results: list[tuple[list[ItemOutcome], list[Any]]] = []
        for call in calls:
            sources = [results[index][1] if kind == "local" else external[index] for kind, index in call.sources]
            engine = self.models[call.model].engine
            results.append(engine.run_step(list(call.items), releases.pop(call.model, ()), sources))
        for model, ids in releases.items():  # models with sessions to free and no work this step
            self.models[model].engine.run_step([], ids)
        flat: list[Any] = []
        for call, (outcomes, payloads) in zip(calls, results):
            flat += [outcomes, payloads if call.keep_payloads else None]
        return tuple(flat)

    def burst(self, machine_blob: bytes, session_id: str, peers: dict[str, Any], eos_token_ids: Sequence[int] = (),
              budget_s: float = 0.1, releases: Sequence[str] = (), pre_drafted: tuple[Any, int] | None = None,
              opens: dict[str, OpenSession] | None = None, model: str | None = None,
              burst_id: str | None = None) -> Iterator[BurstRecord]:
        """A solo burst on ``model`` (:meth:`actors.worker.model_worker.ModelWorker.burst`); its peers hosted
        here are called in this process."""
        worker = self._model(model)
        local = {name: self.models[name] for name in peers if name in self.models}
        yield from worker.burst(machine_blob, session_id, peers, eos_token_ids, budget_s, releases, pre_drafted,
                                local_peers=local, opens=opens, burst_id=burst_id)

    def stop_burst(self, burst_id: str, model: str | None = None) -> None:
        """End the burst ``burst_id`` on ``model`` after its current iteration
        (:meth:`actors.worker.model_worker.ModelWorker.stop_burst`; its own concurrency group)."""
        self._model(model).stop_burst(burst_id)


class HostedModel:
    """A model hosted by a :class:`DeviceWorker`, as the rest of the group addresses it: a stand-in
    for its own actor handle (``handle.method.options(...).remote(*args)`` calls the host with
    ``model=<name>``). ``host_id`` names the host: models with one ``host_id`` share a process."""

    def __init__(self, host: Any, model: str, host_id: str):
        self.host = host
        self.model = model
        self.host_id = host_id

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(getattr(self.host, method), self.model)

    def __repr__(self) -> str:
        return f"HostedModel({self.model!r} on {self.host_id})"


class _HostedMethod:
    def __init__(self, method: Any, model: str):
        self._method = method
        self._model = model

    def options(self, **options: Any) -> _HostedMethod:
        return _HostedMethod(self._method.options(**options), self._model)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(*args, model=self._model, **kwargs)


def host_of(handle: Any) -> str | None:
    """The ``host_id`` of a hosted model's handle; None for a model with a worker of its own."""
    return handle.host_id if isinstance(handle, HostedModel) else None
