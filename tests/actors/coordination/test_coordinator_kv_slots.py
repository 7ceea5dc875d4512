"""Admission by free KV blocks, through Ray on tiny real Llamas: workers whose
``engine.kv_cache_memory`` holds the blocks of two and a half whole slots each make the
coordinator run as many requests as their blocks fit (two here; ``limits.max_concurrent_requests``
is 16); six concurrent requests all finish (the others wait, none fails for a full cache),
``/v1/status`` shows the blocks, and a request past ``engine.max_model_len`` gets a 400 naming it."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch
from transformers import AutoConfig

from actors.request_schema import GenerationRequest, InvalidRequestError
from actors.model.kv_budget import slot_bytes
from actors.worker.model_worker import SCRATCH_COLUMNS
from cluster.serving.bringup import start_model_group

MAX_MODEL_LEN = 64
SLOTS = 2
PROMPTS = [[5, 17, 42, 99, 7, 13, 25, 3, 64, 11], [8, 1, 30, 30, 2, 9], [40, 41, 42]]


@pytest.fixture(scope="module")
def slot_group(ray_session, tiny_checkpoints):
    config = AutoConfig.from_pretrained(tiny_checkpoints["target"])
    per_slot = slot_bytes(config, MAX_MODEL_LEN + SCRATCH_COLUMNS, torch.float32)  # the draft has the same shape
    args = {
        "models": {"target": {"path": str(tiny_checkpoints["target"]), "role": "target"},
                   "draft": {"path": str(tiny_checkpoints["draft"]), "role": "draft"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": 3},
        "resources": {"gpus_per_model": 0, "cpus_per_model": 0.25, "torch_threads": 1},
        "limits": {"max_concurrent_requests": 16, "session_idle_timeout_s": 120},
        "engine": {"kv_cache_memory": SLOTS * per_slot + per_slot // 2, "max_model_len": MAX_MODEL_LEN,
                   "overlap": False},
    }
    group = start_model_group(args)
    yield group
    group.shutdown()


def _request(index: int, prompt: list[int], max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(request_id=f"kv-{index}", prompt_ids=prompt,
                             sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})


async def _collect(coordinator, request):
    return [await ref async for ref in coordinator.generate.options(num_returns="streaming").remote(request)]


def test_workers_report_their_blocks(slot_group):
    described = ray.get(slot_group.coordinator.describe.remote())
    assert described["kv_slots"] == {"target": 36, "draft": 36}  # sessions (bringup.worker_sessions)
    assert described["max_running"] == 16
    blocks = -(-(MAX_MODEL_LEN + SCRATCH_COLUMNS) // 16) * SLOTS + -(-(MAX_MODEL_LEN + SCRATCH_COLUMNS) // 16) // 2
    assert {name: sum(counts.values()) for name, counts in described["kv_blocks"].items()} == {"target": blocks,
                                                                                              "draft": blocks}
    assert described["preemptions"] == 0
    assert {info["max_context"] for info in described["models"].values()} == {MAX_MODEL_LEN}


def test_requests_beyond_the_free_slots_wait_and_all_finish(slot_group):
    requests = [_request(i, PROMPTS[i % len(PROMPTS)]) for i in range(6)]

    async def run_all():
        return await asyncio.gather(*(_collect(slot_group.coordinator, r) for r in requests))

    results = asyncio.run(run_all())
    outputs = []
    for chunks in results:
        assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
        outputs.append([t for chunk in chunks for t in chunk.token_ids])
    assert all(len(tokens) == 12 for tokens in outputs)
    for i in range(len(PROMPTS)):  # the same prompt at temperature 0: the same greedy tokens
        assert outputs[i] == outputs[i + len(PROMPTS)]
    # The scheduler drops a finished request from its running list on its next loop, after the
    # last chunk went out.
    deadline = time.monotonic() + 20
    while (running := ray.get(slot_group.coordinator.engine_stats.remote())["running"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running == 0


def test_a_request_past_max_model_len_is_refused_naming_it(slot_group):
    request = _request(0, PROMPTS[0], max_tokens=MAX_MODEL_LEN - len(PROMPTS[0]) + 1)
    with pytest.raises(InvalidRequestError) as error:
        ray.get(slot_group.coordinator.validate.remote(request))
    assert error.value.field == "max_tokens"
    assert f"max_model_len ({MAX_MODEL_LEN})" in error.value.message
