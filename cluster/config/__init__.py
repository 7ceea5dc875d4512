"""Schema of the specserve application ``args`` in Ray Serve YAML files, and the group config built from it.

``deploy/*.yaml`` are Ray Serve config files::

    applications:
      - name: specserve
        route_prefix: /
        import_path: cluster.app:build_app
        args: {models: ..., defaults: ..., resources: ..., limits: ..., server: ..., security: ...}
        deployments: [...]

:class:`SpecServeArgs` validates ``args`` (pydantic, frozen, ``extra="forbid"``, every field
described; errors name the bad key and value). :func:`load_app_args` reads one application's
``args`` from a YAML file. :func:`resolve_api_key` gives an application's API key
(``security.api_key``, else the ``SPECSERVE_API_KEY`` environment variable).

Each setting is declared once, in these args models, and the rest of the system receives
those frozen models (or models inheriting them), never copies of their fields.
:meth:`SpecServeArgs.freeze` is the one place that derives what bring-up, the coordinator and
the serving layer need from them, as a :class:`GroupConfig`:

* ``defaults``: the args' own :class:`actors.coordination.plan.DecodingDefaults` (what ``resolve_plan`` takes);
* ``models``: one :class:`ModelSpec` per worker: the model's :class:`ModelArgs` (``path``
  resolved) plus its actor's CPUs, GPUs (``None``: ``auto``, settled at bring-up), torch
  threads and custom resources, from ``resources`` (group values, then ``per_model``);
* ``tokenizer_path``: resolved, the target's path when unset;
* the limits, the engine settings and the coordinator's resources, as the args declare them.

:class:`ModelSpec` and :class:`GroupConfig` are frozen pydantic models that *inherit* the
sections they carry (:class:`ModelArgs`; :class:`LimitsArgs`, :class:`EngineArgs`,
:class:`CoordinatorResourceArgs`) instead of copying their fields, so a field's default, bounds
and description live in one place, while the actors still read one flat object
(``config.max_concurrent_requests``, ``spec.path``). They add only the derived values. Why a
derived object and not :class:`SpecServeArgs` itself: the API key (``security``) must not travel
to the actors, and the resolved paths and per-worker resources need a home that bring-up can
settle (``gpus_per_model: auto``) without re-validating the YAML. The server addresses stay in
the args (only ``specserve serve`` reads them). Everything here pickles, for Ray.

By job: each section of the args in its own module (:mod:`cluster.config.model_args`,
:mod:`cluster.config.resources`, :mod:`cluster.config.serving` for limits, security and server,
:mod:`cluster.config.engine`), the whole args and the group config
(:mod:`cluster.config.app_args`) and reading them (:mod:`cluster.config.loading`); every name is
re-exported here.
"""

from cluster.config.base import (
    ConfigError,
    Frozen,
)
from cluster.config.model_args import (
    DType,
    ModelArgs,
    ModelRole,
    Quantization,
)
from cluster.config.resources import (
    CoordinatorResourceArgs,
    CustomResources,
    MIN_RESOURCE_QUANTITY,
    ModelResourceArgs,
    PlacementArgs,
    RESERVED_RESOURCE_NAMES,
    ResourcesArgs,
    check_custom_resources,
)
from cluster.config.serving import (
    API_KEY_ENV,
    API_KEY_MAX_CHARS,
    API_KEY_MIN_CHARS,
    DEFAULT_MAX_PROMPT_CHARS,
    LimitsArgs,
    SecurityArgs,
    ServerArgs,
    check_api_key,
)
from cluster.config.engine import (
    EngineArgs,
    MemoryBudget,
    SimulatedDeviceArgs,
    parse_memory,
)
from cluster.config.app_args import (
    GroupConfig,
    ModelSpec,
    SpecServeArgs,
)
from cluster.config.loading import (
    load_app_args,
    parse_app_args,
    read_serve_config,
    resolve_api_key,
    select_application,
)

__all__ = [
    "API_KEY_ENV",
    "API_KEY_MAX_CHARS",
    "API_KEY_MIN_CHARS",
    "ConfigError",
    "CoordinatorResourceArgs",
    "CustomResources",
    "DEFAULT_MAX_PROMPT_CHARS",
    "DType",
    "EngineArgs",
    "Frozen",
    "GroupConfig",
    "LimitsArgs",
    "MIN_RESOURCE_QUANTITY",
    "MemoryBudget",
    "ModelArgs",
    "ModelResourceArgs",
    "ModelRole",
    "ModelSpec",
    "PlacementArgs",
    "Quantization",
    "RESERVED_RESOURCE_NAMES",
    "ResourcesArgs",
    "SecurityArgs",
    "ServerArgs",
    "SimulatedDeviceArgs",
    "SpecServeArgs",
    "check_api_key",
    "check_custom_resources",
    "load_app_args",
    "parse_app_args",
    "parse_memory",
    "read_serve_config",
    "resolve_api_key",
    "select_application",
]
