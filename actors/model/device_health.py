"""Which failures of a forward are the device's own, and the lean path's failure policy.

A forward can fail for its request (a bad row), for a moment (the device ran out of memory: the
next forward may fit), or because the device itself is broken: a CUDA error other than
out-of-memory (an illegal memory access, a device-side assert, a lost device) leaves the CUDA
context unusable, and every later forward on it fails too. :func:`is_device_broken` tells the last
kind apart; the backend raises :class:`DeviceBrokenError` for it, which no per-request isolation
catches (:mod:`actors.worker.isolation`), and the worker ends its process so that Ray restarts it
on a fresh context (:meth:`actors.worker.model_worker.ModelWorker.device_broken`); the coordinator
fails the requests it held retryably, as for any worker that died.

A lean forward that fails otherwise is logged, counted (``lean_forward_failures_total``, in
``/metrics`` as ``specserve_worker_lean_forward_failures_total``) and that forward is run again by
the model's own decoder (the same columns are rewritten); the next forward tries the lean path
again. Only :data:`LEAN_FAILURES_IN_A_ROW` failures in a row drop it for good (logged as an error).
"""

from __future__ import annotations

import torch

#: Consecutive failed lean forwards after which a backend runs the model's own decoder for good.
LEAN_FAILURES_IN_A_ROW = 3

#: Words of a CUDA runtime/library error message (torch before ``torch.AcceleratorError`` raised a
#: plain RuntimeError for them).
_DEVICE_ERROR_MARKERS = ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "CUDNN_STATUS", "device-side assert",
                         "NCCL error", "CUDA driver error")


class DeviceBrokenError(RuntimeError):
    """The model's device failed in a way no later forward recovers from (see the module doc)."""


def is_device_broken(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a device error other than running out of memory."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DeviceBrokenError):
            return True
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
            return False
        accelerator_error = getattr(torch, "AcceleratorError", None)
        if accelerator_error is not None and isinstance(error, accelerator_error):
            return True
        if isinstance(error, RuntimeError) and any(marker in str(error) for marker in _DEVICE_ERROR_MARKERS):
            return True
        error = error.__cause__ or error.__context__
    return False


def raise_if_device_broken(error: BaseException, name: str) -> None:
    """Raise :class:`DeviceBrokenError` (from ``error``) when ``error`` is the device's (``name``: the model)."""
    if isinstance(error, DeviceBrokenError):
        raise error
    if is_device_broken(error):
        raise DeviceBrokenError(f"{name}: the device failed ({type(error).__name__}: {error})") from error


class LeanFailures:
    """The lean path's failures on one backend: a total (for ``/metrics``) and, per path (the
    one-row forward, the batched one), the run of consecutive failures."""

    def __init__(self) -> None:
        self.total = 0
        self.in_a_row: dict[str, int] = {}

    def failed(self, path: str) -> bool:
        """Count one failure of ``path``; True when that path should now be dropped for good."""
        self.total += 1
        self.in_a_row[path] = self.in_a_row.get(path, 0) + 1
        return self.in_a_row[path] >= LEAN_FAILURES_IN_A_ROW

    def succeeded(self, path: str) -> None:
        """A lean forward of ``path`` ran: its run of failures ends."""
        self.in_a_row[path] = 0
