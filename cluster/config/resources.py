"""``resources``: CPUs, GPUs, custom Ray resources and placement of the workers and the
coordinator."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, NonNegativeInt, field_validator

from cluster.config.base import Frozen


#: Ray resource names a ``resources`` mapping may not use: CPUs and GPUs have their own fields,
#: memory is not a placement label.
RESERVED_RESOURCE_NAMES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
#: Smallest non-zero resource quantity Ray accepts.
MIN_RESOURCE_QUANTITY = 0.0001


def check_core_lists(cores: dict[str, list[int]]) -> dict[str, list[int]]:
    """``cores`` if every model's list names at least one core, each once, else ValueError naming the model."""
    for name, ids in cores.items():
        if not ids:
            raise ValueError(f"model {name!r}: a core list names at least one core")
        if len(set(ids)) != len(ids):
            raise ValueError(f"model {name!r}: core {sorted(i for i in ids if ids.count(i) > 1)[0]} is listed twice")
    return cores


#: ``cpu_affinity`` as a mapping: model name -> the CPU cores of the worker hosting it.
CoreLists = Annotated[dict[str, list[NonNegativeInt]], AfterValidator(check_core_lists)]


def check_custom_resources(resources: dict[str, float]) -> dict[str, float]:
    """``resources`` if every name is a usable custom Ray resource and every quantity is a
    finite number >= 0.0001, else ValueError naming the bad resource."""
    for name, quantity in resources.items():
        if not name or any(ch.isspace() for ch in name):
            raise ValueError(f"resource {name!r}: a resource name must be non-empty, without spaces")
        if name in RESERVED_RESOURCE_NAMES:
            hint = " (use cpus / gpus)" if name in ("CPU", "GPU") else ""
            raise ValueError(f"resource {name!r} is not a custom resource{hint}")
        if not math.isfinite(quantity) or quantity < MIN_RESOURCE_QUANTITY:
            raise ValueError(
                f"resource {name!r}: the quantity must be a finite number >= {MIN_RESOURCE_QUANTITY}, got {quantity!r}"
            )
    return resources


#: A custom-resources mapping, checked by :func:`check_custom_resources`.
CustomResources = Annotated[dict[str, float], AfterValidator(check_custom_resources)]


class ModelResourceArgs(Frozen):
    """Resource override for one model."""

    gpus: float | None = Field(None, ge=0.0, description="GPUs for this model's worker.")
    cpus: float | None = Field(None, ge=0.0, description="CPUs for this model's worker.")
    resources: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources of this model's worker, e.g. {node_draft: 0.01}: it runs only on nodes "
        "started with them (ray start --resources='{\"node_draft\": 1}'). Not CPU, GPU, memory or "
        "object_store_memory; quantities >= 0.0001. Empty: any node.",
    )


class CoordinatorResourceArgs(Frozen):
    """What the coordinator actor of a model group asks Ray for (part of ``resources``)."""

    coordinator_cpus: float = Field(0.0, ge=0.0, description="CPUs reserved for the coordinator actor.")
    coordinator_resources: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources of the coordinator, e.g. {node_coordinator: 0.01} (rules as "
        "per_model.<name>.resources). Empty: any node.",
    )


class PlacementArgs(Frozen):
    """Which models share a worker process (part of ``resources``; :mod:`cluster.config.placement`)."""

    placement: Literal["auto", "separate"] | dict[str, Annotated[int, Field(ge=0)]] = Field(
        "auto",
        description="A mapping model -> device id (every model; models given one id share ONE worker process), 'separate' (a "
        "worker per model) or 'auto': a worker per model when GPUs or nodes are set by hand or the cluster has a "
        "GPU for each, else the draft shares its target's worker. Printed at start-up.",
    )
    cpu_affinity: Literal["auto", "spare", "off"] | CoreLists = Field(
        "off",
        description="CPU cores the workers run on. off: none bound. spare (no GPUs, Ray started by `specserve serve`): "
        "other processes keep off the last torch_threads cores. auto: spare, and the target's worker bound to them. A "
        "map model -> core ids ({target: [1]}): that worker there, other processes on the rest.",
    )

    @field_validator("cpu_affinity", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML reads an unquoted ``off`` as false: that is ``off``."""
        return "off" if value is False else value


#: ``resources.torch_threads``: a thread count, or ``"auto"`` (the worker's cores once bound,
#: :func:`actors.worker.cpu_binding.torch_thread_count`).
TorchThreads = Annotated[int, Field(ge=1)] | Literal["auto"]


class ResourcesArgs(CoordinatorResourceArgs, PlacementArgs):
    """What each actor of a model group asks Ray for."""

    gpus_per_model: float | Literal["auto"] = Field(
        "auto",
        description="GPUs per worker; 'auto': one when the Ray cluster has GPUs, else none. A group asking for more "
        "GPUs than the cluster has is refused at start-up.",
    )
    cpus_per_model: float = Field(
        0.25, ge=0.0, description="CPUs per model worker (0.25: a group fits 2 cores)."
    )
    torch_threads: TorchThreads = Field(
        1,
        description="torch intra-op threads per CPU model worker: a number, or 'auto': the cores of the worker's affinity "
        "mask once bound (cpu_affinity); forwards below one_thread_below run on one.",
    )
    one_thread_below: int = Field(
        100_000_000,
        ge=0,
        description="CPU forwards of less work (tokens x parameters) run on one torch thread, leaving the other cores to "
        "Ray and HTTP; logits unchanged (tested bit for bit). 0: all on torch_threads.",
    )
    per_model: dict[str, ModelResourceArgs] = Field(
        default_factory=dict, description="Per-model overrides keyed by model name (gpus, cpus, custom resources)."
    )
