"""actors.worker.cpu_binding: the torch thread count in every thread that steps, and the loading
thread's OpenMP team ended. Each case runs in a fresh interpreter: OpenMP's per-thread state and
its teams are process-wide facts the test process must not carry into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from actors.worker import cpu_binding

pytestmark = pytest.mark.skipif(cpu_binding._loaded_openmp() is None, reason="torch loaded no OpenMP runtime here")


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (``OMP_NUM_THREADS=1``, as Ray sets it for a one-CPU
    actor) and return the JSON object it prints last."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_thread_that_steps_follows_the_count_set_on_the_loading_thread():
    seen = _run("""
        import ctypes, json, threading
        import torch
        from actors.worker import cpu_binding
        openmp = ctypes.CDLL(cpu_binding._loaded_openmp())
        cpu_binding.set_torch_threads(2)
        seen = {"loading thread": openmp.omp_get_max_threads()}
        def step_thread():
            seen["step thread, before"] = openmp.omp_get_max_threads()
            cpu_binding.follow_torch_threads()
            seen["step thread, after"] = openmp.omp_get_max_threads()
        thread = threading.Thread(target=step_thread)
        thread.start(); thread.join()
        print(json.dumps(seen))
    """)
    # OpenMP's count is per thread: a thread that never set it uses OMP_NUM_THREADS (1 here)
    assert seen == {"loading thread": 2, "step thread, before": 1, "step thread, after": 2}


def test_releasing_the_loading_threads_team_ends_its_helper_threads():
    seen = _run("""
        import json, os
        import torch
        from actors.worker import cpu_binding
        cpu_binding.set_torch_threads(2)
        x = torch.arange(1 << 22, dtype=torch.float64)
        def threads():
            return len(os.listdir("/proc/self/task"))
        first = float((x * 3).sum())  # parallel regions: this thread's team has its helper
        with_team = threads()
        released = cpu_binding.release_openmp_team()
        after_release = threads()
        again = float((x * 3).sum())  # a new team, the same result
        print(json.dumps({"with team": with_team, "released": released, "after": after_release,
                          "new team": threads(), "same": first == again}))
    """)
    assert seen["released"] is True
    assert seen["after"] == seen["with team"] - 1  # 2 torch threads: the caller and one helper, ended
    assert seen["new team"] == seen["with team"]
    assert seen["same"] is True


def test_a_forward_under_one_thread_below_runs_on_one_thread():
    rule = cpu_binding.ForwardThreads(threads=2, parameters=12_000_000, one_thread_below=100_000_000)
    assert [rule.count(tokens) for tokens in (1, 5, 8, 9, 16)] == [1, 1, 1, 2, 2]
    assert cpu_binding.ForwardThreads(1, 12_000_000, 100_000_000).count(64) == 1  # torch_threads 1
    assert cpu_binding.ForwardThreads(2, 12_000_000, 0).count(1) == 2  # 0: every forward on torch_threads
    assert cpu_binding.ForwardThreads(2, 0, 100_000_000).count(1) == 2  # size unknown: torch_threads


def test_the_thread_count_does_not_change_a_forwards_logits():
    # The embedded target (its real widths) in a worker with two torch threads: the same batch of
    # rows, once with every forward on one thread and once on two, gives the same logits bit for bit,
    # so resources.one_thread_below never changes a token.
    import torch

    from actors.messages import OpenSession, RowSampling, WorkItem
    from actors.worker.model_worker import ModelWorker
    from cluster.config import ModelSpec
    from models import resolve_model_path
    from verifiers.machines.needs import NextLogits

    threads = torch.get_num_threads()
    spec = ModelSpec(name="target", path=resolve_model_path("embedded:target"), role="target", num_gpus=0,
                     num_cpus=1, torch_threads=2, resources={})
    try:
        worker = ModelWorker(spec, idle_timeout_s=600, max_sessions=8, prefix_caching=False)
        prompts = [[5, 17, 42, 99, 7], [13, 250, 3, 64, 11, 8, 9], [300, 2]]

        def logits(one_thread_below: int, tag: str) -> list:
            worker.engine.forward_threads.one_thread_below = one_thread_below
            items = [WorkItem(f"{tag}{i}", NextLogits("target", ()), open=OpenSession(tuple(p), RowSampling()))
                     for i, p in enumerate(prompts)]
            outcomes, _ = worker.run_step(items)
            assert all(outcome.error is None for outcome in outcomes)
            for item in items:
                worker.release(item.session_id)
            return [outcome.value for outcome in outcomes]

        one, two = logits(10**18, "one"), logits(0, "two")
        assert worker.engine.forward_threads.count(14) == 2
        assert all(torch.equal(a, b) for a, b in zip(one, two))
    finally:
        cpu_binding.set_torch_threads(threads)  # the process's count as the other tests left it
