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
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import string
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from actors.api import InvalidRequestError, SpeculationParams
from actors.coordination.plan import ALTERNATE, ENSEMBLE_STRATEGIES, DecodingDefaults, resolve_plan

ModelRole = Literal["target", "draft", "member"]
DType = Literal["float32", "float16", "bfloat16"]


class ConfigError(ValueError):
    """The deployment configuration is invalid; the message names the key and the value."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelArgs(_Frozen):
    """One model of the group; each runs in its own ModelWorker actor."""

    path: str = Field(..., min_length=1, description="Hub id, local checkpoint directory, or embedded:<name>.")
    role: ModelRole = Field(
        ...,
        description="target (the verifier, also the ar baseline), draft (the sd/multi_draft proposer) "
        "or member (an ensemble member; the target can be an ensemble member too).",
    )
    dtype: DType | None = Field(
        None,
        description="Weights (and KV cache) dtype once loaded; unset: the checkpoint's own (config dtype / "
        "torch_dtype, e.g. bfloat16) on a GPU, float32 on CPU.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub ids.")
    max_context: int | None = Field(
        None, ge=2, description="Context length override; default: the model's max_position_embeddings."
    )


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


#: A custom-resources mapping, checked by :func:`check_custom_resources`.
CustomResources = Annotated[dict[str, float], AfterValidator(check_custom_resources)]


class ModelResourceArgs(_Frozen):
    """Resource override for one model."""

    gpus: float | None = Field(None, ge=0.0, description="GPUs for this model's worker.")
    cpus: float | None = Field(None, ge=0.0, description="CPUs for this model's worker.")
    resources: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources this model's worker asks for, e.g. {node_draft: 0.01}: the worker "
        "(and its placement-group bundle) then goes only on nodes started with that resource "
        "(`ray start --resources='{\"node_draft\": 1}'`). Names other than CPU, GPU, memory, object_store_memory; "
        "quantities >= 0.0001. Empty: any node.",
    )


class CoordinatorResourceArgs(_Frozen):
    """What the coordinator actor of a model group asks Ray for (part of ``resources``)."""

    coordinator_cpus: float = Field(0.0, ge=0.0, description="CPUs reserved for the coordinator actor.")
    coordinator_resources: CustomResources = Field(
        default_factory=dict,
        description="Custom Ray resources the coordinator asks for, e.g. {node_coordinator: 0.01}: it then goes only "
        "on nodes started with that resource (in a Serve replica: in a bundle of its own holding them). Same rules "
        "as per_model.<name>.resources. Empty: any node.",
    )


class PlacementArgs(_Frozen):
    """Which models share a worker process (part of ``resources``; :mod:`cluster.placement`)."""

    placement: Literal["auto", "separate"] | dict[str, Annotated[int, Field(ge=0)]] = Field(
        "auto",
        description="Models placed on devices: a mapping model -> device id (an int >= 0; every model placed), the "
        "models given one id hosted by ONE worker process (one CUDA context on a GPU), each keeping its own KV cache "
        "slots and sessions, their step's calls in one call; 'separate': a worker per model; 'auto': a worker per "
        "model when GPUs or nodes are set by hand (gpus_per_model a number, per_model gpus or resources) or the Ray "
        "cluster has a GPU for each, otherwise the draft shares its target's worker and every "
        "other model has its own, workers dealt round-robin onto the GPUs when there are fewer (docs/serving.md, "
        "'Placement'). The rule is printed at start-up.",
    )


class ResourcesArgs(CoordinatorResourceArgs, PlacementArgs):
    """What each actor of a model group asks Ray for."""

    gpus_per_model: float | Literal["auto"] = Field(
        "auto",
        description="GPUs per worker; 'auto': one GPU per worker when the Ray cluster has GPUs, else none (with "
        "placement auto, models share workers when there are fewer GPUs than models). A group that asks for more "
        "GPUs than the cluster has is refused at start-up.",
    )
    cpus_per_model: float = Field(
        0.25, ge=0.0, description="CPUs per model worker (small on CPU so a whole group fits on 2 cores)."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per CPU model worker.")
    per_model: dict[str, ModelResourceArgs] = Field(
        default_factory=dict, description="Per-model overrides keyed by model name (gpus, cpus, custom resources)."
    )


#: Default of ``limits.max_prompt_chars``.
DEFAULT_MAX_PROMPT_CHARS = 1_000_000


class LimitsArgs(_Frozen):
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


class SecurityArgs(_Frozen):
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


class ServerArgs(_Frozen):
    """Where the HTTP and gRPC servers listen (used by `specserve serve`)."""

    host: str = Field("127.0.0.1", description="Bind address of the HTTP and gRPC servers.")
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP (OpenAI-compatible) port.")
    grpc_port: int = Field(9000, ge=1, le=65535, description="gRPC port.")


#: Units of a memory size (lower case): kB..TB are powers of 1000, KiB..TiB of 1024.
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                 "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: Any) -> int | float:
    """``engine.kv_cache_memory`` (``actors.model.kv_budget``): bytes (int) or a GPU fraction (float in (0, 1]).

    Accepts an int (bytes, >= 1), a float in (0, 1] (a fraction) or a string: a size with a unit
    (``"4GiB"``, ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``; KiB/MiB/GiB/TiB are powers of 1024,
    kB/MB/GB/TB of 1000, no unit: bytes). Raises ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected bytes (e.g. 4294967296 or '4GiB') or a fraction in (0, 1], got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a size in bytes must be >= 1, got {value}")
        return value
    if isinstance(value, float):
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError(
                f"a fraction of GPU memory must be in (0, 1], got {value!r}; give bytes as an int or e.g. '4GiB'"
            )
        return value
    if isinstance(value, str):
        match = _MEMORY_SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _MEMORY_UNITS:
            raise ValueError(f"cannot read {value!r} as a size: expected e.g. '4GiB', '512MiB', '2GB' or a byte count")
        size = int(float(match.group(1)) * _MEMORY_UNITS[unit])
        if size < 1:
            raise ValueError(f"a size must be at least 1 byte, got {value!r}")
        return size
    raise ValueError(f"expected bytes (int or e.g. '4GiB') or a fraction in (0, 1], got {type(value).__name__}")


