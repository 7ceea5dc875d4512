"""Bring up Ray and one model group (ModelWorker actors + their Coordinator).

* :func:`init_ray`: connect to the cluster named by ``RAY_ADDRESS`` when it is set, otherwise
  start a local Ray (no address needed) with the machine's CPU count.
* :func:`start_model_group`: the group's workers and one Coordinator over them. Models placed on
  one device (``resources.placement``, :mod:`cluster.config.placement`) share one worker actor (a
  :class:`~actors.worker.device_worker.DeviceWorker`), a model alone has a ModelWorker; each worker on
  its own GPU when the cluster has GPUs and ``gpus_per_model`` is ``auto`` or set; in the given
  placement group's bundles when one is passed: worker i in bundle ``first_bundle + i``, see
  :func:`model_group_bundles`. :meth:`ModelGroup.shutdown` kills them all.

Placement on nodes: a model's ``resources.per_model.<name>.resources`` and the coordinator's
``resources.coordinator_resources`` (custom Ray resources, e.g. ``{node_draft: 0.01}``) go into
the actor's ``resources=`` option, so Ray starts it (and restarts it) only on nodes started with
that resource; they are also in the model's bundle (and, for the coordinator, in a bundle of its
own after the models') so a placement group lands on those nodes too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from actors.coordination.coordinator import Coordinator
from actors.worker.bursts import BURST_CONTROL_GROUP, PROBE_GROUP
from actors.worker.device_worker import DeviceWorker, HostedModel
from actors.coordination.metrics import COORDINATOR_NAMESPACE, GroupIdentity
from actors.worker.model_worker import ModelWorker
from cluster.config import GroupConfig, SpecServeArgs, parse_app_args
from cluster.serving.cpu_affinity import CpuPlan, cores_from_env, describe_plan, plan_cpu_affinity, reserved_core_count
from cluster.config.placement import (
    check_cluster_gpus,
    describe_placement,
    resolve_placement,
    worker_gpus,
    worker_resources,
)

logger = logging.getLogger(__name__)

# Ray Serve gives a starting proxy 5 s to answer its readiness check and kills it after three
# misses, so on a busy machine (a loaded CI runner, two cores starting Ray, Serve and models at
# once) `serve.start` fails with ActorDiedError. A local Ray started here gives it longer; an
# explicit setting in the environment wins.
SERVE_PROXY_READY_TIMEOUT_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
SERVE_PROXY_READY_TIMEOUT_S = 30.0

# Ray starts its worker processes (every actor: model workers, the coordinator, Serve's replicas)
# at niceness 15 and its own daemons, the driver and any client on the host at 0, so on a machine
# whose cores the model workers fill, whatever else wakes up preempts a forward's threads. A
# local Ray started here runs its workers at 0, as vLLM's processes run; an explicit setting in
# the environment wins. Measured: the `worker-niceness` record (docs/results.md, "Served load").
WORKER_NICENESS_ENV = "RAY_worker_niceness"
WORKER_NICENESS = 0


#: Loggers whose INFO lines are start-up only (placement, and each worker's KV cache slots and forward
#: path): a Serve replica shows them (:func:`show_startup_logs`).
STARTUP_LOGGERS = ("cluster.serving.bringup",)
STARTUP_LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def show_startup_logs(stream: Any = None) -> None:
    """Let the :data:`STARTUP_LOGGERS`' INFO lines out of this process: their level set to INFO,
    and, when the root logger has no handler (a Ray Serve replica: Serve configures only its own
    ``ray.serve`` logger), a handler writing them to ``stream`` (stderr, which Ray forwards to the
    ``specserve serve`` output). The root logger and every other logger are left as they are, so
    request-time INFO lines (``cluster.serving.ingress``, ``cluster.serving.streams``) stay out of the log."""
    handled = bool(logging.getLogger().handlers)
    for name in STARTUP_LOGGERS:
        startup = logging.getLogger(name)
        startup.setLevel(logging.INFO)
        if not handled and not any(getattr(handler, "specserve_startup", False) for handler in startup.handlers):
            handler = logging.StreamHandler(stream)
            handler.setFormatter(logging.Formatter(STARTUP_LOG_FORMAT))
            handler.specserve_startup = True  # type: ignore[attr-defined]
            startup.addHandler(handler)


def set_slow_start_defaults(environ: Any = None) -> None:
    """Default Ray Serve's proxy readiness timeout to :data:`SERVE_PROXY_READY_TIMEOUT_S` in
    ``environ`` (``os.environ``) unless it is set; must run before a local Ray starts (its
    processes inherit this environment)."""
    environ = os.environ if environ is None else environ
    environ.setdefault(SERVE_PROXY_READY_TIMEOUT_ENV, f"{SERVE_PROXY_READY_TIMEOUT_S:g}")


def set_serving_defaults(environ: Any = None) -> None:
    """Default a local Ray's worker niceness to :data:`WORKER_NICENESS` in ``environ``
    (``os.environ``) unless it is set; must run before a local Ray starts (its raylet reads it)."""
    environ = os.environ if environ is None else environ
    environ.setdefault(WORKER_NICENESS_ENV, str(WORKER_NICENESS))


def init_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs: Any) -> None:
    """Start or join Ray unless it is already initialised.

    ``address`` (or the ``RAY_ADDRESS`` environment variable) joins an existing cluster;
    otherwise a local instance is started with ``num_cpus`` logical CPUs (default: this
    machine's count, at least 4 so a whole model group fits), no dashboard, a longer Serve proxy
    readiness timeout (:func:`set_slow_start_defaults`) and its workers at the niceness of the
    processes beside them (:func:`set_serving_defaults`).
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("joining the Ray cluster at %s", address)
        ray.init(address=address, **init_kwargs)
        return
    cpus = num_cpus if num_cpus is not None else max(4, os.cpu_count() or 1)
    logger.info("starting a local Ray instance with %d CPUs", cpus)
    set_slow_start_defaults()
    set_serving_defaults()
    init_kwargs.setdefault("include_dashboard", False)
    ray.init(num_cpus=cpus, **init_kwargs)


def as_group_config(args: SpecServeArgs | GroupConfig | dict[str, Any]) -> GroupConfig:
    """Accept the YAML ``args`` dict, the validated :class:`SpecServeArgs`, or a GroupConfig;
    settle ``gpus_per_model: auto`` and ``resources.placement`` against the connected Ray cluster
    (:func:`resolve_placement`)."""
    config = args if isinstance(args, GroupConfig) else parse_app_args(args).freeze()
    return resolve_placement(config)


def group_cpu_plan(config: GroupConfig) -> CpuPlan:
    """Each settled worker's cores under ``resources.cpu_affinity`` (:mod:`cluster.serving.cpu_affinity`), on the
    host's cores as ``specserve serve`` recorded them (none recorded: ``auto`` binds nothing)."""
    workers = [list(w) for w in config.workers]
    return plan_cpu_affinity(config.cpu_affinity, workers, config.roles, [worker_gpus(config, w) for w in workers],
                             max(reserved_core_count(model.torch_threads) for model in config.models),
                             cores_from_env())


def model_group_bundles(args: SpecServeArgs | GroupConfig | dict[str, Any]) -> list[dict[str, float]]:
    """One placement-group bundle per worker (:func:`resolve_placement`), in the order
    :func:`start_model_group` places them (its CPUs, GPUs and custom resources), then, only when the
    coordinator has custom resources (``coordinator_resources``), one bundle for the coordinator
    holding them and ``coordinator_cpus``. Without custom resources the coordinator needs no bundle
    of its own (it goes in any bundle with room)."""
    config = as_group_config(args)
    bundles = []
    for models in config.workers:
        cpus, gpus, custom = worker_resources(config, models)
        bundle = {"CPU": cpus}
        if gpus:
            bundle["GPU"] = gpus
        bundle.update(custom)
        bundles.append(bundle)
    if config.coordinator_resources:
        bundle = {"CPU": float(config.coordinator_cpus)} if config.coordinator_cpus else {}
        bundle.update(config.coordinator_resources)
        bundles.append(bundle)
    return bundles


def coordinator_bundle_index(config: GroupConfig, first_bundle: int = 0) -> int:
    """Bundle of the coordinator in a placement group built from :func:`model_group_bundles`
    (whose first bundle is ``first_bundle``): its own bundle after the models' when it has
    custom resources, else -1 (any bundle with room)."""
    return first_bundle + len(config.workers or config.models) if config.coordinator_resources else -1


@dataclass
class ModelGroup:
    """The actors serving one group: ``workers`` (model name -> handle) and ``coordinator``."""

    config: GroupConfig
    workers: dict[str, Any]
    coordinator: Any
    #: Every worker actor (a worker hosting several models is one actor; ``workers`` maps each
    #: model to its handle, a :class:`~actors.worker.device_worker.HostedModel` for a hosted one).
    actors: list[Any] = field(default_factory=list)

    def shutdown(self) -> None:
        """Kill the coordinator and every worker (their sessions and KV caches go with them)."""
        import ray

        for handle in [self.coordinator, *(self.actors or self.workers.values())]:
            try:
                ray.kill(handle, no_restart=True)
            except (ValueError, ray.exceptions.RayError) as error:
                logger.warning("could not kill an actor: %s", error)


def _scheduling(placement_group: Any, bundle_index: int) -> dict[str, Any]:
    if placement_group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        )
    }


