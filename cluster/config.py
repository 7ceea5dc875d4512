"""Schema of the specserve application ``args`` in Ray Serve YAML files, and its frozen form.

``deploy/*.yaml`` are Ray Serve config files::

    applications:
      - name: specserve
        route_prefix: /
        import_path: cluster.app:build_app
        args: {models: ..., defaults: ..., resources: ..., limits: ..., server: ..., security: ...}
        deployments: [...]

:class:`SpecServeArgs` validates ``args`` (pydantic, ``extra="forbid"``, every field
described; errors name the bad key and value) and :meth:`SpecServeArgs.freeze` translates it
once into the frozen :class:`GroupConfig` that bring-up, the coordinator and the serving layer
use. :func:`load_app_args` reads one application's ``args`` from a YAML file.
:func:`resolve_api_key` gives an application's API key (``security.api_key``, else the
``SPECSERVE_API_KEY`` environment variable); the key never enters :class:`GroupConfig`, which
travels to the actors.
"""

from __future__ import annotations

import math
import os
import pathlib
import string
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from actors.api import MAX_DRAFTS, MAX_GAMMA, EnsembleKind, GammaValue, InvalidRequestError, SpeculationParams, Strategy
from actors.plan import DecodingDefaults, resolve_plan

ModelRole = Literal["target", "draft", "member"]
DType = Literal["float32", "float16", "bfloat16"]