#: ``engine.kv_cache_memory``: bytes (an int, or a string such as "4GiB") or a fraction in (0, 1].
MemoryBudget = Annotated[int | float, BeforeValidator(parse_memory)]


class SimulatedDeviceArgs(_Frozen):
    """A modelled accelerator's time for one forward of a model (benchmarks only)."""

    fixed_ms: float = Field(..., ge=0.0, description="Milliseconds every forward costs, whatever its size.")
    per_token_ms: float = Field(..., ge=0.0, description="Milliseconds each new token of a forward adds.")
    device: str | None = Field(
        None, min_length=1, max_length=64,
        description="Models given the same id share one modelled device: their modelled forwards never overlap in "
        "time (queued first come, first served, like two models time-slicing one GPU; the workers of one node "
        "share the device clock). Unset: the model has a device of its own.",
    )


class EngineArgs(_Frozen):
    """How the step scheduler runs the requests in flight (docs/design.md), and the KV cache
    each worker holds (docs/models.md, "KV cache memory")."""

    kv_cache_memory: MemoryBudget | None = Field(
        None,
        description="KV cache memory of each model worker: bytes (an int, or a string such as '4GiB', '512MiB', "
        "'2GB') or, on a GPU, a fraction in (0, 1] of the device memory free once the weights are loaded. The worker "
        "holds as many whole-context slots (one per running request) as fit, and the group runs at most as many "
        "requests at once as its smallest worker holds (the rest wait); a budget that cannot hold one request of "
        "max_model_len tokens is refused at start-up. Unset: 0.9 on a GPU; on CPU 2 x "
        "limits.max_concurrent_requests + 4 slots.",
    )
    max_model_len: int | None = Field(
        None, ge=2,
        description="The most context one request may use (prompt + max_tokens) in this group; each KV cache slot "
        "holds this many tokens (plus scratch columns for drafts). At most every model's context "
        "(models.<name>.max_context, default its max_position_embeddings); unset: each model's own, so the group's "
        "limit is the smallest model's. Requests past it get HTTP 400.",
    )

    max_tokens_per_step: int = Field(
        512, ge=8,
        description="Tokens one model worker feeds in one step at most: the rows of the running requests "
        "(decoding, verification) first, what is left to the prefill of new prompts. A prompt longer than this is "
        "prefilled in chunks over several steps (chunked prefill), so the running streams keep producing tokens "
        "while it arrives; the output is unchanged. Lower: steadier inter-token latency while long prompts "
        "arrive, a slower first token for them; on a GPU 2048-8192 suit better (docs/strategies.md).",
    )
    overlap: bool | Literal["auto"] = Field(
        "auto",
        description="Two alternating cohorts of requests, so the draft proposes for one while the target verifies "
        "the other (every request's tokens are the same either way); false: one cohort, every request in every step; "
        "auto: on when every model worker has its own GPU, off on CPU, where the workers share the cores and the "
        "halved batches cost more than the overlap gains (docs/benchmarks.md).",
    )
    lean_forward: bool = Field(
        True,
        description="Llama-shaped models (llama, mistral, qwen2, qwen3) run the engine's lean decoder forward: the "
        "model's own operations over packed q/k/v and gate/up weights, without transformers' per-layer dispatch; "
        "logits equal the model's own forward to float32 rounding, and each worker checks that at load (a model "
        "that differs runs its own forward, with a warning naming it). false: every model runs its transformers "
        "decoder module (docs/design.md).",
    )
    prefix_caching: bool = Field(
        True,
        description="A new request's session copies the keys/values of the longest prefix of its prompt that its "
        "model worker already holds (an open request's context, or a finished request's parked slot) instead of "
        "computing them again; the output is unchanged (docs/design.md).",
    )
    sampling_precision: Literal["auto", "float32", "float64"] = Field(
        "auto",
        description="What the model workers compute the rows they draw tokens from and verify against in (the "
        "one sampling path: penalties, temperature, top-k / top-p, draws, token and block verification). float64: "
        "what the exactness proofs enumerate; float32: the law up to float32 rounding (bounded in the tests), the "
        "precision a GPU computes fast; auto: float32 when a model worker has a GPU, else float64. The speculative "
        "ensemble's rows and the multi-draft rules compute in float64 either way (docs/strategies.md).",
    )
    goodput_gamma: bool = Field(
        True,
        description="gamma \"auto\" also weighs the measured cost of a step at the current batch (draft and target "
        "forwards, per-step overhead) and may take plain steps (no draft) when they yield more tokens per second "
        "(the law is unchanged; seeded tokens then depend on timings); false: the block follows the request's "
        "acceptance alone, seeded tokens reproducible (docs/verifiers.md).",
    )
    pre_drafting: int = Field(
        0,
        ge=0,
        le=8,
        description="sd with a single-draft rule: while the target verifies a block, the draft drafts the next "
        "block after each of this many candidate bonus tokens (its most likely ones), and the next step verifies "
        "that chain when the block is accepted in full and the bonus is a candidate, so the draft's forwards leave "
        "the critical path where draft and target have devices of their own. 0: off. The law is unchanged (exact "
        "enumeration); seeded tokens differ from those with it off (docs/verifiers.md).",
    )
    burst_ms: float = Field(
        100.0,
        ge=0.0,
        le=10_000.0,
        description="Solo bursts: while exactly one request is running and none waits, its target's worker runs "
        "its steps (ar; sd and multi_draft without pre_drafting; se with a draft proposer, in a scoring member's "
        "worker) for up to this many milliseconds per call, calling the draft's (and the other members') worker directly and streaming each step's tokens, instead of one scheduler round trip per "
        "step. A request arriving meanwhile starts after the burst (at most this much later). Tokens are the same "
        "either way; 0: off (docs/design.md).",
    )
    simulated_device: dict[str, SimulatedDeviceArgs] = Field(
        default_factory=dict,
        description="Benchmarks only (default: none): model name -> {fixed_ms, per_token_ms}; that model's worker "
        "runs each real forward, then waits until fixed_ms + per_token_ms x (tokens in the forward) has passed since "
        "it began, releasing the CPU, as a host waiting on a device would (tokens unchanged; docs/benchmarks.md, "
        "'Modelled devices').",
    )


class SpecServeArgs(_Frozen):
    """The ``args`` of a specserve application in a Ray Serve YAML file."""

    models: dict[str, ModelArgs] = Field(..., min_length=1, description="Model name -> model; one per worker actor.")
    tokenizer: str | None = Field(
        None, description="Tokenizer path/hub id/embedded:<name>; default: the target's (else the first model's)."
    )
    defaults: DecodingDefaults = Field(default_factory=DecodingDefaults, description="Default strategy settings.")
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
                resources=override.resources,
                simulated_device=self.engine.simulated_device.get(name),
                lean_forward=self.engine.lean_forward,
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
    torch_threads: int = Field(..., ge=1, description="torch intra-op threads of a CPU worker (resources.torch_threads).")
    resources: dict[str, float] = Field(
        ...,
        description="Custom Ray resources of the worker actor and its placement-group bundle (per_model resources); "
        "they pin it to nodes that have them.",
    )
    simulated_device: SimulatedDeviceArgs | None = Field(
        None, description="engine.simulated_device's entry for this model (benchmarks only); None: the real device."
    )
    lean_forward: bool = Field(True, description="Whether the worker runs the lean decoder forward (engine.lean_forward).")


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
