"""A broken device restarts its worker; a failed lean forward is counted in the worker's metrics.

No GPU exists where these tests run, so the CUDA errors are mocks: the lean decoder (or the whole
forward) is replaced by one that raises the RuntimeError torch raises for an illegal memory access,
and the process exit the worker takes then (``model_worker._exit_process``, ``os._exit`` in
production) is replaced by a recorder. Out-of-memory is not a broken device: that forward is
retried on the model's own decoder, as any failed lean forward.
"""

from __future__ import annotations

import pytest
import torch

from actors.messages import OpenSession, RowSampling, WorkItem
from actors.model.device_health import DeviceBrokenError, is_device_broken
from actors.worker import model_worker
from actors.worker.model_worker import DEVICE_BROKEN_EXIT_STATUS, ModelWorker
from cluster.config import ModelSpec
from verifiers.machines.needs import NextLogits

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"
PROMPT = (5, 17, 42, 99, 7)


class _Exited(BaseException):
    """What the replaced process exit raises (so the test sees the call and the step stops)."""


@pytest.fixture()
def worker(tiny_checkpoints, monkeypatch):
    threads = torch.get_num_threads()
    exits: list[int] = []

    def exit_process(status: int) -> None:
        exits.append(status)
        raise _Exited(status)

    monkeypatch.setattr(model_worker, "_exit_process", exit_process)
    spec = ModelSpec(name="target", path=str(tiny_checkpoints["target"]), role="target",
                     num_gpus=0, num_cpus=0.25, torch_threads=1, resources={})
    worker = ModelWorker(spec, idle_timeout_s=600, max_sessions=4)
    worker.exits = exits
    yield worker
    torch.set_num_threads(threads)


def _items(*session_ids: str) -> list[WorkItem]:
    return [WorkItem(session_id, NextLogits("target", ()), open=OpenSession(PROMPT, RowSampling(), {}))
            for session_id in session_ids]


def _lean_raising(worker, monkeypatch, error: Exception) -> None:
    """The worker's lean decoder call raises ``error`` (a mock: no device to break here)."""
    lean = worker.backend.lean

    def raising(self, *args):
        raise error

    monkeypatch.setattr(type(lean), "__call__", raising)


@pytest.mark.parametrize(("error", "broken"), [
    (RuntimeError(ILLEGAL_ACCESS), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (torch.AcceleratorError("illegal instruction"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("shape mismatch"), False),
    (ValueError("bad row"), False),
])
def test_only_device_errors_other_than_out_of_memory_break_the_device(error, broken):
    assert is_device_broken(error) is broken
    wrapped = RuntimeError("the forward failed")
    wrapped.__cause__ = error
    assert is_device_broken(wrapped) is broken


def test_a_broken_device_ends_the_worker_process_instead_of_failing_each_request(worker, monkeypatch):
    """A mocked illegal memory access in the lean decoder: not retried on the model's own decoder,
    not reported per request (every later forward would fail too): the worker ends its process with
    DEVICE_BROKEN_EXIT_STATUS, which Ray restarts (``max_restarts``)."""
    _lean_raising(worker, monkeypatch, RuntimeError(ILLEGAL_ACCESS))
    with pytest.raises(_Exited):
        worker.run_step(_items("a", "b"))
    assert worker.exits == [DEVICE_BROKEN_EXIT_STATUS]
    assert worker.backend.lean is not None and worker.backend.lean_failures.total == 0


def test_the_engine_raises_a_broken_device_through_when_no_worker_handles_it(worker, monkeypatch):
    _lean_raising(worker, monkeypatch, RuntimeError(ILLEGAL_ACCESS))
    worker.engine.on_device_broken = None
    with pytest.raises(DeviceBrokenError, match="illegal memory access"):
        worker.engine.run_step(_items("a"))
    assert worker.exits == []


def test_an_out_of_memory_lean_forward_is_served_by_the_own_decoder_and_counted_in_metrics(worker, monkeypatch):
    """A mocked CUDA out-of-memory in the lean decoder: the step is served (the model's own
    decoder), the worker lives on, and ``lean_forward_failures_total`` counts it for /metrics."""
    expected, _ = worker.run_step(_items("x"))
    worker.release("x")
    _lean_raising(worker, monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    outcomes, _ = worker.run_step(_items("y"))
    assert outcomes[0].error is None and worker.exits == []
    torch.testing.assert_close(outcomes[0].value, expected[0].value, atol=1e-5, rtol=0)
    # the one-row forward (a prompt alone) failed, then the batched lean forward: two, each logged
    assert worker.metrics()["lean_forward_failures_total"] == 2
    assert worker.backend.lean is not None  # tried again on the next forward


def test_a_device_error_after_the_forward_ends_the_worker_process_too(worker, monkeypatch):
    """CUDA reports errors asynchronously: an illegal access often surfaces at the logits' host copy
    (mocked here), after the forward returned. Still the device's, not the requests': the worker exits."""
    from actors.worker import step

    def failing_copy(logits):
        raise RuntimeError(ILLEGAL_ACCESS)

    monkeypatch.setattr(step, "to_host", failing_copy)
    with pytest.raises(_Exited):
        worker.run_step(_items("a", "b"))
    assert worker.exits == [DEVICE_BROKEN_EXIT_STATUS]