class ConfigError(ValueError):
    """The deployment configuration is invalid; the message names the key and the value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelArgs(_Strict):
    """One model of the group; each runs in its own ModelWorker actor."""

    path: str = Field(..., min_length=1, description="Hub id, local checkpoint directory, or embedded:<name>.")
    role: ModelRole = Field(
        ...,
        description="target (the verifier, also the ar baseline), draft (the sd/multi_draft proposer) "
        "or member (an ensemble member; the target can be an ensemble member too).",
    )
    dtype: DType = Field("float32", description="Weights dtype once loaded (float32 on CPU is the safe choice).")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub ids.")
    max_context: int | None = Field(
        None, ge=2, description="Context length override; default: the model's max_position_embeddings."
    )


class DefaultsArgs(_Strict):
    """Strategy settings used when a request leaves a field unset (see actors.api.SpeculationParams)."""

    strategy: Strategy = Field("sd", description="ar | sd | multi_draft | ensemble | se.")
    method: str | None = Field(
        None,
        description="Verification rule of the default strategy: token | block | greedy_block (sd), "
        "spectr | sequential_gbv | spectr_gbv (multi_draft), token | block (se). Unset: the strategy's first rule.",
    )
    gamma: GammaValue = Field(
        4,
        description='Draft block length (sd, multi_draft; se default per member), or "auto": each request chooses '
        "its block before each draft from its own acceptance so far, in [1, gamma_max] (sd, multi_draft).",
    )
    gamma_max: int = Field(8, ge=1, le=MAX_GAMMA, description='Largest block gamma "auto" may draft.')
    draft_cost_ratio: float = Field(
        0.15, ge=0.0, le=10.0,
        description='Time of one draft forward over one target verification forward, used by gamma "auto" to '
        "weigh longer blocks (0.15: the embedded family on one CPU thread; measure yours with specserve bench).",
    )
    num_drafts: int = Field(2, ge=1, le=MAX_DRAFTS, description="Number of i.i.d. drafts K (multi_draft).")
    ensemble: EnsembleKind = Field("weighted", description="weighted | contrastive (ensemble, se).")
    members: list[str] | None = Field(
        None, description="Ensemble members in order (contrastive: expert, amateur). Unset: target then members."
    )
    weights: list[float] | None = Field(None, description="Weighted-ensemble weights, one per member, summing to 1.")
    mu: float = Field(0.1, ge=0.0, description="Contrastive strength: softmax(expert - mu * amateur).")
    gammas: list[int] | None = Field(None, description="Per-member proposal lengths (se). Unset: gamma for each.")


#: Ray resource names a ``resources`` mapping may not use: CPUs and GPUs have their own fields,
#: memory is not a placement label.
RESERVED_RESOURCE_NAMES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
#: Smallest non-zero resource quantity Ray accepts.
MIN_RESOURCE_QUANTITY = 0.0001


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


class ModelResourceArgs(_Strict):
    """Resource override for one model."""

    gpus: float | None = Field(None, ge=0.0, description="GPUs for this model's worker.")
    cpus: float | None = Field(None, ge=0.0, description="CPUs for this model's worker.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources this model's worker asks for, e.g. {node_draft: 0.01}: the worker "
        "(and its placement-group bundle) then goes only on nodes started with that resource "
        "(`ray start --resources='{\"node_draft\": 1}'`). Names other than CPU, GPU, memory, object_store_memory; "
        "quantities >= 0.0001. Empty: any node.",
    )

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources)


class ResourcesArgs(_Strict):
    """What each actor of a model group asks Ray for."""

    gpus_per_model: float | Literal["auto"] = Field(
        "auto",
        description="GPUs per model worker; 'auto': one GPU per worker when the Ray cluster has GPUs, else none.",
    )
    cpus_per_model: float = Field(
        0.25, ge=0.0, description="CPUs per model worker (small on CPU so a whole group fits on 2 cores)."
    )
    coordinator_cpus: float = Field(0.0, ge=0.0, description="CPUs reserved for the coordinator actor.")
    coordinator_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources the coordinator asks for, e.g. {node_coordinator: 0.01}: it then goes only "
        "on nodes started with that resource (in a Serve replica: in a bundle of its own holding them). Same rules "
        "as per_model.<name>.resources. Empty: any node.",
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per CPU model worker.")
    per_model: dict[str, ModelResourceArgs] = Field(
        default_factory=dict, description="Per-model overrides keyed by model name (gpus, cpus, custom resources)."
    )

    @field_validator("coordinator_resources")
    @classmethod
    def _coordinator_custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources)


#: Default of ``limits.max_prompt_chars``.
DEFAULT_MAX_PROMPT_CHARS = 1_000_000


class LimitsArgs(_Strict):
    """Admission, request-size and session limits of one model group."""

    max_concurrent_requests: int = Field(16, ge=1, description="Requests decoded at once by one coordinator.")
    max_queued_requests: int = Field(
        64, ge=0, description="Requests waiting for a decoding place; past this a request is refused (HTTP 429, gRPC RESOURCE_EXHAUSTED)."
    )
    session_idle_timeout_s: float = Field(
        300.0, gt=0.0, description="A worker frees a request's KV cache after this long without a call."
    )
    request_timeout_s: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="A request still unfinished this long after it arrived (waiting included) ends with HTTP 504 / "
        "gRPC DEADLINE_EXCEEDED and its sessions are freed; bounds the work of clients that vanished unnoticed.",
    )
    max_prompt_chars: int = Field(
        DEFAULT_MAX_PROMPT_CHARS,
        ge=1,
        description="Longest prompt accepted, checked by the ingress before any model work: characters of a "
        "text prompt (chat: of the rendered conversation), or number of ids of a token-id prompt.",
    )


#: Environment variable holding the API key when ``security.api_key`` is not set.
API_KEY_ENV = "SPECSERVE_API_KEY"
API_KEY_MIN_CHARS = 16
API_KEY_MAX_CHARS = 256
_API_KEY_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


def check_api_key(key: str, where: str) -> str:
    """``key`` if it is 16-256 printable ASCII characters without spaces, else ValueError
    (the message never repeats the key)."""
    if not API_KEY_MIN_CHARS <= len(key) <= API_KEY_MAX_CHARS:
        raise ValueError(f"{where}: an API key needs {API_KEY_MIN_CHARS} to {API_KEY_MAX_CHARS} characters, got {len(key)}")
    if not set(key) <= _API_KEY_CHARS:
        raise ValueError(f"{where}: an API key may hold printable ASCII characters only (no spaces)")
    return key


class SecurityArgs(_Strict):
    """Client authentication of the HTTP and gRPC endpoints."""

    api_key: str | None = Field(
        None,
        repr=False,
        description="Key clients must send (HTTP `Authorization: Bearer <key>`, gRPC metadata `authorization: "
        f"Bearer <key>` or `x-api-key: <key>`). Unset: the {API_KEY_ENV} environment variable of the serving "
        "processes; neither set: no authentication. 16-256 printable ASCII characters. GET /health stays open.",
    )

    @field_validator("api_key")
    @classmethod
    def _key_format(cls, value: str | None) -> str | None:
        return None if value is None else check_api_key(value, "security.api_key")


class ServerArgs(_Strict):
    """Where the HTTP and gRPC servers listen (used by `specserve serve`)."""

    host: str = Field("127.0.0.1", description="Bind address of the HTTP and gRPC servers.")
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP (OpenAI-compatible) port.")
    grpc_port: int = Field(9000, ge=1, le=65535, description="gRPC port.")


class EngineArgs(_Strict):
    """How the step scheduler runs the requests in flight (docs/engine.md)."""

    overlap: bool = Field(
        True,
        description="Two alternating cohorts of requests, so the draft proposes for one while the target verifies "
        "the other (every request's tokens are the same either way); false: one cohort, every request in every step.",
    )


class SpecServeArgs(_Strict):
    """The ``args`` of a specserve application in a Ray Serve YAML file."""

    models: dict[str, ModelArgs] = Field(..., min_length=1, description="Model name -> model; one per worker actor.")
    tokenizer: str | None = Field(
        None, description="Tokenizer path/hub id/embedded:<name>; default: the target's (else the first model's)."
    )
    defaults: DefaultsArgs = Field(default_factory=DefaultsArgs, description="Default strategy settings.")
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
        roles = {name: model.role for name, model in self.models.items()}
        d = self.defaults
        # The defaults are checked as if a request spelled them all out: for the default
        # strategy, and (when ensemble settings are given) for the ensemble strategies too.
        as_request = {"gamma": d.gamma, "gamma_max": d.gamma_max, "num_drafts": d.num_drafts, "ensemble": d.ensemble, "members": d.members,
                      "weights": d.weights, "mu": d.mu, "gammas": d.gammas}
        checks = [SpeculationParams(strategy=d.strategy, method=d.method, **as_request)]
        if d.strategy not in ("ensemble", "se") and any(v is not None for v in (d.members, d.weights, d.gammas)):
            checks.append(SpeculationParams(strategy="se", **as_request))
        try:
            for speculation in checks:
                resolve_plan(speculation, self.decoding_defaults(), roles)
        except InvalidRequestError as error:
            field = error.field.replace("speculation.", "defaults.")
            raise ValueError(f"{field}: {error.message}") from None
        return self

    def decoding_defaults(self) -> DecodingDefaults:
        d = self.defaults
        return DecodingDefaults(
            strategy=d.strategy,
            method=d.method,
            gamma=d.gamma,
            gamma_max=d.gamma_max,
            draft_cost_ratio=d.draft_cost_ratio,
            num_drafts=d.num_drafts,
            ensemble=d.ensemble,
            members=tuple(d.members) if d.members is not None else None,
            weights=tuple(d.weights) if d.weights is not None else None,
            mu=d.mu,
            gammas=tuple(d.gammas) if d.gammas is not None else None,
        )

    def freeze(self) -> GroupConfig:
        """Translate into the frozen objects the rest of the system uses (paths resolved)."""
        from models import resolve_model_path

        models = tuple(
            ModelSpec(
                name=name,
                path=resolve_model_path(model.path),
                role=model.role,
                dtype=model.dtype,
                revision=model.revision,
                max_context=model.max_context,
                num_gpus=_override(self.resources.per_model.get(name), "gpus", _auto_none(self.resources.gpus_per_model)),
                num_cpus=_override(self.resources.per_model.get(name), "cpus", self.resources.cpus_per_model),
                torch_threads=self.resources.torch_threads,
                resources=_frozen_resources(self.resources.per_model.get(name)),
            )
            for name, model in self.models.items()
        )
        tokenizer = self.tokenizer
        if tokenizer is None:
            target = [m for m in models if m.role == "target"]
            tokenizer_path = (target or list(models))[0].path
        else:
            tokenizer_path = resolve_model_path(tokenizer)
        return GroupConfig(
            models=models,
            tokenizer_path=tokenizer_path,
            defaults=self.decoding_defaults(),
            coordinator_cpus=self.resources.coordinator_cpus,
            coordinator_resources=tuple(sorted(self.resources.coordinator_resources.items())),
            max_concurrent_requests=self.limits.max_concurrent_requests,
            max_queued_requests=self.limits.max_queued_requests,
            overlap=self.engine.overlap,
            session_idle_timeout_s=self.limits.session_idle_timeout_s,
            max_prompt_chars=self.limits.max_prompt_chars,
            request_timeout_s=self.limits.request_timeout_s,
            host=self.server.host,
            http_port=self.server.http_port,
            grpc_port=self.server.grpc_port,
        )


def _auto_none(value: float | str) -> float | None:
    return None if value == "auto" else float(value)


def _frozen_resources(override: ModelResourceArgs | None) -> tuple[tuple[str, float], ...]:
    return () if override is None else tuple(sorted(override.resources.items()))


def _override(override: ModelResourceArgs | None, field: str, default: float | None) -> float | None:
    value = None if override is None else getattr(override, field)
    return default if value is None else value


@dataclass(frozen=True)
class ModelSpec:
    """One model worker: what to load and what to ask Ray for."""

    name: str
    path: str
    role: str
    dtype: str = "float32"
    revision: str | None = None
    max_context: int | None = None
    num_gpus: float | None = 0.0  # None: one GPU if the cluster has GPUs (resolved at bring-up)
    num_cpus: float = 0.25
    torch_threads: int = 1
    #: Custom Ray resources (name, quantity), sorted; they pin the worker to nodes that have them.
    resources: tuple[tuple[str, float], ...] = ()

    @property
    def custom_resources(self) -> dict[str, float]:
        """The custom Ray resources as a dict (the ``resources=`` actor option)."""
        return dict(self.resources)


@dataclass(frozen=True)
class GroupConfig:
    """A whole model group (workers + coordinator), frozen from :class:`SpecServeArgs`."""

    models: tuple[ModelSpec, ...]
    tokenizer_path: str
    defaults: DecodingDefaults
    coordinator_cpus: float = 0.0
    #: Custom Ray resources of the coordinator (name, quantity), sorted.
    coordinator_resources: tuple[tuple[str, float], ...] = ()
    max_concurrent_requests: int = 16
    max_queued_requests: int = 64
    overlap: bool = True
    session_idle_timeout_s: float = 300.0
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    request_timeout_s: float = 600.0
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000

    @property
    def roles(self) -> dict[str, str]:
        """Model name -> role."""
        return {model.name: model.role for model in self.models}

    def model(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r}; models are {[m.name for m in self.models]}")


def resolve_api_key(args: SpecServeArgs, environ: Any = None) -> str | None:
    """The application's API key: ``security.api_key``, else the :data:`API_KEY_ENV` variable
    of ``environ`` (default: this process's environment), else None (no authentication).

    Raises :class:`ConfigError` when the variable is set but is not a valid key.
    """
    if args.security.api_key is not None:
        return args.security.api_key
    value = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if not value:
        return None
    try:
        return check_api_key(value, API_KEY_ENV)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _describe_validation_error(error: ValidationError, where: str) -> str:
    lines = [f"invalid specserve args in {where}:"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "<args>"
        value = item.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if "api_key" in key:
            shown = "<hidden>"
        lines.append(f"  {key} = {shown}: {item['msg']}")
    return "\n".join(lines)


def parse_app_args(args: dict[str, Any] | SpecServeArgs, where: str = "args") -> SpecServeArgs:
    """Validate a raw ``args`` mapping; raises :class:`ConfigError` naming each bad key and value."""
    if isinstance(args, SpecServeArgs):
        return args
    try:
        return SpecServeArgs.model_validate(args)
    except ValidationError as error:
        raise ConfigError(_describe_validation_error(error, where)) from None


def read_serve_config(yaml_path: str | pathlib.Path) -> dict[str, Any]:
    """Read a Ray Serve YAML config file and check its ``applications`` list exists."""
    path = pathlib.Path(yaml_path)
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("applications"), list):
        raise ConfigError(f"{path}: a Ray Serve config needs a top-level 'applications' list")
    return document


def select_application(document: dict[str, Any], app_name: str | None, where: str) -> dict[str, Any]:
    """The application named ``app_name``, or the only one when ``app_name`` is None."""
    applications = document["applications"]
    names = [app.get("name") for app in applications if isinstance(app, dict)]
    if app_name is None:
        if len(applications) != 1:
            raise ConfigError(f"{where}: {len(applications)} applications {names}; pass the name of one")
        return applications[0]
    for app in applications:
        if isinstance(app, dict) and app.get("name") == app_name:
            return app
    raise ConfigError(f"{where}: no application named {app_name!r}; applications are {names}")


def load_app_args(yaml_path: str | pathlib.Path, app_name: str | None = None) -> SpecServeArgs:
    """Read and validate the ``args`` of one application of a Ray Serve YAML file."""
    document = read_serve_config(yaml_path)
    app = select_application(document, app_name, str(yaml_path))
    return parse_app_args(app.get("args") or {}, where=f"{yaml_path} application {app.get('name')!r} args")
