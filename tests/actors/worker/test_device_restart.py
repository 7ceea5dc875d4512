"""A worker whose device breaks is restarted by Ray, and the group serves again (through Ray, fake
models: tests/actors/fake_models.py).

No GPU exists where this runs, so the broken device is a mock: after :meth:`BreakableWorker.break_device`
the fake backend's forwards raise :class:`actors.model.device_health.DeviceBrokenError`, as
:class:`actors.model.backends.SlotBackend` raises it for a CUDA error other than out-of-memory. The
worker then ends its process (the production path, ``os._exit``): the requests in flight on it end
with a retryable error, Ray restarts the actor (a fresh process, a working "device") and requests
complete again, with the same tokens as before.
"""

from __future__ import annotations

import time

import ray

from actors.model.device_health import DeviceBrokenError
from cluster.serving.bringup import start_model_group
from tests.actors.coordination.test_coordinator_reference import _request, _tokens, run_requests
from tests.actors.fake_models import SlowFunctionModelWorker, fake_group_config

RECOVERY_LIMIT_S = 60.0


class BreakableWorker(SlowFunctionModelWorker):
    """A fake worker whose device can be broken on demand (in this process only: a restart heals it)."""

    def _load_backend(self):
        backend = super()._load_backend()
        forward = backend.forward

        def forward_or_fail(rows):
            if getattr(self, "broken", False):
                raise DeviceBrokenError("target: the device failed (RuntimeError: CUDA error: an illegal memory access)")
            return forward(rows)

        backend.forward = forward_or_fail
        return backend

    def break_device(self) -> int:
        """From now on every forward fails as on a broken device; returns this process's id."""
        self.broken = True
        return self.info().pid


def test_a_worker_whose_device_broke_is_restarted_and_the_group_serves_again(ray_session):
    group = start_model_group(fake_group_config(), worker_cls=BreakableWorker)
    try:
        request = _request(3, {"strategy": "sd", "method": "block", "gamma": 3}, max_tokens=12)
        (before,) = run_requests(group, [request])
        assert before[-1].error is None
        target = group.workers["target"]
        broken_pid = ray.get(target.break_device.remote())
        (failed,) = run_requests(group, [request])
        assert failed[-1].error is not None and failed[-1].retryable, failed[-1].error
        started = time.monotonic()
        while True:
            (again,) = run_requests(group, [request])
            if again[-1].error is None:
                break
            assert again[-1].retryable, again[-1].error
            assert time.monotonic() - started < RECOVERY_LIMIT_S, "the worker was not restarted"
            time.sleep(0.5)
        assert ray.get(target.info.remote()).pid != broken_pid  # a new process
        assert _tokens(again) == _tokens(before)
    finally:
        group.shutdown()
