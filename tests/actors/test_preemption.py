"""Admission by KV blocks and preemption, on tiny real Llamas in-process: a worker whose pool runs
dry takes back the blocks of a session with no item in the step, which recomputes its context
when it runs again and draws the same tokens; a coordinator whose pools fit about half of its
concurrent requests preempts the newest, and every request completes with the tokens it draws
with a large budget."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoConfig

from actors.coordination.coordinator import Coordinator
from actors.messages import OpenSession, RowSampling, WorkItem
from actors.model.kv_budget import slot_bytes
from actors.model.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from actors.request_schema import GenerationRequest
from actors.worker.model_worker import SCRATCH_COLUMNS, ModelWorker
from benchmarks.served.runners import LocalActorHandle
from cluster.config import ModelSpec, parse_app_args
from tests.actors.fake_models import run_in_process
from tests.conftest import tiny_args_dict
from verifiers.machines.needs import Sample

MAX_MODEL_LEN = 64


def _spec(path) -> ModelSpec:
    return ModelSpec(name="target", path=str(path), role="target", num_gpus=0, num_cpus=0.25, torch_threads=1,
                     resources={})


def _sessions(worker: ModelWorker, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Each prompt's session samples 2 tokens in a step of its own, then the first session 3
    more (its blocks may have been taken back meanwhile) -> the tokens of every session."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        opened = OpenSession(tuple(prompt), RowSampling(temperature=1.0), {"sample": 100 + i})
        outcome = worker.run_step([WorkItem(f"s{i}", Sample("target", (), 2), open=opened)])[0][0]
        assert outcome.error is None, outcome.error
        tokens[f"s{i}"] = outcome.value.tokens[0].tolist()
    outcome = worker.run_step([WorkItem("s0", Sample("target", tuple(tokens["s0"]), 3))])[0][0]
    assert outcome.error is None, outcome.error
    tokens["s0"] += outcome.value.tokens[0].tolist()
    return tokens


def test_a_dry_pool_preempts_an_idle_session_which_recomputes_the_same_tokens(tiny_checkpoints):
    """One slot's blocks (22 of 16 tokens) for six sessions of 60 tokens (4 blocks each): the
    sixth takes the first's blocks; the first, resumed, recomputes its context and samples the
    tokens it samples on a pool that never runs dry."""
    config = AutoConfig.from_pretrained(tiny_checkpoints["target"])
    per_slot = slot_bytes(config, MAX_MODEL_LEN + SCRATCH_COLUMNS, torch.float32)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 200, (58,), generator=generator).tolist() for _ in range(6)]
    threads = torch.get_num_threads()
    try:
        small = ModelWorker(_spec(tiny_checkpoints["target"]), max_model_len=MAX_MODEL_LEN, kv_cache_memory=per_slot,
                            prefix_caching=False)
        large = ModelWorker(_spec(tiny_checkpoints["target"]), max_model_len=MAX_MODEL_LEN, prefix_caching=False)
        assert small.backend.cache.num_blocks == -(-(MAX_MODEL_LEN + SCRATCH_COLUMNS) // DEFAULT_BLOCK_SIZE) == 22
        assert _sessions(small, prompts) == _sessions(large, prompts)
        assert small.engine.preemptions_total >= 1 and large.engine.preemptions_total == 0
        metrics = small.engine.metrics()
        assert metrics["kv_blocks_used"] + metrics["kv_blocks_free"] == 22
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_reaped_idle_session_resumes_with_the_same_tokens(tiny_checkpoints, prefix_caching):
    """A paused (preempted) request's sessions may sit idle past ``session_idle_timeout_s``: the
    reaper frees the slot but parks the session's context and random streams, and its next call
    resumes it (recomputing what no cached prefix holds) with the tokens of a session never reaped."""
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 200, (40,), generator=generator).tolist()
    threads = torch.get_num_threads()
    runs = {}
    try:
        for reap in (False, True):
            worker = ModelWorker(_spec(tiny_checkpoints["target"]), max_model_len=MAX_MODEL_LEN,
                                 prefix_caching=prefix_caching)
            opened = OpenSession(tuple(prompt), RowSampling(temperature=1.0), {"sample": 3})
            first = worker.run_step([WorkItem("s", Sample("target", (), 2), open=opened)])[0][0]
            assert first.error is None, first.error
            tokens = first.value.tokens[0].tolist()
            if reap:
                worker.engine.sessions.idle_timeout_s = 0.0
                assert worker.reap_idle_sessions() == ["s"]
                assert worker.engine.sessions.ids() == [] and worker.engine.sessions.parked() == ["s"]
                assert worker.backend.cache.allocated == frozenset()  # its slot went back
            outcome = worker.run_step([WorkItem("s", Sample("target", tuple(tokens), 3))])[0][0]
            assert outcome.error is None, outcome.error
            assert worker.engine.sessions.ids() == ["s"] and worker.engine.sessions.parked() == []
            runs[reap] = tokens + outcome.value.tokens[0].tolist()
    finally:
        torch.set_num_threads(threads)
    assert len(runs[True]) == 5 and runs[True] == runs[False]


def _serve(tiny_checkpoints, kv_blocks: int | None, requests: list[GenerationRequest]) -> tuple[list[list], int, dict]:
    """Serve ``requests`` at once in-process over workers whose pools hold ``kv_blocks`` blocks
    each (None: no budget) -> (every request's chunks, the coordinator's preemptions, what
    ``GET /v1/status`` shows of the group afterwards)."""
    config = AutoConfig.from_pretrained(tiny_checkpoints["target"])
    budget = None if kv_blocks is None else kv_blocks * PagedKVCache.block_bytes(config, DEFAULT_BLOCK_SIZE, torch.float32)
    args = tiny_args_dict(tiny_checkpoints, strategy="sd", method="token", gamma=3)
    args["limits"]["max_concurrent_requests"] = 32
    args["engine"] = {"overlap": False, "max_model_len": MAX_MODEL_LEN, "goodput_gamma": False,
                      **({} if budget is None else {"kv_cache_memory": budget})}
    group = parse_app_args(args).freeze().model_copy(update={"tokenizer_path": None})
    workers = {m.name: LocalActorHandle(ModelWorker(m, 120.0, max_sessions=32, kv_cache_memory=group.kv_cache_memory,
                                                    max_model_len=MAX_MODEL_LEN))
               for m in group.models if m.name in ("target", "draft")}
    group = group.model_copy(update={"models": tuple(m for m in group.models if m.name in workers)})
    coordinator = Coordinator(workers, group, export_to_ray=False)
    chunks = run_in_process(coordinator, requests, timeout_s=600)
    return chunks, coordinator.scheduler.admission.preemptions, asyncio.run(coordinator.describe())


def test_status_shows_the_blocks_of_every_worker(tiny_checkpoints):
    """One request served over pools of 30 blocks: the group's status shows each worker's blocks
    (used, free: the request's parked prefix counts as free) and no preemption."""
    request = GenerationRequest(request_id="one", prompt_ids=list(range(1, 21)),
                                sampling={"max_tokens": 4, "seed": 1, "temperature": 1.0, "ignore_eos": True})
    (chunks,), preempted, described = _serve(tiny_checkpoints, 30, [request])
    assert chunks[-1].error is None and preempted == described["preemptions"] == 0
    assert {name: sum(counts.values()) for name, counts in described["kv_blocks"].items()} == {"target": 30, "draft": 30}


@pytest.mark.slow
@pytest.mark.parametrize("count", [32])
def test_a_budget_for_half_the_requests_preempts_and_changes_no_token(tiny_checkpoints, count):
    """Pools of 20 blocks for half the requests, and 4 more: that half is admitted at 20 blocks
    each (10 prompt tokens + 288 scratch columns), grows to 21 and does not fit any more, so the
    newest are preempted and resumed later; all complete with the seeded tokens of a run with no
    budget."""
    generator = torch.Generator().manual_seed(9)
    requests = [GenerationRequest(request_id=f"p{i}", prompt_ids=torch.randint(1, 200, (10,), generator=generator).tolist(),
                                  speculation={"strategy": "ar"} if i % 4 == 3 else {"strategy": "sd", "method": "token", "gamma": 3},
                                  sampling={"max_tokens": 20, "seed": i, "temperature": 1.0, "ignore_eos": True})
                for i in range(count)]
    tight, preempted, described = _serve(tiny_checkpoints, count // 2 * 20 + 4, requests)
    roomy, none, _ = _serve(tiny_checkpoints, None, requests)
    assert preempted > 0 and none == 0 and described["preemptions"] == preempted
    for small, large in zip(tight, roomy):
        assert small[-1].error is None and large[-1].error is None, (small[-1].error, large[-1].error)
        tokens = [[t for chunk in chunks for t in chunk.token_ids] for chunks in (small, large)]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 20
