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
from collections.abc import Iterable

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
