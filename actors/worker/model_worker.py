"""ModelWorker: one causal LM (draft, target or ensemble member) in its own Ray actor.

A thin Ray face over a :class:`actors.worker.engine.WorkerEngine`: the scheduler calls :meth:`run_step`
once per step with the work of every request in flight on this model, and the engine runs it
as batched forwards over the sessions' KV cache slots (:mod:`actors.worker.sessions`,
:mod:`actors.model.kv_cache`). Call it with ``.options(num_returns=2)``: the first return (outcomes:
tokens, small results, timings, errors) goes to the scheduler, the second (payloads: the
proposals' logits) is passed as an ObjectRef straight to the worker that verifies them, so
probability rows never pass through the coordinator.

Random streams: each session owns the streams the request's layout assigns to this worker
(``verifiers.randomness.stream_seeds``), e.g. ``{"sample": seed0}`` on the draft and
``{"verify": seed1}`` on the target for speculative decoding.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from actors.model.backends import SlotBackend
from actors.model.eagle3_serving import Eagle3Backend, is_eagle3_checkpoint
from actors.worker.bursts import BurstRecord, BurstStops, run_burst
from actors.worker.allocator import keep_freed_memory
from actors.worker.cpu_binding import (ForwardThreads, bind_process, current_cores, release_openmp_team,
                                      set_torch_threads, torch_thread_count)
from actors.worker.engine import DEFAULT_MAX_TOKENS_PER_STEP, WorkerEngine
from actors.model.kv_budget import worker_kv_cache_memory
from actors.messages import FailedSource, ItemOutcome, KVPool, OpenSession, WorkerInfo, WorkItem
from actors.worker.peer_link import LinkCall, PeerLink, PeerLinkAddress, PeerLinkError, PeerLinkServer
from actors.worker.row_transport import HeldRows, Layout, attach_rows, hold_rows
from actors.model.simulated_device import on_simulated_device
from actors.vocabulary import load_tokenizer_identity

logger = logging.getLogger(__name__)

REAPER_PERIOD_S = 5.0
SCRATCH_COLUMNS = 288  # cache columns past the context per slot: K x gamma drafts, queued segments
LINK_RETRY_S = 30.0  # a peer link that could not open: Ray calls, then try again after this long
LINK_RESTART_RETRY_S = 1.0  # ... or after this long when the peer was restarting (it listens again soon)
#: The exit status of a worker process whose device broke (:meth:`ModelWorker.device_broken`).
DEVICE_BROKEN_EXIT_STATUS = 75
_exit_process = os._exit  # replaced in the tests, which cannot break a device


class Resolved:
    """The return of a call already run in this process (a hosted peer's, :mod:`actors.worker.device_worker`):
    ``result()`` as a future's."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


def resolve_source(source: Any) -> Any:
    """A payload list, fetched if it is an ObjectRef; a :class:`FailedSource` if that fails."""
    import ray

    if isinstance(source, Resolved):
        return source.value
    if not isinstance(source, ray.ObjectRef):
        return source
    try:
        return ray.get(source)
    except Exception as error:  # noqa: BLE001 - reported to the items that read it
        return FailedSource(f"{type(error).__name__}")


def _fetch(refs: Sequence[Any]) -> list[Any]:
    """The values of a peer call's returns: Ray ObjectRefs (one ``ray.get``), a call on a
    :class:`~actors.worker.peer_link.PeerLink`, or resolved futures of an in-process handle
    (``benchmarks.served.runners.LocalActorHandle``)."""
    import ray

    if len(refs) == 1 and isinstance(refs[0], LinkCall):
        return list(refs[0].result())
    if all(isinstance(ref, ray.ObjectRef) for ref in refs):
        return ray.get(list(refs))
    if all(isinstance(ref, Resolved) for ref in refs):
        return [ref.value for ref in refs]
    return [ref.result() for ref in refs]


def stamped(returns: tuple[list[ItemOutcome], list[Any]], sources_at: float) -> tuple[list[ItemOutcome], list[Any]]:
    """A call's (outcomes, payloads) with each outcome's timing stamped with ``sources_at`` and the
    call's end (:class:`~actors.messages.CallTiming`)."""
    outcomes, payloads = returns
    ended_at = time.time()
    stamp = {"sources_at": sources_at, "ended_at": ended_at}
    return [dataclasses.replace(o, timing=dataclasses.replace(o.timing, **stamp)) for o in outcomes], payloads


class ModelWorker:
    """Hosts one model; use as a Ray actor: ``ray.remote(ModelWorker).options(...).remote(spec)``.

    ``spec`` is a :class:`cluster.config.ModelSpec` (name, path, role, dtype, revision,
    max_context, num_gpus, torch_threads). On a GPU the worker uses the GPU Ray assigned it;
    on CPU it caps torch to ``spec.torch_threads`` threads (``"auto"``: the cores it may run on,
    after binding). The KV cache holds one slot per open session: as many as ``kv_cache_memory``
    holds (bytes, or on a GPU a fraction of the memory free after the weights; unset: 0.9 on a GPU),
    ``max_sessions`` when there is no budget (CPU, unset); each slot holds ``max_model_len`` tokens
    (default: the model's context) plus scratch columns (:mod:`actors.model.kv_budget`).
    ``prefix_caching`` lets a new session copy the longest prefix of its prompt the worker already holds
    (:mod:`actors.worker.prefix_cache`).
    ``max_tokens_per_step``: the tokens one step feeds at most, prompts' prefill chunks
    included (:mod:`actors.worker.engine`, chunked prefill). ``cpu_cores``: bind this process to
    these cores at start (``resources.cpu_affinity``, :mod:`actors.worker.cpu_binding`; None: not
    bound).
    """

    def __init__(self, spec: Any, idle_timeout_s: float = 300.0, max_sessions: int = 64, prefix_caching: bool = True,
                 *, kv_cache_memory: int | float | None = None, max_model_len: int | None = None,
                 max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP, shared_kv_budget: bool = False,
                 cpu_cores: Sequence[int] | None = None):
        if cpu_cores:  # resources.cpu_affinity (cluster.serving.cpu_affinity): this process, before any model work
            bind_process(cpu_cores, f"worker {spec.name}")
        if getattr(spec, "keep_freed_memory", True):  # engine.keep_freed_memory (actors.worker.allocator)
            keep_freed_memory()
        self.spec = spec
        # shared_kv_budget: hosted with other models (actors.worker.device_worker), whose worker sizes one
        # budget for all of them once every model is loaded: one slot until then.
        self.kv_cache_memory = None if shared_kv_budget else kv_cache_memory
        self.shared_kv_budget = shared_kv_budget
        self.max_model_len = max_model_len
        self.device = self._pick_device()
        thread_count = None  # a CPU worker's torch threads
        if self.device == "cpu":
            # resources.torch_threads; "auto": the cores of this process's mask, read after binding above
            threads = getattr(spec, "torch_threads", 1)
            thread_count = torch_thread_count(threads)
            set_torch_threads(thread_count)  # applied again in each thread that runs a step
            logger.info("worker %s: %d torch thread(s) (resources.torch_threads %s)", spec.name, thread_count, threads)
        self.max_sessions = int(max_sessions)
        if shared_kv_budget and worker_kv_cache_memory(kv_cache_memory, self.device) is not None:
            self.max_sessions = 1
        self.engine = WorkerEngine(on_simulated_device(self._load_backend(), spec), spec.name, idle_timeout_s,
                                   prefix_caching=prefix_caching, max_tokens_per_step=max_tokens_per_step)
        self.engine.on_device_broken = self.device_broken
        if thread_count is not None:
            self.engine.forward_threads = ForwardThreads(thread_count, self._parameter_count(),
                                                         getattr(spec, "one_thread_below", 0))
        if hasattr(self.engine.backend, "attach_engine"):  # an EAGLE-3 head reads its sessions' contexts
            self.engine.backend.attach_engine(self.engine)
        self.tokenizer_identity = load_tokenizer_identity(spec.path)  # checked against the group's at start-up
        self._reaper = threading.Thread(target=self._reap_forever, name="session-reaper", daemon=True)
        self._reaper.start()
        self._link_server: PeerLinkServer | None = None  # started when a peer first asks for it
        self._links: dict[str, PeerLink | None] = {}  # peer actor id -> link (None: another node, Ray calls)
        self._link_retry_at: dict[str, float] = {}  # peer actor id -> when to try opening a link again
        self._links_lock = threading.Lock()
        self._burst_stops = BurstStops()  # written by stop_burst, in its own concurrency group
        self._held_rows = HeldRows()  # rows kept back for take_rows (actors.worker.row_transport)
        if self.device == "cpu":  # steps run on another thread: end this one's OpenMP team (cpu_binding)
            release_openmp_team()

    # ------------------------------------------------------------------ set-up
    def _parameter_count(self) -> int:
        """The parameters of this worker's model, packed quantized weights (buffers) included; 0 where
        its backend holds no torch module."""
        model = getattr(self.engine.backend, "model", None)
        if not isinstance(model, torch.nn.Module):
            return 0
        return sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())

    def _pick_device(self) -> str:
        gpu_ids = self._gpu_ids()
        if gpu_ids and torch.cuda.is_available():
            return "cuda"  # Ray sets CUDA_VISIBLE_DEVICES to the GPU it assigned this actor
        if gpu_ids:
            logger.warning("Ray assigned GPUs %s but torch sees no CUDA device; using CPU", gpu_ids)
        return "cpu"

    @staticmethod
    def _gpu_ids() -> tuple[Any, ...]:
        try:
            import ray

            return tuple(ray.get_gpu_ids()) if ray.is_initialized() else ()
        except RuntimeError:
            return ()

    def _load_backend(self) -> Any:
        spec = self.spec  # dtype None: the checkpoint's on a GPU, float32 on CPU
        if is_eagle3_checkpoint(spec.path):  # a head over its target in this process (actors.model.eagle3_serving)
            return Eagle3Backend.load(spec)
        return SlotBackend.load(
            spec.path, dtype=spec.dtype, revision=spec.revision, device=self.device, max_context=spec.max_context,
            max_slots=self.max_sessions, scratch_columns=SCRATCH_COLUMNS,
            max_model_len=self.max_model_len,
            kv_cache_memory=None if self.shared_kv_budget else worker_kv_cache_memory(self.kv_cache_memory, self.device),
            lean_forward=getattr(spec, "lean_forward", True), quantization=getattr(spec, "quantization", None),
            cuda_graphs=getattr(spec, "cuda_graphs", False),
        )

    @property
    def backend(self) -> Any:
        return self.engine.backend

    @staticmethod
    def _node_id() -> str:
        try:
            import ray

            if ray.is_initialized():
                return ray.get_runtime_context().get_node_id()
        except RuntimeError:
            pass
        return ""

    def info(self) -> WorkerInfo:
        """Name, role, vocabulary, context length, KV cache slots and placement of this worker."""
        node_id = self._node_id()
        return WorkerInfo(
            name=self.spec.name,
            role=self.spec.role,
            vocab_size=self.backend.vocab_size,
            max_context=self.backend.max_context,
            device=self.device,
            kv_slots=int(self.backend.max_slots),
            kv_pool=self._kv_pool(),
            gpu_ids=self._gpu_ids(),
            node_id=node_id,
            pid=os.getpid(),
            tokenizer=self.tokenizer_identity,
            forward_path=str(getattr(self.backend, "forward_path", "")),
            cpu_cores=current_cores(),
        )

    def device_broken(self, error: Exception) -> None:
        """The device failed beyond repair (:mod:`actors.model.device_health`): end this process
        at once, as a crash, so that Ray restarts the actor (``max_restarts``) on a fresh device
        context; the call in flight fails with a ``RayActorError``, which the coordinator handles
        as any worker that died (its requests end retryably, the group serves again)."""
        logger.critical("worker %s: its device is broken (%s: %s); ending the process so that Ray restarts it",
                        self.spec.name, type(error).__name__, error)
        for handler in logging.getLogger().handlers:
            handler.flush()
        _exit_process(DEVICE_BROKEN_EXIT_STATUS)

    def _kv_pool(self) -> KVPool | None:
        """The backend's KV block pool (None: a backend without one)."""
        cache = getattr(self.backend, "cache", None)
        if not hasattr(cache, "num_blocks"):
            return None
        return KVPool(blocks=int(cache.num_blocks), block_size=int(cache.block_size), reserve=SCRATCH_COLUMNS)

    # ------------------------------------------------------------------ the step
    def run_step(
        self, items: Sequence[WorkItem], source_payloads: Sequence[Any] = (), releases: Sequence[str] = ()
    ) -> tuple[list[ItemOutcome], list[Any]]:
        """Run this worker's call of one scheduler step (:meth:`actors.worker.engine.WorkerEngine.run_step`).
        ``source_payloads`` are the payload lists of the calls this one's ScoreVerify items read,
        as ObjectRefs inside the list (so Ray does not fail the whole call when one source failed: a source
        that cannot be read fails only the items that read it) or as plain lists."""
        sources = [resolve_source(source) for source in source_payloads]
        return stamped(self.engine.run_step(items, releases, sources), time.time() if source_payloads else 0.0)

    # ------------------------------------------------------------------ rows over Ray Direct Transport
    def run_step_holding(self, items: Sequence[WorkItem], key: str, rows_device: str = "cpu",
                         releases: Sequence[str] = ()) -> tuple[list[ItemOutcome], list[Any]]:
        """:meth:`run_step` whose payloads' logits are held back under ``key`` (on ``rows_device``)
        for :meth:`take_rows` (:mod:`actors.worker.row_transport`); its payloads carry tokens only."""
        outcomes, payloads = stamped(self.engine.run_step(items, releases, []), 0.0)
        payloads, held = hold_rows(payloads, rows_device)
        self._held_rows.keep(key, held)
        return outcomes, payloads

    def take_rows(self, key: str) -> tuple[Layout, torch.Tensor]:
        """The rows :meth:`run_step_holding` held under ``key``: ``(layout, rows [N])``. Called with
        ``.options(tensor_transport=...)``, so ``rows`` moves straight to the worker whose call reads it."""
        return self._held_rows.take(key)

    def run_step_rows(self, items: Sequence[WorkItem], source_payloads: Sequence[Any], releases: Sequence[str],
                      rows_of: Sequence[int], *rows: tuple[Layout, torch.Tensor]) -> tuple[list[ItemOutcome], list[Any]]:
        """:meth:`run_step` whose sources ``rows_of[i]`` had their logits held back: ``rows[i]`` (top-level
        arguments, which Ray Direct Transport moves; :meth:`take_rows`) puts them back first."""
        sources = [resolve_source(source) for source in source_payloads]
        for index, held in zip(rows_of, rows):
            if isinstance(sources[index], list):  # else a FailedSource: its items fail as before
                sources[index] = attach_rows(sources[index], held)
        return stamped(self.engine.run_step(items, releases, sources), time.time())

    def burst(
        self, machine_blob: bytes, session_id: str, peers: dict[str, Any], eos_token_ids: Sequence[int] = (),
        budget_s: float = 0.1, releases: Sequence[str] = (), pre_drafted: tuple[Any, int] | None = None,
        local_peers: dict[str, ModelWorker] | None = None, opens: dict[str, OpenSession] | None = None,
        burst_id: str | None = None,
    ) -> Iterator[BurstRecord]:
        """Run one request's iterations here for up to ``budget_s`` seconds (:mod:`actors.worker.bursts`):
        ``machine_blob`` is its pickled machine, ``peers`` the handles of the other models'
        workers it uses, called directly, one ``run_step`` call per iteration and model (None for a
        model of ``local_peers``), ``pre_drafted`` where its last PreDraft's chains are; ``opens`` the request's sessions to open
        (model -> OpenSession; each with its model's first need); ``local_peers``: the peers hosted in this
        process (:mod:`actors.worker.device_worker`), whose engines run their calls at once, here; ``burst_id``: the
        id a :meth:`stop_burst` names to end it after its current iteration. A generator:
        call it with ``.options(num_returns="streaming")``; one :class:`~actors.worker.bursts.BurstRecord` per iteration."""
        local_peers = local_peers or {}
        machine = pickle.loads(machine_blob)
        if releases:
            self.engine.run_step([], releases)
        link_calls: list[LinkCall] = []
        # With pre-drafting an iteration's Sample and PreDraft on the draft must run in the order
        # sent, which only Ray's per-caller order gives (the link's thread would not wait): all Ray.
        use_links = not getattr(machine, "pre_drafting", 0)

        def local_step(items: list[WorkItem], sources: list[Any]) -> tuple[list[ItemOutcome], list[Any]]:
            return self.engine.run_step(items, (), sources)

        def peer_submit(model: str, items: list[WorkItem]) -> tuple[Any, ...]:
            if model in local_peers:
                outcomes, payloads = local_peers[model].engine.run_step(items, (), ())
                return Resolved(outcomes), Resolved(payloads)
            link = self._peer_link(peers[model]) if use_links else None
            if link is not None:
                try:
                    link_calls.append(link.submit(items))
                    return (link_calls[-1],)
                except PeerLinkError:
                    link.close()  # broken: the next burst opens a new one
            return tuple(peers[model].run_step.options(num_returns=2).remote(items, source_payloads=[], releases=[]))

        try:
            yield from run_burst(machine, session_id, self.spec.name, local_step, peer_submit, _fetch,
                                 eos_token_ids=eos_token_ids, budget_s=budget_s, pre_drafted=pre_drafted, opens=opens,
                                 ahead=any(model not in local_peers for model in peers),
                                 stop=lambda: self._burst_stops.stopped(burst_id))
        finally:
            self._burst_stops.ended(burst_id)
            for call in link_calls:
                if not call.done:  # closed early with a call in flight: its reply is not wanted
                    call.link.close()

    def stop_burst(self, burst_id: str) -> None:
        """End the burst ``burst_id`` after its current iteration (:mod:`actors.worker.bursts`, the stop
        signal). Call it in the :data:`~actors.worker.bursts.BURST_CONTROL_GROUP` concurrency group, so it
        runs while the burst's call is busy; a stop that comes before its burst starts stops it after
        its first iteration."""
        self._burst_stops.stop(burst_id)

    # ------------------------------------------------------------------ peer links
    def peer_link_address(self) -> PeerLinkAddress:
        """Where a burst on another worker of this node can call :meth:`run_step` directly
        (:mod:`actors.worker.peer_link`); the listener starts on the first request."""
        with self._links_lock:
            if self._link_server is None:
                self._link_server = PeerLinkServer(
                    lambda items: self.engine.run_step(items, (), ()), self._node_id())
            return self._link_server.address

    def _peer_link(self, handle: Any) -> PeerLink | None:
        """The link to the worker behind Ray actor ``handle``: opened on first use when it runs on
        this node (and again after it broke: a restarted worker listens anew); None (use Ray calls)
        elsewhere, for in-process handles, and for ``LINK_RETRY_S`` after it could not open
        (``LINK_RESTART_RETRY_S`` when the peer was restarting)."""
        import ray
        from ray.exceptions import ActorUnavailableError

        if not isinstance(handle, ray.actor.ActorHandle):
            return None
        key = handle._actor_id.hex()
        with self._links_lock:
            link = self._links.get(key)
            if key in self._links and (link is None or not link.broken):
                return link
            if time.monotonic() < self._link_retry_at.get(key, 0.0):
                return None
        link, permanent, retry_s = None, True, LINK_RETRY_S
        try:
            address = ray.get(handle.peer_link_address.remote(), timeout=LINK_RETRY_S)
            if address.node_id and address.node_id == self._node_id():
                link = PeerLink(address)
        except Exception as error:  # noqa: BLE001 - Ray calls for now; try again later
            permanent = False
            retry_s = LINK_RESTART_RETRY_S if isinstance(error, ActorUnavailableError) else LINK_RETRY_S
            logger.warning("%s: no direct link to a peer worker (%s); bursts call it through Ray for %.0f s",
                           self.spec.name, type(error).__name__, retry_s)
        with self._links_lock:
            if permanent:
                self._links[key] = link  # a link, or None for a peer on another node
            else:
                self._links.pop(key, None)
                self._link_retry_at[key] = time.monotonic() + retry_s
        return link

    # ------------------------------------------------------------------ sessions
    def prompt_logits(self, session_id: str, prompt_ids: list[int], vocab_limit: int | None = None) -> Any:
        """Raw logits ``[P - 1, V]`` of every prompt position but the last
        (:meth:`actors.worker.engine.WorkerEngine.prompt_logits`)."""
        return self.engine.prompt_logits(session_id, prompt_ids, vocab_limit)

    def release(self, session_id: str) -> bool:
        """Free a session; True if it existed."""
        return self.engine.sessions.release(session_id)

    def num_sessions(self) -> int:
        return len(self.engine.sessions)

    def engine_stats(self) -> dict[str, Any]:
        """Steps run, open sessions, the recent rows per forward (batch sizes), the calls other
        workers' bursts made over this worker's peer link (:mod:`actors.worker.peer_link`) and the
        held rows handed over Ray Direct Transport (:meth:`take_rows`)."""
        rows = list(self.engine.rows_per_forward)
        link_calls = self._link_server.calls if self._link_server is not None else 0
        return {"steps": self.engine.steps, "sessions": len(self.engine.sessions), "rows_per_forward": rows,
                "peer_link_calls": link_calls, "rows_taken": self._held_rows.taken}

    def metrics(self) -> dict[str, float]:
        """Cumulative since this worker started: seconds in forward passes and in step calls,
        steps and forward passes; and the open sessions now (:meth:`WorkerEngine.metrics`)."""
        return self.engine.metrics()

    # ------------------------------------------------------------------ idle sessions
    def reap_idle_sessions(self) -> list[str]:
        """Free sessions idle for longer than the idle timeout; returns their ids."""
        return self.engine.sessions.reap_idle()

    def _reap_forever(self) -> None:
        period = min(REAPER_PERIOD_S, self.engine.sessions.idle_timeout_s / 2)
        while True:
            time.sleep(period)
            self.reap_idle_sessions()
