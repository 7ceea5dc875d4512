"""Every deploy/*.yaml starts within its stated KV cache budget: for each model worker, the
bytes of one slot (actors/model/kv_budget.py, from the model's config: the embedded ones read from
disk, the hub ones from their published configs written below, nothing downloaded), the slots it
holds and what they cost. The GPU example fits an 80 GB GPU next to its bf16 weights; the CPU
examples keep today's slot count (2 x max_concurrent_requests + 4) within 2 GiB a group."""

from __future__ import annotations

import pathlib

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from actors.model.architectures import resolve_architecture
from actors.model.kv_budget import context_limit, plan_kv_slots, slot_bytes
from actors.model.kv_cache import DEFAULT_BLOCK_SIZE
from actors.worker.model_worker import SCRATCH_COLUMNS
from actors.worker.device_worker import shared_kv_slots
from cluster.config.placement import resolve_placement
from cluster.serving.bringup import worker_sessions
from cluster.config import load_app_args, read_serve_config

REPO = pathlib.Path(__file__).resolve().parents[3]
DEPLOY_FILES = sorted((REPO / "deploy").glob("*.yaml"))

GPU_BYTES = 80 * 10**9  # an 80 GB GPU (H100 / A100 80GB)
CPU_GROUP_BUDGET = 2 * 2**30  # deploy/default.yaml: the CPU examples' KV cache per model group

#: Published configs (config.json on the hub) of the hub models the examples name, and their
#: parameter counts: hidden size, layers, attention heads, kv heads, head dim, context.
PUBLISHED = {
    "meta-llama/Llama-3.1-8B-Instruct": (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                              num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                                              vocab_size=128256, dtype="bfloat16"), 8.03e9),
    "meta-llama/Llama-3.2-1B-Instruct": (dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                              num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                                              vocab_size=128256, dtype="bfloat16"), 1.24e9),
    "meta-llama/Llama-3.2-3B-Instruct": (dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                              num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                                              vocab_size=128256, dtype="bfloat16"), 3.21e9),
}


def _config(path: str):
    if path in PUBLISHED:
        return LlamaConfig(**PUBLISHED[path][0])
    return AutoConfig.from_pretrained(path, local_files_only=True)


def _apps(path: pathlib.Path):
    for app in read_serve_config(path)["applications"]:
        yield app["name"], load_app_args(path, app["name"])


def worker_plans(group) -> dict[str, tuple[int, int, int]]:
    """Model name -> (whole slots its block pool holds, bytes per slot, context) of each worker of
    a frozen group."""
    plans = {}
    for spec in group.models:
        config = _config(spec.path)
        context = context_limit(spec.max_context or config.max_position_embeddings, group.max_model_len, spec.name)
        dtype = getattr(torch, spec.dtype or "float32")  # unset: float32 on CPU
        sliding = resolve_architecture(config, spec.name).has_sliding_layers
        _sessions, per_slot, blocks = plan_kv_slots(
            config, model=spec.name, max_model_len=context, capacity=context + SCRATCH_COLUMNS, dtype=dtype,
            device="cpu", kv_cache_memory=group.kv_cache_memory, default_slots=worker_sessions(group), sliding=sliding,
        )
        plans[spec.name] = (blocks // -(-(context + SCRATCH_COLUMNS) // DEFAULT_BLOCK_SIZE), per_slot, context)
    return _shared(group, plans)


def _shared(group, plans: dict[str, tuple[int, int, int]]) -> dict[str, tuple[int, int, int]]:
    """With a byte budget, the models of one worker split it (actors/worker/device_worker.py): each holds
    the budget over the bytes of one slot in every model of the worker."""
    if group.kv_cache_memory is None:
        return plans
    for models in resolve_placement(group, gpus=len(group.models)).workers:
        if len(models) > 1:
            slots = shared_kv_slots(group.kv_cache_memory, {m: plans[m][1] for m in models}, "+".join(models))
            plans.update({m: (slots, *plans[m][1:]) for m in models})
    return plans


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: p.name)
def test_every_deploy_example_starts_within_its_kv_budget(path):
    for _name, args in _apps(path):
        group = args.freeze()
        plans = worker_plans(group)
        assert all(slots >= 1 for slots, _, _ in plans.values()), plans
        if group.kv_cache_memory is None:  # CPU: today's slot count, within the group's budget
            assert sum(slots * per_slot for slots, per_slot, _ in plans.values()) <= CPU_GROUP_BUDGET, plans
        else:  # a byte budget per worker: no worker holds more than it
            assert isinstance(group.kv_cache_memory, int), "examples give bytes (fractions depend on the GPU)"
            for models in resolve_placement(group, gpus=len(group.models)).workers:
                assert sum(plans[m][0] * plans[m][1] for m in models) <= group.kv_cache_memory, (models, plans)


def test_the_gpu_example_fits_an_80gb_gpu_per_worker():
    args = load_app_args(REPO / "deploy" / "gpu-cluster.example.yaml")
    group = args.freeze()
    plans = worker_plans(group)
    budget = group.kv_cache_memory
    assert (budget, group.max_model_len) == (40 * 2**30, 8192)
    # target: 32 layers x 2 x 8 kv heads x 128 head dim x 2 bytes = 128 KiB a token, 8192 + 288 columns (530 blocks)
    assert plans["target"] == (38, 131072 * 8480, 8192)
    for spec in group.models:
        slots, per_slot, context = plans[spec.name]
        weights = PUBLISHED[spec.path][1] * 2  # bf16
        # the largest gathered keys + values of one layer: every running request at the full context
        config = _config(spec.path)
        gather = group.max_concurrent_requests * slot_bytes(config, context + SCRATCH_COLUMNS, torch.bfloat16) \
            // config.num_hidden_layers
        assert slots >= group.max_concurrent_requests, (spec.name, slots)  # the slots do not cap the limit
        assert weights + slots * per_slot + gather <= GPU_BYTES - 10 * 10**9, (spec.name, weights, slots, per_slot)


def test_the_one_gpu_example_holds_its_running_requests_in_one_budget_beside_both_models():
    group = load_app_args(REPO / "deploy" / "one-gpu.example.yaml").freeze()
    plans = worker_plans(group)
    # a request: 1.04 GiB in the target + 0.26 GiB in the draft at 8,192 tokens; 40 GiB hold 30
    assert plans["target"][0] == plans["draft"][0] == 30 >= group.max_concurrent_requests
    weights = sum(PUBLISHED[spec.path][1] * 2 for spec in group.models)  # bf16
    kv = sum(slots * per_slot for slots, per_slot, _ in plans.values())
    assert weights + kv <= GPU_BYTES - 10 * 10**9, (weights, kv)


def test_the_gpu_example_at_the_models_full_context_would_hold_two_slots():
    args = load_app_args(REPO / "deploy" / "gpu-cluster.example.yaml")
    group = args.freeze().model_copy(update={"max_model_len": None})
    slots, per_slot, context = worker_plans(group)["target"]
    assert (context, slots) == (131072, 2)
    assert per_slot == 131072 * (131072 + SCRATCH_COLUMNS)  # 16.04 GiB a slot