def worker_sessions(config: GroupConfig) -> int:
    """KV cache slots per worker when no KV budget sizes them (CPU, ``engine.kv_cache_memory``
    unset): every running request, plus as many again whose sessions are released at the next
    step, plus a margin (:mod:`actors.model.kv_budget` sizes them otherwise)."""
    return 2 * config.max_concurrent_requests + 4


def _worker_actor(cls: type, direct_transport: bool = False) -> Any:
    """``cls`` as a Ray actor class whose ``stop_burst`` runs in a concurrency group of its own,
    beside a busy burst call (:mod:`actors.worker.bursts`, the stop signal), and whose read-only
    probes run in another (:data:`~actors.worker.bursts.PROBE_GROUP`); ``direct_transport``:
    its calls may return tensors over Ray Direct Transport (``engine.row_transport``)."""
    import ray

    return ray.remote(concurrency_groups={BURST_CONTROL_GROUP: 1, PROBE_GROUP: 1}, enable_tensor_transport=direct_transport)(cls)


def start_model_group(
    args: SpecServeArgs | GroupConfig | dict[str, Any],
    placement_group: Any = None,
    *,
    first_bundle: int = 0,
    worker_cls: type = ModelWorker,
    wait: bool = True,
    identity: GroupIdentity | None = None,
) -> ModelGroup:
    """Start the group's workers (:func:`resolve_placement`: a ModelWorker for a model alone, a
    :class:`~actors.worker.device_worker.DeviceWorker` for models that share a device) and a Coordinator
    over them (each model addressed by name).

    ``placement_group``: reserve the workers in its bundles (worker i in bundle
    ``first_bundle + i``; build the bundles with :func:`model_group_bundles`); the coordinator
    goes in any bundle, or in its own (:func:`coordinator_bundle_index`) when it has custom
    resources. Custom resources (``ModelSpec.resources``, ``GroupConfig.coordinator_resources``)
    become the actors' ``resources=`` option. ``wait``: block until every model is loaded (load
    errors surface here).
    ``worker_cls`` lets tests substitute a worker with the same interface.
    ``identity``: the group's metric labels (served model name, owning replica); when given, the
    coordinator is a named actor (``identity.actor_name`` in namespace
    :data:`actors.coordination.metrics.COORDINATOR_NAMESPACE`) so ``GET /metrics`` finds every group of an
    application.
    """
    import ray

    config = as_group_config(args)
    check_cluster_gpus(config)
    workers: dict[str, Any] = {}
    actors: list[Any] = []
    logger.info("placement: %s", describe_placement(config))
    cpu_plan = group_cpu_plan(config)
    logger.info("cpu affinity: %s", describe_plan(cpu_plan, config.workers))
    for index, models in enumerate(config.workers):
        cpus, gpus, custom = worker_resources(config, models)
        # A dead worker is restarted in place (same handle, empty sessions): the requests it held
        # fail as retryable, the next ones are served by the new process.
        options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": -1, "max_task_retries": 0}
        if custom:
            options["resources"] = custom
        options.update(_scheduling(placement_group, first_bundle + index))
        worker_args = dict(max_sessions=worker_sessions(config), prefix_caching=config.prefix_caching,
                           kv_cache_memory=config.kv_cache_memory, max_model_len=config.max_model_len,
                           max_tokens_per_step=config.max_tokens_per_step)
        if cpu_plan.workers[index] is not None:
            worker_args["cpu_cores"] = cpu_plan.workers[index]
        if len(models) == 1:
            direct = config.row_transport in ("gloo", "nccl") or (config.row_transport == "auto" and bool(gpus))
            handle = _worker_actor(worker_cls, direct).options(**options).remote(
                config.model(models[0]), config.session_idle_timeout_s, **worker_args)
            workers[models[0]] = handle
        else:
            handle = _worker_actor(DeviceWorker).options(**options).remote(
                [config.model(name) for name in models], config.session_idle_timeout_s, worker_cls=worker_cls,
                **worker_args)
            for name in models:
                workers[name] = HostedModel(handle, name, host_id=f"worker{index}")
        actors.append(handle)
    workers = {model.name: workers[model.name] for model in config.models}  # the args' order
    coordinator_options: dict[str, Any] = {"num_cpus": config.coordinator_cpus, "max_restarts": -1}
    if config.coordinator_resources:
        coordinator_options["resources"] = dict(config.coordinator_resources)
    coordinator_options.update(_scheduling(placement_group, coordinator_bundle_index(config, first_bundle)))
    if identity is not None:
        coordinator_options.update(name=identity.actor_name, namespace=COORDINATOR_NAMESPACE)
    coordinator = ray.remote(Coordinator).options(**coordinator_options).remote(workers, config, identity=identity)
    group = ModelGroup(config=config, workers=workers, coordinator=coordinator, actors=actors)
    if wait:
        try:
            infos = ray.get([handle.info.remote() for handle in workers.values()])
            ray.get(coordinator.health.remote())
            ray.get(coordinator.infos.remote())  # the group's vocabulary check (actors.vocabulary)
        except Exception:
            group.shutdown()
            raise
        for info in infos:
            logger.info("worker %s (%s): vocab %d, context %d, %s KV cache slots, %s %s, forward: %s, pid %d on cores %s",
                        info.name, info.role, info.vocab_size, info.max_context, info.kv_slots, info.device,
                        list(info.gpu_ids), info.forward_path or "not reported", info.pid, list(info.cpu_cores))
    return group
