"""Binding a process to CPU cores (``resources.cpu_affinity``, :mod:`cluster.serving.cpu_affinity`).

``os.sched_setaffinity(0, ...)`` binds the calling thread only; a Ray actor's process already runs
many threads when the actor starts, so every thread of the process is bound (Linux
``/proc/self/task``), and threads started later inherit the binding of the thread that starts
them. The torch thread count follows ``resources.torch_threads`` (:func:`torch_thread_count`: a
number, or ``auto``: the cores the process may use once bound).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

logger = logging.getLogger(__name__)


def current_cores() -> tuple[int, ...]:
    """The cores this thread may run on (empty where the platform does not say)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


def torch_thread_count(setting: int | str | None) -> int:
    """``resources.torch_threads`` as a thread count: a number as given (at least 1); ``"auto"``: the
    cores in this process's affinity mask (call it after :func:`bind_process`), or ``os.cpu_count()``
    where the platform does not say."""
    if setting == "auto":
        return len(current_cores()) or os.cpu_count() or 1
    return max(1, int(setting or 1))


#: The OpenMP environment of a CPU worker's process (:func:`worker_thread_env`): torch's threads
#: sleep at once when a parallel region ends instead of spinning (libgomp's default). On a host whose
#: cores the worker shares (the HTTP proxy, the coordinator, the clients, other programs), a spinning
#: thread holds a core the thread it waits for needs: the 279M bfloat16 decode forward at 2 threads
#: took 380-2,600 ms under a neighbour's load against 70-190 ms passive (``python -m
#: benchmarks.peers.real_size``'s engine, one process at a time, interleaved).
WORKER_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
#: Variables that, set in the environment, leave the OpenMP wait to the operator.
OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def worker_thread_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables a CPU worker's process starts with (read by OpenMP when torch loads,
    so they go in its Ray ``runtime_env``): :data:`WORKER_OMP_ENV`, or none where ``environ`` sets any
    of :data:`OMP_WAIT_VARIABLES`."""
    if any(environ.get(name) for name in OMP_WAIT_VARIABLES):
        return {}
    return dict(WORKER_OMP_ENV)


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: this thread only


def bind_process(cores: Iterable[int], what: str) -> tuple[int, ...] | None:
    """Bind every thread of this process to ``cores``; the cores it then runs on, or None (a warning
    naming ``what``) where binding is unavailable or refused (a core that does not exist, a
    platform without affinity): the process then runs as before."""
    wanted = set(cores)
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("%s: CPU binding to cores %s is unavailable on this platform; not bound", what, sorted(wanted))
        return None
    try:
        os.sched_setaffinity(0, wanted)
    except (OSError, ValueError) as error:
        logger.warning("%s: could not bind to cores %s (%s); not bound", what, sorted(wanted), error)
        return None
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError:
            pass  # a thread that ended meanwhile
    bound = current_cores()
    logger.info("%s (pid %d): bound to cores %s", what, os.getpid(), list(bound))
    return bound
