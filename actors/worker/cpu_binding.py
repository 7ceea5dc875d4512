"""Binding a process to CPU cores (``resources.cpu_affinity``, :mod:`cluster.serving.cpu_affinity`).

``os.sched_setaffinity(0, ...)`` binds the calling thread only; a Ray actor's process already runs
many threads when the actor starts, so every thread of the process is bound (Linux
``/proc/self/task``), and threads started later inherit the binding of the thread that starts
them. The torch thread count follows ``resources.torch_threads`` (:func:`torch_thread_count`: a
number, or ``auto``: the cores the process may use once bound).

The count is per thread: OpenMP keeps it in each thread's own state, and a thread that never set
it runs its parallel regions with ``OMP_NUM_THREADS`` threads, which Ray sets to an actor's
``num_cpus`` (1 by default). A Ray actor with concurrency groups runs its calls on executor
threads, not the thread that ran ``__init__``, so a worker's forwards ran on one core while
``torch.get_num_threads()`` (a process-wide answer) still said 2. :func:`set_torch_threads`
remembers the count the process wants and :func:`follow_torch_threads` applies it once in each
thread that runs model work.

Each thread that runs a parallel region also gets a team of OpenMP threads of its own, kept for
its next region. A worker loads its model on the thread that runs ``__init__`` and steps on
another (Ray's), so two teams lived in the process; GNU OpenMP counts every thread of every team,
and with more of them than cores it stops spinning between regions (about 100 spins, then a
futex sleep), so each of a forward's hundreds of short regions woke its helpers from sleep: a
279M bfloat16 decode forward took 47-53 ms on a step thread against 34-37 ms on the thread that
loaded it (2 threads, 2 cores). :func:`release_openmp_team` ends the loading thread's team once
the model is loaded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import torch

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


_wanted_threads: int | None = None  # set_torch_threads's count; None: never set (a GPU worker)
_threads_following: set[int] = set()  # threading.get_ident() of the threads that applied it
_threads_lock = threading.Lock()


def set_torch_threads(count: int) -> None:
    """Use ``count`` torch threads in this process: now in the calling thread, and in every other
    thread when it calls :func:`follow_torch_threads`."""
    global _wanted_threads
    with _threads_lock:
        _wanted_threads = count
        _threads_following.clear()
    follow_torch_threads()


def follow_torch_threads() -> None:
    """Apply :func:`set_torch_threads`'s count in the calling thread (once per thread; nothing when
    it was never set). Call it where a thread starts model work: OpenMP's thread count is the
    calling thread's own setting (see the module docstring)."""
    thread = threading.get_ident()
    if _wanted_threads is None or thread in _threads_following:
        return
    with _threads_lock:
        torch.set_num_threads(_wanted_threads)
        _threads_following.add(thread)


class ForwardThreads:
    """The torch thread count of each CPU forward (``resources.one_thread_below``): ``threads`` for a
    forward whose work (tokens x ``parameters``) reaches ``one_thread_below``, one thread below it.
    A small forward's OpenMP regions are short, so the hand-offs to a helper cost more than its core
    saves, and that core serves Ray, the coordinator and HTTP meanwhile: on the embedded family
    (2 cores), ``sd`` at one client served 190-209 tok/s on two threads and 242-253 on one, ``ar``
    at 16 clients 697-758 on two and 560-667 on one (``specserve bench --mode serve-load``)."""

    def __init__(self, threads: int, parameters: int, one_thread_below: int):
        self.threads = threads
        self.parameters = parameters
        self.one_thread_below = one_thread_below

    def count(self, tokens: int) -> int:
        """The threads of a forward of ``tokens`` tokens."""
        if self.threads <= 1 or not self.parameters or tokens * self.parameters >= self.one_thread_below:
            return self.threads
        return 1

    def apply(self, tokens: int) -> None:
        """Set the calling thread's torch thread count for a forward of ``tokens`` tokens."""
        torch.set_num_threads(self.count(tokens))


#: The OpenMP runtimes whose ``omp_pause_resource_all`` :func:`release_openmp_team` calls.
OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def _loaded_openmp() -> str | None:
    """The path of the OpenMP runtime this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                if any(name in os.path.basename(path) for name in OPENMP_LIBRARIES):
                    return path
    except OSError:
        pass
    return None


def release_openmp_team() -> bool:
    """End the calling thread's OpenMP team (``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0):
    call it on a thread that is done with model work (a worker's loading thread) so that only the
    stepping thread's team stays. False (nothing done) where no OpenMP runtime is loaded or it
    refuses; the next parallel region on this thread would start a new team."""
    import ctypes

    path = _loaded_openmp()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.restype = ctypes.c_int
    return pause(ctypes.c_int(1)) == 0  # 1: omp_pause_soft


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
