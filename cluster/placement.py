"""Which models share a worker process (a device), settled once at bring-up.

``resources.placement`` in the YAML:

* a mapping ``model -> device id`` (an int): the models given one id are hosted by ONE worker
  actor (:class:`actors.worker.device_worker.DeviceWorker`: one process, one CUDA context on a GPU),
  each model keeping its own backend, KV cache slots and sessions; models with ids of their
  own get a worker each;
* ``separate``: a worker per model (each on its own GPU when the cluster has GPUs);
* ``auto`` (the default): with GPUs set by hand (``gpus_per_model`` or a ``per_model`` ``gpus``) or
  models pinned to nodes (``per_model`` custom ``resources``), a worker per model; otherwise by the
  GPUs of the Ray cluster (:data:`AUTO_RULE`): a worker per model when there are at least as many
  GPUs as models; otherwise the draft shares its target's worker,
  every other model (the ensemble members) has a worker of its own so that they run in parallel,
  and with fewer GPUs than those workers, workers are dealt round-robin onto the GPUs and the
  models dealt onto one GPU share its worker.

A worker's GPUs are its models' most (``gpus_per_model``; ``auto``: one when the cluster has
GPUs), its CPUs their sum, its custom resources their union. A group that asks for more GPUs
than the cluster has is refused with a :class:`cluster.config.ConfigError` that says so, instead
of waiting for a placement that never comes.
"""

from __future__ import annotations

from typing import Any

AUTO_RULE = ("placement auto: a worker per model when the cluster has a GPU for each; otherwise the draft "
             "shares its target's worker, each other model has its own, and with fewer GPUs than workers the "
             "workers are dealt round-robin onto the GPUs (models on one GPU share one worker)")


def auto_workers(models: list[tuple[str, str]], cluster_gpus: int) -> list[list[str]]:
    """The ``auto`` rule (:data:`AUTO_RULE`) for ``models`` ((name, role) in the args' order) on a
    cluster with ``cluster_gpus`` GPUs: the model names of each worker."""
    names = [name for name, _ in models]
    if cluster_gpus >= len(names) > 0:
        return [[name] for name in names]
    roles = dict(models)
    target = next((n for n in names if roles[n] == "target"), None)
    draft = next((n for n in names if roles[n] == "draft"), None)
    workers: list[list[str]] = []
    for name in names:
        if name == draft and target is not None:
            continue
        workers.append([name, draft] if name == target and draft is not None else [name])
    if 0 < cluster_gpus < len(workers):
        dealt: list[list[str]] = [[] for _ in range(cluster_gpus)]
        for index, worker in enumerate(workers):
            dealt[index % cluster_gpus].extend(worker)
        workers = dealt
    return workers


def configured_workers(placement: Any, models: list[tuple[str, str]], cluster_gpus: int) -> tuple[list[list[str]], str]:
    """The workers (model names of each) ``resources.placement`` settles to, and the rule that
    chose them (printed at start-up)."""
    names = [name for name, _ in models]
    if placement == "separate":
        return [[name] for name in names], "placement separate: a worker per model"
    if placement == "auto":
        return auto_workers(models, cluster_gpus), f"{AUTO_RULE}; the cluster has {cluster_gpus} GPUs"
    by_device: dict[int, list[str]] = {}
    for name in names:
        by_device.setdefault(int(placement[name]), []).append(name)
    return [by_device[device] for device in sorted(by_device)], "placement: models on one device id share a worker"


def describe_workers(workers: list[list[str]], gpus: list[float]) -> str:
    """``worker 0 [target, draft] 1 GPU; worker 1 [partner] CPU; ...``"""
    return "; ".join(f"worker {i} [{', '.join(models)}] " + (f"{g:g} GPU" if g else "CPU")
                     for i, (models, g) in enumerate(zip(workers, gpus)))
