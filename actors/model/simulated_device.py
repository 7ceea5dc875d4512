"""A simulated device for benchmarks: each forward takes as long as a modelled accelerator's.

The design puts every model on a device of its own so that they work at the same time; on a
machine without those devices (two shared CPU cores here) that cannot be measured. With
``engine.simulated_device`` a worker runs the REAL forward (every token, every exactness and
equality test stays real), then waits until ``fixed_ms + per_token_ms x tokens`` has passed
since the forward began, releasing the CPU as a host waiting on a device does. When the real
forward took longer, nothing is added. The worker's forward seconds (its metrics and the
response's time split) then measure the modelled device.

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
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Protocol


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
