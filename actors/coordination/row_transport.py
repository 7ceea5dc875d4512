"""How a step's draft rows reach the worker that verifies them (``engine.row_transport``).

``object_store``: the proposing call's payloads (tokens and logits) go through Ray's object
store, as a nested ref the verifying call reads (:mod:`actors.coordination.worker_calls`).
``gloo`` / ``nccl``: Ray Direct Transport (RDT) over a collective group of the group's workers
of their own (``placement: separate``): the proposing call holds its logits back, a
``take_rows`` call hands them to the verifying call as a top-level argument and Ray moves the
tensor sender to receiver (Gloo: host tensors; NCCL: device tensors, between GPU workers), see
:mod:`actors.worker.row_transport`; its payloads still go through the object store, tokens only.
``auto``: NCCL when every such worker has a GPU, else the object store (on this CPU the object
store moved a step's rows faster than Gloo did: ``python -m benchmarks.micro.row_transport``).

Models hosted together (:mod:`actors.worker.device_worker`) move nothing: a verifier reads its
proposer's payloads in the host's process. A group that cannot be created, a transfer that fails
or a worker that restarts (its new process is in no group) falls back to the object store for
good: logged once, counted (``fallbacks``, in the coordinator's ``engine_stats``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("auto", "gloo", "nccl", "object_store")

#: The retryable error of a request whose step's rows could not be moved.
ROWS_LOST = "the rows of this step could not be moved to model worker {model} ({error}); retry the request"


def choose_backend(mode: str, devices: list[str]) -> str | None:
    """The RDT transport for workers on ``devices`` under ``mode``: "gloo", "nccl" or None (the
    object store). ``nccl`` needs every worker on a GPU; ``gloo`` moves host rows from any worker."""
    if mode not in MODES:
        raise ValueError(f"engine.row_transport must be one of {MODES}, got {mode!r}")
    on_gpus = bool(devices) and all(device == "cuda" for device in devices)
    if mode == "gloo":
        return "gloo"
    if mode == "nccl":
        if not on_gpus:
            logger.warning("engine.row_transport nccl: workers on %s, not all on GPUs; rows go through the object store",
                           sorted(set(devices)))
        return "nccl" if on_gpus else None
    if mode == "auto":
        return "nccl" if on_gpus else None
    return None


def own_actors(workers: dict[str, Any], hosts: dict[str, str | None]) -> list[Any]:
    """The Ray actors of the models that have a worker of their own, each once."""
    import ray

    actors, seen = [], set()
    for model, handle in workers.items():
        if hosts.get(model) is None and isinstance(handle, ray.actor.ActorHandle):
            key = handle._actor_id.hex()
            if key not in seen:
                seen.add(key)
                actors.append(handle)
    return actors


@dataclass
class RowCounters:
    """What the transport did: calls whose rows went over RDT, fallbacks to the object store."""

    moved: int = 0
    fallbacks: int = 0


class RowTransport:
    """The group's choice of transport for draft rows, made once at the first step (see the module doc)."""

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"engine.row_transport must be one of {MODES}, got {mode!r}")
        self.mode = mode
        #: "gloo" or "nccl" once the collective group exists; None: the object store
        self.backend: str | None = None
        self.prepared = False
        self.counters = RowCounters()
        self._keys = itertools.count()
        self._warned = False
        #: seconds from a step's proposers' end to a verifying call having their payloads and rows, recent steps
        self.moving_s: collections.deque[float] = collections.deque(maxlen=4096)

    @property
    def active(self) -> bool:
        return self.backend is not None

    @property
    def rows_device(self) -> str:
        """Where a proposing worker holds its rows for the transport to read."""
        return "cuda" if self.backend == "nccl" else "cpu"

    def moved_in(self, seconds: float) -> None:
        """One verifying call had its step's proposals ``seconds`` after its proposers ended."""
        self.moving_s.append(seconds)

    def key(self) -> str:
        """A fresh key for one proposing call's held rows."""
        return f"rows-{next(self._keys)}"

    async def prepare(self, workers: dict[str, Any], hosts: dict[str, str | None]) -> None:
        """Create the collective group over the workers of their own, once; on any failure the
        object store it is."""
        if self.prepared:
            return
        self.prepared = True
        if self.mode == "object_store":
            return
        actors = own_actors(workers, hosts)
        if len(actors) < 2 or not all(getattr(handle, "_ray_enable_tensor_transport", False) for handle in actors):
            return
        try:
            infos = await asyncio.gather(*[handle.info.remote() for handle in actors])
            backend = choose_backend(self.mode, [info.device for info in infos])
            if backend is None:
                return
            from ray.experimental.collective import create_collective_group

            group = "torch_gloo" if backend == "gloo" else backend
            await asyncio.to_thread(create_collective_group, actors, backend=group)
        except Exception as error:  # noqa: BLE001 - no group: the object store
            self.fail(error, "could not create the collective group")
            return
        self.backend = backend
        logger.info("rows between workers: Ray Direct Transport over %s (%d workers)", backend, len(actors))

    def fail(self, error: BaseException, what: str) -> None:
        """The transport failed (``what``): the object store from now on; logged once, counted."""
        self.counters.fallbacks += 1
        self.backend = None
        if not self._warned:
            self._warned = True
            logger.warning("rows between workers: %s (%s: %s); they go through the object store from now on",
                           what, type(error).__name__, error)
