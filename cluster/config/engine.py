"""``engine``: how each worker runs its model (KV cache memory, batching, precision, the
simulated device of benchmarks)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from cluster.config.base import Accepts, Frozen

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
MemoryBudget = Annotated[
    int | float, BeforeValidator(parse_memory),
    Accepts('integer (bytes) | string ("40GiB", "512MiB") | number (GPU fraction, (0, 1])'),
]


class SimulatedDeviceArgs(Frozen):
    """A modelled accelerator's time for one forward of a model (benchmarks only)."""

    fixed_ms: float = Field(..., ge=0.0, description="Milliseconds every forward costs, whatever its size.")
    per_token_ms: float = Field(..., ge=0.0, description="Milliseconds each new token of a forward adds.")
    device: str | None = Field(
        None, min_length=1, max_length=64,
        description="Models given one id share a modelled device: their modelled forwards never overlap. Unset: a device "
        "of its own.",
    )


class EngineArgs(Frozen):
    """How the step scheduler runs the requests in flight (docs/design.md), and the KV cache
    each worker holds (docs/models.md, "KV cache memory")."""

    kv_cache_memory: MemoryBudget | None = Field(
        None,
        description="Each model worker's KV cache, allocated at start: bytes, or on a GPU a fraction of the memory free after"
        " the weights; a pool of KV blocks that requests run in while they fit (docs/models.md). Unset: 0.9 on a GPU;"
        " on CPU 2 x limits.max_concurrent_requests + 4 whole slots.",
    )
    max_model_len: int | None = Field(
        None, ge=2,
        description="Most context one request may use (prompt + max_tokens; longer: HTTP 400), a KV cache slot's tokens. At "
        "most every model's context (models.<name>.max_context); unset: the smallest.",
    )

    max_tokens_per_step: int = Field(
        512, ge=8,
        description="Most tokens a worker feeds in one step: the running requests' rows, then chunks of new prompts (chunked "
        "prefill, paced while others decode; output unchanged). Lower: steadier gaps, later long-prompt first "
        "tokens; 2048-8192 suit a GPU.",
    )
    step_tokens: int = Field(
        8, ge=1, le=64,
        description="Tokens an ar step (sd's plain steps under gamma auto too) draws per request when several run: what a "
        "chunk coalesces (more: throughput; fewer: shorter gaps). Tokens unchanged.",
    )
    first_step_tokens: int = Field(
        2, ge=1, le=64,
        description="step_tokens (at most) in a step giving a request its first token.",
    )
    overlap: bool | Literal["auto"] = Field(
        "auto",
        description="Two alternating cohorts: the draft proposes for one while the target verifies the other (tokens "
        "unchanged). auto: on when every model worker has its own GPU.",
    )
    keep_freed_memory: bool = Field(
        True,
        description="Workers keep freed memory for their next step (glibc mmap threshold 32 MiB, trim 256 MiB): row tensors "
        "reuse the heap, not fresh pages. false: glibc's defaults.",
    )
    lean_forward: bool = Field(
        True,
        description="Llama-shaped models (llama, mistral, qwen2, qwen3) run the engine's lean decoder (packed weights), "
        "checked at load against their own forward (a mismatch runs their own, with a warning). false: transformers'.",
    )
    cuda_graphs: bool = Field(
        False,
        description="A lone request's one-token decodes replay a CUDA graph; on only where measured (make gpu-check). CPU: "
        "ignored, a warning.",
    )
    prefix_caching: bool = Field(
        True,
        description="A new request reuses the keys/values of the longest prompt prefix its worker holds (an open request's, "
        "or a finished request's parked blocks); output unchanged.",
    )
    sampling_precision: Literal["auto", "float32", "float64"] = Field(
        "auto",
        description="Precision of the rows tokens are drawn from and verified against: float64 (what the proofs enumerate) or"
        " float32 (the law up to float32 rounding; fast on a GPU); auto: float32 on a GPU. Ensemble rows and "
        "multi-draft rules stay float64.",
    )
    goodput_gamma: bool = Field(
        True,
        description="gamma \"auto\" also weighs the measured cost of a step at the current batch, taking plain steps (no draft)"
        " when they yield more tokens/s (law unchanged; seeded tokens depend on timings). false: acceptance "
        "alone, seeded tokens reproducible.",
    )
    pre_drafting: int = Field(
        0,
        ge=0,
        le=8,
        description="sd, single-draft rules: while the target verifies a block, the draft drafts the next one after each of "
        "this many likeliest bonus tokens (docs/verifiers.md); for a draft and target on devices of their own. 0:"
        " off. Law unchanged; seeded tokens differ.",
    )
    burst_ms: float = Field(
        1000.0,
        ge=0.0,
        le=10_000.0,
        description="Solo bursts: a request running alone has its target's worker run its iterations (ar, sd, multi_draft) "
        "for up to this many ms a call, calling the draft directly, until an arrival or cancel. Tokens unchanged; 0: off.",
    )
    row_transport: Literal["auto", "gloo", "nccl", "object_store"] = Field(
        "auto",
        description="Draft rows to a target on its own worker: object_store, or gloo / nccl (Ray Direct Transport; object "
        "store on failure; auto: nccl on GPUs). Tokens unchanged.",
    )
    simulated_device: dict[str, SimulatedDeviceArgs] = Field(
        default_factory=dict,
        description="Benchmarks only: model name -> a modelled device: each real forward, then a wait until fixed_ms + "
        "per_token_ms x its tokens have passed (docs/benchmarks.md).",
    )
