"""Which CPU cores the processes of a model group run on (``resources.cpu_affinity``).

On a CPU host the target's worker computes most of the time, and everything else of the server
(Ray's own processes, the Serve HTTP proxy and replica, the coordinator, the other workers)
together keeps about half a core busy while it does. Left to the scheduler, those processes run
on the worker's core as often as on the other ones, and the forward slows by sharing its core
and caches with them. With ``cpu_affinity: auto`` (not the default: for a host the server has to
itself; bound processes cannot move off cores that other programs load) the target's worker gets a core of its own
(``torch_threads`` cores, the last ones), every other process runs on the rest, and the other
workers (ensemble members, which compute in parallel with the target in an ensemble step) may
run on any core: packed onto the rest with the serving processes, they slowed ensemble steps
more than the target's core of its own gave back.

With ``cpu_affinity: spare`` the other processes are kept off the same cores as with ``auto``, but
no worker is bound: the target's worker finds its cores spared by the rest of the server, and the
scheduler can still move it to another core where other programs load its own.

* ``specserve serve``, when it starts Ray itself, binds its own process to the rest of the cores
  (:func:`serving_cores`) before Ray starts, so every process Ray and Serve start afterwards
  inherits that binding, and records the host's cores in :data:`CPU_CORES_ENV` (inherited too);
* at bring-up, :func:`plan_cpu_affinity` gives each worker its cores and each worker binds its own
  process at start (:func:`actors.worker.cpu_binding.bind_process`).

Where Ray was not started by ``specserve serve`` (``serve run``, a Ray cluster joined), the other
processes cannot be kept off a worker's core, and binding the worker alone leaves it waiting
for its one core while the rest may still use it: ``auto`` binds nothing then. On a host with
GPUs ``auto`` binds nothing either. A mapping names each model's cores explicitly and is applied
wherever it is given (GPU workers included).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Set by ``specserve serve`` when it has bound the serving processes: the host's cores before that
#: binding ("0,1"), inherited by every process Ray starts.
CPU_CORES_ENV = "SPECSERVE_CPU_CORES"

#: The settings that keep the serving processes off the target's worker's cores (the ``auto`` rule's).
SPARING = ("auto", "spare")


@dataclass(frozen=True)
class CpuPlan:
    """Cores of a model group's processes: ``workers[i]`` for worker i of ``GroupConfig.workers``
    (None: not bound), ``serving`` for every other process (None: not bound), and the rule in words
    (logged at start-up)."""

    workers: tuple[tuple[int, ...] | None, ...]
    serving: tuple[int, ...] | None
    rule: str


def cores_from_env(environ: Mapping[str, str] = os.environ) -> tuple[int, ...] | None:
    """The host's cores as ``specserve serve`` recorded them (:data:`CPU_CORES_ENV`); None when it did
    not (the serving processes are not bound) or the value does not parse."""
    value = environ.get(CPU_CORES_ENV, "").strip()
    if not value:
        return None
    try:
        return tuple(sorted({int(part) for part in value.split(",")}))
    except ValueError:
        return None


def reserved_core_count(torch_threads: int | str) -> int:
    """Cores the ``auto`` rule reserves for the target's worker under ``torch_threads``: that many, and
    one for ``"auto"`` (whose thread count then follows the worker's mask)."""
    return 1 if torch_threads == "auto" else max(1, int(torch_threads))


def target_worker_cores(cores: Sequence[int], torch_threads: int | str) -> tuple[int, ...] | None:
    """The ``auto`` rule's cores of the worker hosting the target: the last ``torch_threads`` of
    ``cores`` (one for ``"auto"``) when the host has more cores than that, else None (no core to spare)."""
    torch_threads = reserved_core_count(torch_threads)
    ordered = sorted(set(cores))
    if len(ordered) <= torch_threads:
        return None
    return tuple(ordered[-torch_threads:])


def serving_cores(setting: Any, torch_threads: int | str, cores: Sequence[int], gpu_host: bool) -> tuple[int, ...] | None:
    """Cores of the processes other than the workers under ``setting`` (``auto``, ``spare``, ``off`` or a
    mapping model -> cores) on a host with ``cores``: ``auto`` and ``spare``: the cores the ``auto``
    rule's target's worker does not take (None on a GPU host or when no core is spare); a mapping:
    the cores no model lists (None when they list every core); ``off``: None."""
    if setting == "off" or (setting in SPARING and gpu_host):
        return None
    if setting in SPARING:
        reserved = target_worker_cores(cores, torch_threads)
        if reserved is None:
            return None
    else:
        reserved = tuple({core for ids in setting.values() for core in ids})
    rest = tuple(core for core in sorted(set(cores)) if core not in reserved)
    return rest or None


def _target_worker(workers: Sequence[Sequence[str]], roles: Mapping[str, str]) -> int:
    """Index of the worker hosting the target (the first worker when no model is the target)."""
    return next((i for i, models in enumerate(workers) if any(roles.get(m) == "target" for m in models)), 0)


def plan_cpu_affinity(setting: Any, workers: Sequence[Sequence[str]], roles: Mapping[str, str],
                      worker_gpus: Sequence[float], torch_threads: int | str, cores: Sequence[int] | None) -> CpuPlan:
    """Each worker's cores under ``setting`` (``auto``, ``off``, or a mapping model -> cores), for the
    settled ``workers`` (model names of each), the models' ``roles``, each worker's GPUs, and
    ``cores``: the host's cores recorded by ``specserve serve`` (:func:`cores_from_env`; None: the
    serving processes were not bound)."""
    unbound = tuple(None for _ in workers)
    if setting == "off":
        return CpuPlan(unbound, None, "cpu_affinity off: nothing bound")
    if isinstance(setting, Mapping):
        lists = [sorted({core for model in models for core in setting.get(model, ())}) for models in workers]
        plan = tuple(tuple(ids) if ids else None for ids in lists)
        serving = None if cores is None else serving_cores(setting, torch_threads, cores, gpu_host=False)
        return CpuPlan(plan, serving, "cpu_affinity: the cores listed per model")
    if cores is None:
        return CpuPlan(unbound, None, f"cpu_affinity {setting}: nothing bound (Ray was not started by `specserve serve` "
                       "here, so the other processes cannot be kept off a worker's core)")
    if any(gpus > 0 for gpus in worker_gpus):
        return CpuPlan(unbound, None, f"cpu_affinity {setting}: nothing bound (GPU workers)")
    own = target_worker_cores(cores, torch_threads)
    if own is None:
        return CpuPlan(unbound, None, f"cpu_affinity {setting}: nothing bound ({len(set(cores))} cores, none to spare "
                       f"beyond torch_threads {torch_threads})")
    every = tuple(sorted(set(cores)))
    rest = tuple(core for core in every if core not in own)
    if setting == "spare":  # every worker on any core (binding to all of them undoes the inherited binding)
        return CpuPlan(tuple(every for _ in workers), rest, f"cpu_affinity spare: every other process on cores "
                       f"{list(rest)}, the workers on any core (cores {list(own)} spared for the target's worker)")
    target = _target_worker(workers, roles)
    plan = tuple(own if i == target else every for i in range(len(workers)))
    return CpuPlan(plan, rest, f"cpu_affinity auto: the target's worker on cores {list(own)} of its own, the other "
                   f"workers on any core, every other process on cores {list(rest)}")


def describe_plan(plan: CpuPlan, workers: Sequence[Sequence[str]]) -> str:
    """``worker 0 [target, draft] cores [1]; worker 1 [partner] cores [0]; serving processes cores [0] (rule)``"""
    parts = [f"worker {i} [{', '.join(models)}] " + (f"cores {list(cores)}" if cores else "not bound")
             for i, (models, cores) in enumerate(zip(workers, plan.workers))]
    parts.append("serving processes " + (f"cores {list(plan.serving)}" if plan.serving else "not bound"))
    return f"{'; '.join(parts)} ({plan.rule})"
