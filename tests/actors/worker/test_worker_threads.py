"""A CPU worker's OpenMP environment (actors/worker/cpu_binding.py ``worker_thread_env``, set by
cluster/serving/bringup.py in the worker's Ray ``runtime_env``): torch's threads sleep when a parallel
region ends, unless the operator's environment says how they wait."""

from __future__ import annotations

import os

import pytest

from actors.worker.cpu_binding import OMP_WAIT_VARIABLES, WORKER_OMP_ENV, worker_thread_env


def test_a_cpu_worker_waits_passively_unless_the_environment_says_otherwise():
    assert worker_thread_env({}) == WORKER_OMP_ENV == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert worker_thread_env({"PATH": "/bin", "OMP_WAIT_POLICY": ""}) == WORKER_OMP_ENV  # empty: unset
    for name in OMP_WAIT_VARIABLES:
        assert worker_thread_env({name: "1"}) == {}


def _worker_environment(handle, names: tuple[str, ...]) -> dict[str, str | None]:
    import ray

    return ray.get(handle.__ray_call__.remote(lambda worker: {name: os.environ.get(name) for name in names}))


@pytest.mark.skipif(any(os.environ.get(name) for name in OMP_WAIT_VARIABLES), reason="the environment sets the wait")
def test_started_cpu_workers_have_it_beside_the_jobs_environment(ray_session):
    """Every worker of a group started on CPU runs with :data:`WORKER_OMP_ENV`, and the job's own
    ``runtime_env`` variables (tests/conftest.py) still reach it (Ray merges the two)."""
    from cluster.serving.bringup import start_model_group
    from tests.actors.fake_models import FunctionModelWorker, fake_group_config

    group = start_model_group(fake_group_config(), worker_cls=FunctionModelWorker)
    try:
        for handle in group.actors:
            env = _worker_environment(handle, ("OMP_WAIT_POLICY", "HF_HUB_OFFLINE"))
            assert env == {"OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    finally:
        group.shutdown()
