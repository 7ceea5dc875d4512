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
