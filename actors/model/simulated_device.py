"""A simulated device for benchmarks: each forward takes as long as a modelled accelerator's.

The design puts every model on a device of its own so that they work at the same time; on a
machine without those devices (two shared CPU cores here) that cannot be measured. With
``engine.simulated_device`` a worker runs the REAL forward (every token, every exactness and
equality test stays real), then waits until ``fixed_ms + per_token_ms x tokens`` has passed
since the forward began, releasing the CPU as a host waiting on a device does. When the real
forward took longer, nothing is added. The worker's forward seconds (its metrics and the
response's time split) then measure the modelled device. It is a wrapper around the worker's
backend (:class:`SimulatedBackend`): the engine and the backends know nothing of it.

Models given the same device id (``engine.simulated_device.<model>.device``) share ONE modelled
device, like two models on one GPU: their modelled forwards never overlap in time. Each forward
is queued after the shared device's last one (:class:`SharedTimeline`: the time the device is
busy until, in a file under the temp directory updated under a lock, on the node's monotonic
clock), so the workers of one node share the device clock. It models time-slicing of one device
(first come, first served, whole forwards), not a real GPU's concurrent kernels.

Benchmarking only, off by default; cost models of real pairings are in ``docs/benchmarks.md``
("Simulated devices").
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


class Clock(Protocol):
    """What the simulated device reads and waits on (a fake in the tests)."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` (one clock for every process of the node) and
    ``time.sleep`` (which releases the CPU)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class SharedTimeline:
    """When one shared modelled device is next free, for every worker of the node using it: a
    small file (``<directory>/specserve-simulated-device-<id>``) holding that time, read and
    written under an exclusive lock."""

    def __init__(self, device_id: str, directory: str | None = None):
        if not device_id:
            raise ValueError("a shared simulated device needs a non-empty id")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", device_id)
        self.path = os.path.join(directory or tempfile.gettempdir(), f"specserve-simulated-device-{safe}")

    def reserve(self, earliest: float, seconds: float) -> float:
        """Book the device for ``seconds`` from ``earliest`` or when it is next free, whichever
        is later; returns when the booked forward ends."""
        with open(self.path, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            handle.seek(0)
            text = handle.read().decode().strip()
            free_at = float(text) if text else 0.0
            end = max(earliest, free_at) + seconds
            handle.seek(0)
            handle.truncate()
            handle.write(repr(end).encode())
            handle.flush()
        return end


@dataclass
class SimulatedDevice:
    """One forward costs ``fixed_ms + per_token_ms x tokens`` on the modelled device; with a
    ``timeline`` the device is shared, and a forward also waits for the ones booked before it."""

    fixed_ms: float
    per_token_ms: float
    clock: Clock = field(default_factory=MonotonicClock)
    timeline: SharedTimeline | None = None

    def __post_init__(self) -> None:
        if self.fixed_ms < 0 or self.per_token_ms < 0:
            raise ValueError(f"fixed_ms and per_token_ms must be >= 0, got {self.fixed_ms}, {self.per_token_ms}")

    def forward_seconds(self, tokens: int) -> float:
        """The modelled time of a forward over ``tokens`` new tokens."""
        return (self.fixed_ms + self.per_token_ms * tokens) / 1000.0

    def finish(self, started: float, tokens: int) -> None:
        """Wait (releasing the CPU) until the modelled forward begun at ``started`` (a reading of
        ``clock.now()``) is over; at once when the real one took longer."""
        end = started + self.forward_seconds(tokens)
        if self.timeline is not None:  # a shared device: after the forwards booked before this one
            end = self.timeline.reserve(started, self.forward_seconds(tokens))
        remaining = end - self.clock.now()
        if remaining > 0:
            self.clock.sleep(remaining)


class SimulatedBackend:
    """A backend (the :class:`actors.model.backends.SlotBackend` interface) whose every forward lasts
    as long as on ``simulated``: :meth:`forward` runs the wrapped backend's real forward, then waits
    for the modelled one (:meth:`SimulatedDevice.finish`, over the tokens of every row); every other
    attribute is the wrapped backend's own."""

    def __init__(self, inner: Any, simulated: SimulatedDevice):
        self.inner = inner
        self.simulated = simulated

    def forward(self, rows: Sequence[Any]) -> list[torch.Tensor]:
        """The wrapped backend's logits for ``rows`` (:class:`actors.model.batch.RowWork`), returned
        once the modelled forward over their tokens is over."""
        started = self.simulated.clock.now()
        logits = self.inner.forward(rows)
        self.simulated.finish(started, sum(len(row) for row in rows))
        return logits

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "simulated"):  # not set yet (while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def simulated_device(spec: Any) -> SimulatedDevice | None:
    """The worker's simulated device (``engine.simulated_device``; benchmarks only), or None."""
    args = getattr(spec, "simulated_device", None)
    if args is None:
        return None
    logger.warning("model %s runs on a SIMULATED device: every forward lasts at least %.3g ms + %.3g ms per token "
                   "(engine.simulated_device; for benchmarks only)", spec.name, args.fixed_ms, args.per_token_ms)
    shared = getattr(args, "device", None)
    return SimulatedDevice(args.fixed_ms, args.per_token_ms, timeline=SharedTimeline(shared) if shared else None)


def on_simulated_device(backend: Any, spec: Any) -> Any:
    """``backend``, wrapped so that its forwards last as long as on the model's simulated device
    (:class:`SimulatedBackend`) when ``engine.simulated_device`` names
    one; else ``backend`` itself."""
    device = simulated_device(spec)
    return backend if device is None else SimulatedBackend(backend, device)
