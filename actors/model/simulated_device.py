"""A simulated device for benchmarks: each forward takes as long as a modelled accelerator's.

The design puts every model on a device of its own so that they work at the same time; on a
machine without those devices (two shared CPU cores here) that cannot be measured. With
``engine.simulated_device`` a worker runs the REAL forward (every token, every exactness and
equality test stays real), then waits until ``fixed_ms + per_token_ms x tokens`` has passed
since the forward began, releasing the CPU as a host waiting on a device does. When the real
forward took longer, nothing is added. The worker's forward seconds (its metrics and the
response's time split) then measure the modelled device.

Benchmarking only, off by default; cost models of real pairings are in ``docs/benchmarks.md``
("Simulated devices").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol


class Clock(Protocol):
    """What the simulated device reads and waits on (a fake in the tests)."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.perf_counter`` and ``time.sleep`` (which releases the CPU)."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass
class SimulatedDevice:
    """One forward costs ``fixed_ms + per_token_ms x tokens`` on the modelled device."""

    fixed_ms: float
    per_token_ms: float
    clock: Clock = field(default_factory=MonotonicClock)

    def __post_init__(self) -> None:
        if self.fixed_ms < 0 or self.per_token_ms < 0:
            raise ValueError(f"fixed_ms and per_token_ms must be >= 0, got {self.fixed_ms}, {self.per_token_ms}")

    def forward_seconds(self, tokens: int) -> float:
        """The modelled time of a forward over ``tokens`` new tokens."""
        return (self.fixed_ms + self.per_token_ms * tokens) / 1000.0

    def finish(self, started: float, tokens: int) -> None:
        """Wait (releasing the CPU) until the modelled forward begun at ``started`` (a reading of
        ``clock.now()``) is over; at once when the real one took longer."""
        remaining = started + self.forward_seconds(tokens) - self.clock.now()
        if remaining > 0:
            self.clock.sleep(remaining)
