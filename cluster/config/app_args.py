"""The application ``args`` as a whole (:class:`SpecServeArgs`, its sections checked against
each other) and the :class:`GroupConfig` the actors receive (:meth:`SpecServeArgs.freeze`)."""

from __future__ import annotations


from pydantic import Field, field_validator, model_validator

from actors.request_schema import InvalidRequestError, SpeculationParams
from actors.coordination.plan import ALTERNATE, ENSEMBLE_STRATEGIES, DecodingDefaults, resolve_plan
from cluster.config.base import Frozen
from cluster.config.engine import EngineArgs, SimulatedDeviceArgs
from cluster.config.model_args import ModelArgs
from cluster.config.resources import CoordinatorResourceArgs, ModelResourceArgs, PlacementArgs, ResourcesArgs, TorchThreads
from cluster.config.serving import LimitsArgs, SecurityArgs, ServerArgs


class SpecServeArgs(Frozen):
    """The ``args`` of a specserve application in a Ray Serve YAML file."""

    models: dict[str, ModelArgs] = Field(..., min_length=1, description="Model name -> model; one per worker actor.")
    tokenizer: str | None = Field(
        None, description="Tokenizer path/hub id/embedded:<name>; default: the target's (else the first model's)."
    )
    defaults: DecodingDefaults = Field(default_factory=DecodingDefaults, description="A request's decoding, where it says nothing.")
    resources: ResourcesArgs = Field(default_factory=ResourcesArgs, description="Per-actor resources.")
    limits: LimitsArgs = Field(default_factory=LimitsArgs, description="Admission and session limits.")
    server: ServerArgs = Field(default_factory=ServerArgs, description="HTTP/gRPC bind address and ports.")
    security: SecurityArgs = Field(default_factory=SecurityArgs, description="Client authentication (API key).")
    engine: EngineArgs = Field(default_factory=EngineArgs, description="Step scheduler settings.")

    @field_validator("models")
    @classmethod
    def _one_target_at_most_one_draft(cls, models: dict[str, ModelArgs]) -> dict[str, ModelArgs]:
        for name in models:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"model name {name!r} must be non-empty letters, digits, '-' or '_'")
        targets = [name for name, model in models.items() if model.role == "target"]
        drafts = [name for name, model in models.items() if model.role == "draft"]
        if len(targets) > 1:
            raise ValueError(f"at most one model may have role 'target', got {targets}")
        if len(drafts) > 1:
            raise ValueError(f"at most one model may have role 'draft', got {drafts}")
        return models

    @field_validator("resources")
    @classmethod
    def _gpus_not_negative(cls, resources: ResourcesArgs) -> ResourcesArgs:
        if resources.gpus_per_model != "auto" and resources.gpus_per_model < 0:
            raise ValueError(f"resources.gpus_per_model must be >= 0 or 'auto', got {resources.gpus_per_model}")
        return resources

    @model_validator(mode="after")
    def _defaults_fit_models(self) -> SpecServeArgs:
        unknown = [name for name in self.resources.per_model if name not in self.models]
        if unknown:
            raise ValueError(f"resources.per_model: unknown models {unknown}; models are {list(self.models)}")
        placement = self.resources.placement
        if isinstance(placement, dict) and set(placement) != set(self.models):
            unknown = sorted(set(placement) - set(self.models))
            unplaced = sorted(set(self.models) - set(placement))
            raise ValueError(f"resources.placement: every model needs a device id; unknown models {unknown}, "
                             f"models without one {unplaced}")
        if isinstance(self.resources.cpu_affinity, dict):
            unknown = sorted(set(self.resources.cpu_affinity) - set(self.models))
            if unknown:
                raise ValueError(f"resources.cpu_affinity: unknown models {unknown}; models are {list(self.models)}")
        unknown = [name for name in self.engine.simulated_device if name not in self.models]
        if unknown:
            raise ValueError(f"engine.simulated_device: unknown models {unknown}; models are {list(self.models)}")
        roles = {name: model.role for name, model in self.models.items()}
        d = self.defaults
        # The defaults are checked as if a request spelled them all out: for the default
        # strategy, and (when ensemble settings are given) for the ensemble strategies too.
        as_request = {"gamma": d.gamma, "gamma_max": d.gamma_max, "num_drafts": d.num_drafts, "ensemble": d.ensemble, "members": d.members,
                      "weights": d.weights, "mu": d.mu, "gammas": d.gammas}
        checks = [SpeculationParams(strategy=d.strategy, method=d.method, proposer=d.proposer, **as_request)]
        if d.strategy not in ENSEMBLE_STRATEGIES and any(v is not None for v in (d.members, d.weights, d.gammas)):
            checks.append(SpeculationParams(strategy="se", **as_request))  # se's proposer: defaults.proposers.se
        if d.proposers.se != ALTERNATE and d.proposers.se not in self.models:
            raise ValueError(f"defaults.proposers.se: unknown proposer {d.proposers.se!r}; expected {ALTERNATE!r} or a "
                             f"model of the deployment: {', '.join(self.models)}")
        for speculation in checks:
            try:
                resolve_plan(speculation, d, roles)
            except InvalidRequestError as error:
                field = error.field.replace("speculation.", "defaults.")
                if field == "defaults.proposer" and speculation.proposer is None:
                    field = f"defaults.proposers.{speculation.strategy}"
                raise ValueError(f"{field}: {error.message}") from None
        return self

    def freeze(self) -> GroupConfig:
        """The :class:`GroupConfig` of this group: the values derived from the args, computed here
        once (model paths resolved, each worker's resources, the tokenizer); no API key."""
        from models import resolve_model_path

        resources = self.resources
        models = []
        for name, model in self.models.items():
            override = resources.per_model.get(name) or ModelResourceArgs()
            group_gpus = None if resources.gpus_per_model == "auto" else float(resources.gpus_per_model)
            models.append(ModelSpec(
                **(model.model_dump() | {"path": resolve_model_path(model.path)}),
                name=name,
                num_gpus=group_gpus if override.gpus is None else override.gpus,
                num_cpus=resources.cpus_per_model if override.cpus is None else override.cpus,
                torch_threads=resources.torch_threads,
                one_thread_below=resources.one_thread_below,
                resources=override.resources,
                simulated_device=self.engine.simulated_device.get(name),
                lean_forward=self.engine.lean_forward,
                cuda_graphs=self.engine.cuda_graphs,
                keep_freed_memory=self.engine.keep_freed_memory,
            ))
        if self.tokenizer is not None:
            tokenizer_path = resolve_model_path(self.tokenizer)
        else:
            tokenizer_path = ([m for m in models if m.role == "target"] or models)[0].path
        return GroupConfig(
            models=tuple(models),
            tokenizer_path=tokenizer_path,
            defaults=self.defaults,
            **self.limits.model_dump(),
            **self.engine.model_dump(),
            **resources.model_dump(include=set(CoordinatorResourceArgs.model_fields) | set(PlacementArgs.model_fields)),
        )


