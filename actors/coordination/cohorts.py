"""Cohorts: the requests that step together. With two cohorts, each runs its own step loop: while
the target verifies one cohort, the draft already proposes for the other (Ray runs each worker's
calls in order, so the two loops interleave on every worker without changing any request's own
calls or draws)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.coordination.request_state import RequestState


@dataclass
class Cohort:
    """Requests that step together, and the step mode the policy last decided for them
    (:class:`actors.coordination.policy.StepPolicy`)."""

    index: int
    running: list[RequestState] = field(default_factory=list)
    mode: str = "any"  # the step mode last decided for the whole cohort (StepCosts.mode)
    mode_steps: int = 0  # steps in a row in that mode (the other is probed after probe_every)
    probe_steps_left: int = 0  # steps a probe of the other mode still runs
    probe_every: int = 16  # steps in a row before the next probe (policy.COHORT_PROBE_EVERY, doubled while probes confirm)
    probed_from: str | None = None  # the faster mode when the probe going on began
    blocks_chosen: int = 0  # speculative steps whose block the policy chose (every EXPLORE_EVERY-th is a neighbour)
    alternate_mode: str = "any"  # the alternating ensembles' mode last decided (gamma auto)
    alternate_steps: int = 0  # steps in a row in it

    def stepping(self) -> list[RequestState]:
        """The requests that make a decoding iteration this step (not prefilling a prompt)."""
        return [request for request in self.running if not request.prefilling]

    def committed(self) -> int:
        """Tokens the cohort's requests have committed so far."""
        return sum(len(request.machine.committed) for request in self.running)


def should_admit_into(cohort: Cohort, cohorts: list[Cohort]) -> bool:
    """Whether ``cohort`` may take the next waiting request: it is not the larger one (the
    cohorts stay balanced)."""
    return len(cohort.running) <= min(len(c.running) for c in cohorts)
