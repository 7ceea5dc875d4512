"""Which models share a worker process (a device), and what each worker asks of the cluster:
decided here, once, at bring-up.

:func:`resolve_placement` is the one place the decision is made: it settles
``GroupConfig.workers`` (the model names of each worker) and ``placement_rule``. Everything
after only follows it: bring-up (:mod:`cluster.serving.bringup`) starts one actor per settled
worker (a ModelWorker for a model alone, a :class:`~actors.worker.device_worker.DeviceWorker`
for several) with the resources of :func:`worker_resources`, and the coordinator learns which
models share a process from their handles (:func:`actors.worker.device_worker.host_of`).

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

from collections.abc import Sequence
from typing import Any

from cluster.config.app_args import GroupConfig
from cluster.config.base import ConfigError

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


def cluster_gpus() -> int:
    """The GPUs of the Ray cluster (0 when Ray is not initialised)."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0


def resolve_auto_gpus(config: GroupConfig, gpus: int | None = None) -> GroupConfig:
    """Models with ``num_gpus=None`` ('auto') get one GPU each if the cluster (``gpus``, default the
    connected one's) has GPUs, else 0."""
    if all(model.num_gpus is not None for model in config.models):
        return config
    per_model = 1.0 if (cluster_gpus() if gpus is None else gpus) > 0 else 0.0
    models = tuple(
        model if model.num_gpus is not None else model.model_copy(update={"num_gpus": per_model})
        for model in config.models
    )
    return config.model_copy(update={"models": models})


def resolve_placement(config: GroupConfig, gpus: int | None = None) -> GroupConfig:
    """``config`` with its GPUs settled (:func:`resolve_auto_gpus`) and its workers settled from
    ``resources.placement`` (:mod:`cluster.config.placement`) on a cluster of ``gpus`` GPUs (default: the
    connected one's; none when Ray is not up). ``placement: auto`` follows :data:`cluster.config.placement.AUTO_RULE`
    when every model's GPUs are ``auto`` and no model asks for custom resources (nodes), else gives
    each model a worker."""
    if config.workers is not None:
        return config
    gpus = cluster_gpus() if gpus is None else gpus
    gpus_auto = all(model.num_gpus is None for model in config.models)
    config = resolve_auto_gpus(config, gpus)
    models = [(model.name, model.role) for model in config.models]
    if config.placement == "auto" and (not gpus_auto or any(model.resources for model in config.models)):
        workers, rule = [[name] for name, _ in models], "placement auto: a worker per model (GPUs or nodes set by hand)"
    else:
        workers, rule = configured_workers(config.placement, models, gpus)
    workers = heads_with_their_target(config, workers)
    return config.model_copy(update={"workers": tuple(tuple(w) for w in workers), "placement_rule": rule})


def heads_with_their_target(config: GroupConfig, workers: list[list[str]]) -> list[list[str]]:
    """``workers`` with each EAGLE-3 head (a draft whose checkpoint is one, :mod:`actors.model.eagle3_serving`)
    in its target's worker, where it reads the target's states: moved there by ``placement: auto``;
    a placement set by hand that parts them is refused naming ``resources.placement``."""
    from actors.model.eagle3_serving import is_eagle3_checkpoint

    target = next((model.name for model in config.models if model.role == "target"), None)
    heads = [model.name for model in config.models if model.role == "draft" and is_eagle3_checkpoint(model.path)]
    for head in heads:
        host = next(worker for worker in workers if head in worker)
        if target is None or target in host:
            continue
        if config.placement != "auto":
            raise ConfigError(f"resources.placement: models.{head} is an EAGLE-3 head, which runs in its target's worker; "
                              f"place it with models.{target} (the same device id, or auto)")
        host.remove(head)
        next(worker for worker in workers if target in worker).append(head)
    return [worker for worker in workers if worker]


def check_cluster_gpus(config: GroupConfig, gpus: int | None = None) -> None:
    """Raise :class:`ConfigError` when the settled workers of ``config`` ask for more GPUs than the
    cluster (``gpus``, default the connected one's) has: their placement group would wait forever."""
    gpus = cluster_gpus() if gpus is None else gpus
    workers = [list(w) for w in config.workers]
    needed = sum(worker_gpus(config, w) for w in workers)
    if needed > gpus:
        raise ConfigError(
            f"resources: the model group needs {needed:g} GPUs ({describe_workers(workers, [worker_gpus(config, w) for w in workers])}) "
            f"but the Ray cluster has {gpus}; set resources.gpus_per_model: auto (models then share workers when GPUs "
            f"are short), or place models on fewer devices with resources.placement, or add GPUs"
        )


def worker_gpus(config: GroupConfig, models: Sequence[str]) -> float:
    """GPUs of the worker hosting ``models``: the most any of them asks (they share its device)."""
    return max(float(config.model(name).num_gpus or 0.0) for name in models)


def worker_resources(config: GroupConfig, models: Sequence[str]) -> tuple[float, float, dict[str, float]]:
    """(CPUs, GPUs, custom resources) of the worker hosting ``models``: their CPUs' sum, the most
    GPUs any asks, and the union of their custom resources (the largest quantity of each)."""
    specs = [config.model(name) for name in models]
    custom: dict[str, float] = {}
    for spec in specs:
        for key, quantity in spec.resources.items():
            custom[key] = max(custom.get(key, 0.0), quantity)
    return sum(float(spec.num_cpus) for spec in specs), worker_gpus(config, models), custom


def describe_placement(config: GroupConfig) -> str:
    """The settled workers and the rule that chose them, as printed at start-up."""
    workers = [list(w) for w in config.workers or [(m.name,) for m in config.models]]
    return f"{describe_workers(workers, [worker_gpus(config, w) for w in workers])} ({config.placement_rule})"
