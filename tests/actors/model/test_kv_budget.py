"""KV cache blocks from a memory budget (actors/model/kv_budget.py): what a slot costs equals what the
cache allocates, how many blocks a budget holds (and how many requests they run), the start-up refusal naming the numbers,
max_model_len, the default dtype, a real worker sized by its budget, and the running limit the
coordinator derives from the workers' slot counts."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from actors.coordination.coordinator import running_limit
from actors.model.kv_budget import (
    DEFAULT_GPU_FRACTION,
    KVCacheBudgetError,
    budget_bytes,
    context_limit,
    plan_kv_slots,
    resolve_dtype,
    slot_bytes,
    worker_kv_cache_memory,
)
from actors.model.kv_cache import PagedKVCache
from actors.messages import WorkerInfo
from actors.worker.model_worker import SCRATCH_COLUMNS, ModelWorker
from cluster.config import ModelSpec

CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                     intermediate_size=128, vocab_size=300, max_position_embeddings=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_bytes_equal_the_allocated_storage(dtype):
    slots, capacity = 3, 40
    cache = PagedKVCache.from_config(CONFIG, capacity=capacity, max_slots=slots, dtype=dtype)
    assert PagedKVCache.slot_bytes(CONFIG, capacity, dtype) * slots == cache.pool_bytes
    # 3 layers x 2 x 2 kv heads x 16 head dim x 48 columns (3 blocks of 16) x bytes
    assert slot_bytes(CONFIG, capacity, dtype) == 3 * 2 * 2 * 16 * 48 * dtype.itemsize


def test_sliding_models_also_pay_for_column_positions():
    config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                           intermediate_size=128, vocab_size=300, sliding_window=16)
    assert slot_bytes(config, 40, torch.float32, sliding=True) == PagedKVCache.slot_bytes(config, 40, torch.float32) + 41 * 8


def test_a_byte_budget_holds_as_many_blocks_as_it_fits():
    """3.5 slots of 7 blocks each: 24 blocks, for the given number of sessions."""
    per_slot = slot_bytes(CONFIG, 100, torch.float32)
    block = PagedKVCache.block_bytes(CONFIG, 16, torch.float32)
    assert per_slot == 7 * block  # 100 columns: 7 blocks of 16
    plan = plan_kv_slots(CONFIG, model="m", max_model_len=80, capacity=100, dtype=torch.float32,
                         device="cpu", kv_cache_memory=int(3.5 * per_slot), default_slots=99)
    assert plan == (99, per_slot, 24)


def test_512_mib_run_forty_requests_of_1000_tokens_of_the_real_shape_target():
    """The Qwen2.5-shaped target of benchmarks/peers/real_shape.py (6 layers, 2 kv heads x 32, a
    32,768-token context): 512 MiB hold 5 whole slots but blocks for more than 40 requests of
    1,000 tokens (+ 8 generated, + 288 scratch columns), as the coordinator counts them."""
    from transformers import Qwen2Config

    from actors.messages import KVPool
    from benchmarks.peers.real_shape import CONTEXT, TARGET_SHAPE

    config = Qwen2Config(**TARGET_SHAPE, vocab_size=4352, max_position_embeddings=CONTEXT)
    capacity = CONTEXT + SCRATCH_COLUMNS
    _, per_slot, blocks = plan_kv_slots(config, model="real-shape", max_model_len=CONTEXT, capacity=capacity,
                                        dtype=torch.float32, device="cpu", kv_cache_memory=512 * 2**20, default_slots=64)
    assert 512 * 2**20 // per_slot == 5 and blocks == 10_922
    assert blocks // KVPool(blocks, 16, SCRATCH_COLUMNS).blocks_for(1008) >= 40


def test_no_budget_keeps_the_given_slot_count():
    slots, _, blocks = plan_kv_slots(CONFIG, model="m", max_model_len=80, capacity=100, dtype=torch.float32, device="cpu",
                                     kv_cache_memory=None, default_slots=36)
    assert (slots, blocks) == (36, 36 * 7)  # whole slots
    assert worker_kv_cache_memory(None, "cpu") is None
    assert worker_kv_cache_memory(None, "cuda") == DEFAULT_GPU_FRACTION
    assert worker_kv_cache_memory(1 << 30, "cuda") == 1 << 30


def test_a_budget_below_one_slot_is_refused_naming_the_numbers():
    per_slot = slot_bytes(CONFIG, 100, torch.float32)
    with pytest.raises(KVCacheBudgetError) as error:
        plan_kv_slots(CONFIG, model="tiny-llama", max_model_len=80, capacity=100, dtype=torch.float32, device="cpu",
                      kv_cache_memory=per_slot - 1, default_slots=4)
    message = str(error.value)
    for part in ("'tiny-llama'", f"{per_slot - 1} bytes", f"{per_slot} bytes", "max_model_len=80",
                 "engine.kv_cache_memory", "3 layers x 2 x 2 kv heads x 16 head dim x 112 columns x 4 bytes"):
        assert part in message, (part, message)


def test_a_fraction_needs_a_gpu():
    with pytest.raises(KVCacheBudgetError, match="fraction of GPU memory.*'m'.*cpu"):
        budget_bytes(0.5, "cpu", "m")
    assert budget_bytes(12345, "cpu", "m") == 12345
    assert budget_bytes(None, "cpu", "m") is None


def test_max_model_len_caps_the_context_and_never_exceeds_the_model():
    assert context_limit(4096, None, "m") == 4096
    assert context_limit(4096, 1024, "m") == 1024
    with pytest.raises(KVCacheBudgetError, match=r"max_model_len=8192 exceeds the context of model 'm' \(4096\)"):
        context_limit(4096, 8192, "m")


def test_default_dtype_is_the_checkpoint_on_gpu_and_float32_on_cpu():
    bf16 = LlamaConfig(dtype="bfloat16")
    assert resolve_dtype(None, "cpu", bf16) == "float32"
    assert resolve_dtype(None, "cuda", bf16) == "bfloat16"
    assert resolve_dtype(None, "cuda", LlamaConfig(dtype=torch.float16)) == "float16"
    assert resolve_dtype(None, "cuda", LlamaConfig()) == "float32"  # the config names none
    assert resolve_dtype("float32", "cuda", bf16) == "float32"  # an explicit dtype wins


def test_running_limit_is_the_smallest_worker_slot_count():
    def info(name, slots):
        return WorkerInfo(name, "target", 300, 128, "cpu", kv_slots=slots)

    assert running_limit(16, {"a": info("a", 40), "b": info("b", 7)}) == 7
    assert running_limit(16, {"a": info("a", 40), "b": info("b", None)}) == 16
    assert running_limit(4, {"a": info("a", 40)}) == 4


def _spec(path) -> ModelSpec:
    return ModelSpec(name="target", path=str(path), role="target", num_gpus=0, num_cpus=0.25, torch_threads=1,
                     resources={})


def test_a_worker_holds_what_its_budget_fits(tiny_checkpoints):
    threads = torch.get_num_threads()
    try:
        probe = ModelWorker(_spec(tiny_checkpoints["target"]), max_sessions=1, max_model_len=100)
        per_slot = probe.backend.slot_bytes
        assert probe.backend.max_context == 100 and probe.backend.capacity == 100 + SCRATCH_COLUMNS
        worker = ModelWorker(_spec(tiny_checkpoints["target"]), max_sessions=64, max_model_len=100,
                             kv_cache_memory=5 * per_slot + per_slot // 2)
        cache = worker.backend.cache
        assert worker.backend.max_slots == cache.num_slots == 64  # sessions; the pool holds the blocks
        blocks_per_slot = -(-(100 + SCRATCH_COLUMNS) // cache.block_size)
        assert cache.num_blocks == 5 * blocks_per_slot + blocks_per_slot // 2
        assert cache.pool_bytes <= 5 * per_slot + per_slot // 2
        info = worker.info()
        assert (info.kv_slots, info.max_context, info.kv_pool.blocks) == (64, 100, cache.num_blocks)
        with pytest.raises(KVCacheBudgetError, match="max_model_len=100"):
            ModelWorker(_spec(tiny_checkpoints["target"]), max_model_len=100, kv_cache_memory=per_slot - 1)
    finally:
        torch.set_num_threads(threads)
