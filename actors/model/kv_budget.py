"""How much KV cache a worker holds: a pool of blocks sized from a memory budget, as serving engines do.

Each session holds blocks of :data:`~actors.model.kv_cache.DEFAULT_BLOCK_SIZE` tokens from one
pool per model (:mod:`actors.model.kv_cache`) as its context grows, up to ``max_model_len``
columns plus the scratch columns of drafts (``actors.worker.model_worker.SCRATCH_COLUMNS``): a
whole *slot* (:func:`slot_bytes`). With ``engine.kv_cache_memory`` (bytes, or on a GPU a
fraction of the device memory free once the weights are loaded; vLLM's
``gpu_memory_utilization`` plays the same part) the pool holds as many blocks as the budget
fits (:func:`plan_kv_slots`); a budget below one slot is refused at start-up with
:class:`KVCacheBudgetError` naming the numbers (one request of ``max_model_len`` tokens could
never run). The coordinator admits requests while their blocks fit and preempts the newest
when they would not (``actors.coordination.admission``), so no request fails for lack of blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from actors.model.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache, cache_shape

#: ``engine.kv_cache_memory`` when unset on a GPU: this fraction of the memory free after the weights.
DEFAULT_GPU_FRACTION = 0.9

class KVCacheBudgetError(ValueError):
    """The KV cache budget cannot hold what the configuration asks; the message names the numbers."""


def resolve_dtype(requested: str | None, device: str, config: Any) -> str:
    """The weights' dtype: ``requested`` when given; else on a GPU the checkpoint's own
    (``config.dtype`` / ``config.torch_dtype``: float16, bfloat16 or float32; float32 when it names
    none) and on CPU float32."""
    if requested is not None:
        return requested
    if torch.device(device).type == "cpu":
        return "float32"
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(saved).removeprefix("torch.") if saved is not None else ""
    return name if name in ("float16", "bfloat16", "float32") else "float32"


def context_limit(model_context: int, max_model_len: int | None, model: str) -> int:
    """The context a request may use on ``model``: ``max_model_len`` when set, else the model's
    own; ValueError naming both when ``max_model_len`` exceeds what the model holds."""
    if max_model_len is None:
        return int(model_context)
    if max_model_len > model_context:
        raise KVCacheBudgetError(
            f"engine.max_model_len={max_model_len} exceeds the context of model {model!r} ({model_context}); "
            f"set it to at most {model_context}"
        )
    return int(max_model_len)


def slot_bytes(config: Any, capacity: int, dtype: torch.dtype, sliding: bool = False) -> int:
    """Bytes one session's slot costs: its keys and values (:meth:`PagedKVCache.slot_bytes`) plus,
    for a model with sliding-window layers, the position of every column (int64,
    ``actors.model.layer_masks.ColumnPositions``)."""
    positions = (capacity + 1) * 8 if sliding else 0
    return PagedKVCache.slot_bytes(config, capacity, dtype) + positions


def worker_kv_cache_memory(kv_cache_memory: int | float | None, device: str) -> int | float | None:
    """A serving worker's budget: ``engine.kv_cache_memory`` when set; unset,
    :data:`DEFAULT_GPU_FRACTION` on a GPU and None (no budget: today's slot count) on CPU."""
    if kv_cache_memory is None and torch.device(device).type == "cuda":
        return DEFAULT_GPU_FRACTION
    return kv_cache_memory


def budget_bytes(kv_cache_memory: int | float | None, device: str, model: str) -> int | None:
    """The KV cache budget in bytes: ``kv_cache_memory`` bytes as given, or its fraction of the
    GPU memory free now (after the weights are loaded); None: no budget."""
    on_gpu = torch.device(device).type == "cuda"
    if kv_cache_memory is None or isinstance(kv_cache_memory, int):
        return kv_cache_memory
    if not on_gpu:
        raise KVCacheBudgetError(
            f"engine.kv_cache_memory={kv_cache_memory} is a fraction of GPU memory, but model {model!r} runs on "
            f"{device}: give bytes instead (e.g. '4GiB')"
        )
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(kv_cache_memory * free)


def plan_kv_slots(
    config: Any, *, model: str, max_model_len: int, capacity: int, dtype: torch.dtype, device: str,
    kv_cache_memory: int | float | None, default_slots: int, sliding: bool = False,
) -> tuple[int, int, int]:
    """``(slots, bytes per slot, blocks)`` of a worker: ``default_slots`` sessions over a pool of
    as many blocks as the budget (:func:`budget_bytes`) holds, or ``default_slots`` whole slots of
    blocks when there is no budget (``kv_cache_memory`` None). Raises :class:`KVCacheBudgetError`
    naming the budget, the slot's bytes, the model and ``max_model_len`` when the budget cannot
    hold one slot: one request of ``max_model_len`` tokens could never run."""
    per_slot = slot_bytes(config, capacity, dtype, sliding)
    blocks_per_slot = -(-capacity // DEFAULT_BLOCK_SIZE)
    budget = budget_bytes(kv_cache_memory, device, model)
    if budget is None:
        return int(default_slots), per_slot, int(default_slots) * blocks_per_slot
    if budget < per_slot:
        layers, kv_heads, head_dim = cache_shape(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        raise KVCacheBudgetError(
            f"model {model!r}: the KV cache budget (engine.kv_cache_memory: {budget} bytes, {budget / 2**30:.2f} GiB) "
            f"holds no slot for one request of max_model_len={max_model_len}: a slot takes {per_slot} bytes "
            f"({per_slot / 2**30:.2f} GiB = {layers} layers x 2 x {kv_heads} kv heads x {head_dim} head dim x "
            f"{blocks_per_slot * DEFAULT_BLOCK_SIZE} columns x {itemsize} bytes); "
            f"raise engine.kv_cache_memory to at least {per_slot} "
            f"or lower engine.max_model_len"
        )
    positions = (per_slot - PagedKVCache.slot_bytes(config, capacity, dtype)) * int(default_slots)  # sliding only
    blocks = max(blocks_per_slot, (budget - positions) // PagedKVCache.block_bytes(config, DEFAULT_BLOCK_SIZE, dtype))
    return int(default_slots), per_slot, int(blocks)