class ModelSpec(ModelArgs):
    """One model worker as bring-up starts it: its :class:`ModelArgs` (``path`` resolved) and what
    its actor asks Ray for. Built by :meth:`SpecServeArgs.freeze`."""

    name: str = Field(..., min_length=1, description="The model's name (its key under models).")
    num_gpus: float | None = Field(
        ..., ge=0.0,
        description="GPUs of the worker actor (per_model gpus, else gpus_per_model); None: 'auto', settled by "
        "bring-up (one GPU when the Ray cluster has GPUs, else none).",
    )
    num_cpus: float = Field(..., ge=0.0, description="CPUs of the worker actor (per_model cpus, else cpus_per_model).")
    torch_threads: TorchThreads = Field(
        ..., description="torch intra-op threads of a CPU worker (resources.torch_threads; 'auto': its cores once bound).")
    one_thread_below: int = Field(
        0, ge=0, description="Forwards of less work (tokens x parameters) run on one torch thread "
        "(resources.one_thread_below); 0: every forward on torch_threads.")
    resources: dict[str, float] = Field(
        ...,
        description="Custom Ray resources of the worker actor and its placement-group bundle (per_model resources); "
        "they pin it to nodes that have them.",
    )
    simulated_device: SimulatedDeviceArgs | None = Field(
        None, description="engine.simulated_device's entry for this model (benchmarks only); None: the real device."
    )
    lean_forward: bool = Field(True, description="Whether the worker runs the lean decoder forward (engine.lean_forward).")
    cuda_graphs: bool = Field(False, description="Whether decode forwards replay CUDA graphs (engine.cuda_graphs).")
    keep_freed_memory: bool = Field(
        True, description="Whether the worker keeps freed memory for its next step (engine.keep_freed_memory)."
    )


class GroupConfig(LimitsArgs, EngineArgs, CoordinatorResourceArgs, PlacementArgs):
    """A whole model group (workers + coordinator) as bring-up, the coordinator and the serving
    layer receive it. The limits, engine and coordinator-resource fields are the args' own
    (inherited); the rest is derived by :meth:`SpecServeArgs.freeze`."""

    models: tuple[ModelSpec, ...] = Field(..., min_length=1, description="One worker per model, in the args' order.")
    tokenizer_path: str | None = Field(
        ..., description="Tokenizer to load (resolved); None: token ids only (no text, no stop strings)."
    )
    defaults: DecodingDefaults = Field(..., description="Default strategy settings (the args' defaults).")
    workers: tuple[tuple[str, ...], ...] | None = Field(
        None, description="The model names each worker hosts, settled at bring-up from placement (None: not yet).")
    placement_rule: str = Field("", description="The rule that settled workers (printed at start-up).")

    @property
    def roles(self) -> dict[str, str]:
        """Model name -> role."""
        return {model.name: model.role for model in self.models}

    @property
    def uses_overlap(self) -> bool:
        """Whether the scheduler runs two cohorts: ``overlap``, with ``auto`` settled as on when
        every model has a GPU of its own (``num_gpus`` None, i.e. not settled yet, counts as none; models
        sharing a worker share its GPU)."""
        if self.overlap != "auto":
            return bool(self.overlap)
        shared = self.workers is not None and any(len(models) > 1 for models in self.workers)
        return not shared and all(model.num_gpus is not None and model.num_gpus >= 1 for model in self.models)

    @property
    def row_precision(self) -> str:
        """``sampling_precision`` settled: "auto" is float32 when a worker has a GPU (``num_gpus`` None,
        not settled yet, counts as none), else float64."""
        if self.sampling_precision != "auto":
            return self.sampling_precision
        return "float32" if any(model.num_gpus for model in self.models) else "float64"

    def model(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r}; models are {[m.name for m in self.models]}")
