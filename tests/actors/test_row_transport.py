"""Draft rows between workers over Ray Direct Transport (actors/worker/row_transport.py,
actors/coordination/row_transport.py): held and attached rows equal the payloads' own, the
choice of transport, and through Ray: seeded tokens identical over Gloo and the object store,
the object store when the collective group cannot be created."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors.coordination.row_transport import RowTransport, choose_backend
from actors.coordination.worker_calls import Placed, WorkerCalls
from actors.messages import ItemOutcome, WorkItem
from actors.worker.row_transport import MAX_HELD, HeldRows, attach_rows, hold_rows, rows_nbytes
from tests.actors.fake_models import FunctionModelWorker
from verifiers.machines.needs import Sample, Sampled, ScoreVerify


def _payloads() -> list:
    generator = torch.Generator().manual_seed(0)
    return [
        Sampled(torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 11, generator=generator)),
        ItemOutcome(error="failed"),  # a failed item's payload
        Sampled(torch.tensor([[4, 5], [6, 7]]), torch.randn(2, 2, 11, generator=generator)),
        Sampled(torch.tensor([[8]])),  # no logits asked for
        Sampled(torch.tensor([[9]]), torch.randn(1, 1, 11, dtype=torch.float64, generator=generator)),  # another dtype
    ]


def test_held_rows_come_back_identical():
    payloads = _payloads()
    kept, held = hold_rows(payloads)
    layout, rows = held
    assert [place is None for place in layout] == [False, True, False, True, True]
    assert kept[0].logits is None and kept[2].logits is None and kept[4].logits is payloads[4].logits
    assert rows.shape == (3 * 11 + 4 * 11,) and rows.dtype == torch.float32
    assert rows_nbytes(held) == rows.numel() * 4
    restored = attach_rows(kept, held)
    for before, after in zip(payloads, restored):
        if isinstance(before, Sampled) and before.logits is not None:
            assert after.logits.dtype == before.logits.dtype and torch.equal(after.logits, before.logits)
            assert torch.equal(after.tokens, before.tokens)
        else:
            assert after is before


def test_nothing_held_moves_nothing_and_a_mismatch_is_an_error():
    kept, held = hold_rows([Sampled(torch.tensor([[1]]))])
    assert held[0] == [] and held[1].numel() == 0
    assert attach_rows(kept, held) == kept
    with pytest.raises(ValueError, match="held rows for 5 payloads"):
        attach_rows([1], hold_rows(_payloads())[1])


def test_held_rows_are_taken_once_and_bounded():
    store = HeldRows()
    for index in range(MAX_HELD + 2):
        store.keep(f"k{index}", hold_rows(_payloads())[1])
    assert store.take("k0")[0] == []  # the oldest were dropped
    assert store.take(f"k{MAX_HELD + 1}")[1].numel() > 0 and store.taken == 1
    assert store.take(f"k{MAX_HELD + 1}")[0] == []


def test_choose_backend():
    assert choose_backend("gloo", ["cpu", "cpu"]) == "gloo"
    assert choose_backend("nccl", ["cuda", "cuda"]) == "nccl"
    assert choose_backend("nccl", ["cuda", "cpu"]) is None
    assert choose_backend("auto", ["cuda", "cuda"]) == "nccl"
    assert choose_backend("auto", ["cpu", "cpu"]) is None
    assert choose_backend("object_store", ["cuda", "cuda"]) is None
    with pytest.raises(ValueError, match="engine.row_transport"):
        RowTransport("shm")


def _placed(model: str, need, source=None) -> Placed:
    return Placed(request=None, need_index=0, item=WorkItem(session_id="s", need=need, proposal_source=source))


def test_only_proposals_read_by_workers_of_their_own_go_over_rdt():
    calls = WorkerCalls({"draft": object(), "target": object(), "member": object()})
    calls.transport.backend = "gloo"
    sample, verify = Sample(model="draft", append=(), count=4), ScoreVerify(model="target", append=(), draft_need=0, method="block")
    placed = {"draft": [[_placed("draft", sample)], []], "target": [[], [_placed("target", verify, ("draft", 0))]],
              "member": [[], []]}
    assert calls.rows_over_rdt(placed) == {"draft"}
    calls.hosts["target"] = "worker0"  # a host reads the payloads whole
    assert calls.rows_over_rdt(placed) == set()
    calls.hosts["target"] = None
    calls.transport.backend = None
    assert calls.rows_over_rdt(placed) == set()


# ---------------------------------------------------------------------------------- through Ray
class BrokenRowsWorker(FunctionModelWorker):
    """A fake worker whose held rows cannot be handed over (a transfer that fails)."""

    def take_rows(self, key: str):
        raise RuntimeError("no rows here")


def _group(row_transport: str):
    from cluster.serving.bringup import start_model_group
    from tests.actors.fake_models import FunctionModelWorker, fake_group_config

    config = fake_group_config(overlap=False, burst_ms=0.0).model_copy(update={"row_transport": row_transport})
    return start_model_group(config, worker_cls=FunctionModelWorker)


def test_seeded_tokens_are_identical_over_gloo_and_the_object_store(ray_session):
    import ray

    from tests.actors.coordination.test_coordinator_reference import _request, _tokens, run_requests

    requests = [_request(seed, {"strategy": "sd", "method": method, "gamma": 4}, max_tokens=20)
                for seed in range(6) for method in ("token", "block")]
    tokens = {}
    for mode in ("object_store", "gloo"):
        group = _group(mode)
        try:
            tokens[mode] = [_tokens(chunks) for chunks in run_requests(group, requests)]
            taken = ray.get(group.workers["draft"].engine_stats.remote())["rows_taken"]
        finally:
            group.shutdown()
        assert (taken > 0) == (mode == "gloo"), (mode, taken)
    assert tokens["gloo"] == tokens["object_store"]


def test_a_group_that_cannot_be_created_falls_back_to_the_object_store(ray_session):
    import ray
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    @ray.remote(num_cpus=0.1, enable_tensor_transport=True)
    class Worker:
        def info(self):
            from actors.messages import WorkerInfo

            return WorkerInfo(name="w", role="target", vocab_size=1, max_context=1, device="cpu")

    workers = {"draft": Worker.remote(), "target": Worker.remote()}
    taken = create_collective_group(list(workers.values()), backend="torch_gloo")  # one group per backend per actor
    try:
        transport = RowTransport("gloo")
        asyncio.run(transport.prepare(workers, {"draft": None, "target": None}))
        assert not transport.active and transport.counters.fallbacks == 1
        calls = WorkerCalls(workers, transport)
        placed = {"draft": [[_placed("draft", Sample(model="draft", append=(), count=4))], []],
                  "target": [[], [_placed("target", ScoreVerify(model="target", append=(), draft_need=0, method="block"), ("draft", 0))]]}
        assert calls.rows_over_rdt(placed) == set()
    finally:
        destroy_collective_group(taken)
        for handle in workers.values():
            ray.kill(handle)


def test_a_transfer_that_fails_fails_its_step_retryably_then_rows_go_through_the_object_store(ray_session):
    import ray

    from cluster.serving.bringup import start_model_group
    from tests.actors.coordination.test_coordinator_reference import _request, _tokens, run_requests
    from tests.actors.fake_models import fake_group_config

    config = fake_group_config(overlap=False, burst_ms=0.0).model_copy(update={"row_transport": "gloo"})
    group = start_model_group(config, worker_cls=BrokenRowsWorker)
    try:
        speculation = {"strategy": "sd", "method": "block", "gamma": 4}
        (first,) = run_requests(group, [_request(0, speculation, max_tokens=12)])
        assert first[-1].error is not None and first[-1].retryable and "could not be moved" in first[-1].error
        stats = ray.get(group.coordinator.engine_stats.remote())
        assert stats["row_transport"] == "object_store" and stats["row_fallbacks"] == 1
        (again,) = run_requests(group, [_request(0, speculation, max_tokens=12)])
        assert len(_tokens(again)) == 12  # served again, over the object store
    finally:
        group.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_rows_move_over_nccl_between_gpu_workers(ray_session):
    import ray
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    @ray.remote(num_gpus=1, enable_tensor_transport=True)
    class GpuWorker:
        def __init__(self):
            self.store = HeldRows()

        def hold(self, key: str) -> list:
            kept, held = hold_rows(_payloads(), "cuda")
            self.store.keep(key, held)
            return kept

        def take_rows(self, key: str):
            return self.store.take(key)

        def equal(self, kept: list, held) -> bool:
            restored = attach_rows(kept, held)
            return all(torch.equal(a.logits, b.logits) for a, b in zip(restored, _payloads())
                       if isinstance(a, Sampled) and a.logits is not None)

    draft, target = GpuWorker.remote(), GpuWorker.remote()
    group = create_collective_group([draft, target], backend="nccl")
    try:
        kept = draft.hold.remote("k")
        assert ray.get(target.equal.remote(kept, draft.take_rows.options(tensor_transport="nccl").remote("k")))
    finally:
        destroy_collective_group(group)
