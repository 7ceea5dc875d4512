"""One measured generation (a case on a prompt) and how it is built from the system's stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from actors.request_schema import RequestStats


@dataclass(frozen=True)
class RunRecord:
    """The measurements of one case on one prompt.

    ``wall_s`` is measured by the harness around the whole call (submission to the last
    token), the same way for every mode, and ``tokens_per_second`` is derived from it.
    ``target_calls`` are forward calls of the verifying model(s); for the ensembles, the
    forward calls of every member (``model_calls`` has the per-model split).
    The time split is the sum over the request's iterations (``iterations`` of them).
    ``draft_lengths`` are the tokens drafted per iteration (gamma, or the choices of ``auto``).
    """

    case: str
    prompt_id: str
    prompt_kind: str
    repeat: int
    seed: int
    completion_tokens: int
    wall_s: float
    target_calls: int
    iterations: int
    accepted_lengths: list[int] = field(default_factory=list)
    model_calls: dict[str, int] = field(default_factory=dict)
    time_draft_s: float = 0.0
    time_target_s: float = 0.0
    time_verify_s: float = 0.0
    time_coordination_s: float = 0.0
    bytes_moved: int = 0
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def block_efficiency(self) -> float:
        """Generated tokens per target call (per verifying call for the ensembles)."""
        return self.completion_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def mean_accepted(self) -> float | None:
        """Mean accepted draft tokens per iteration (None for strategies without drafts)."""
        if not self.accepted_lengths:
            return None
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def mean_draft_length(self) -> float | None:
        """Mean tokens drafted per iteration (None for strategies without drafts)."""
        if not self.draft_lengths:
            return None
        return sum(self.draft_lengths) / len(self.draft_lengths)

    def to_dict(self) -> dict:
        record = asdict(self)
        record["tokens_per_second"] = self.tokens_per_second
        record["block_efficiency"] = self.block_efficiency
        record["mean_accepted"] = self.mean_accepted
        record["mean_draft_length"] = self.mean_draft_length
        return record


def record_from_stats(
    *, case: str, prompt_id: str, prompt_kind: str, repeat: int, seed: int, wall_s: float,
    num_tokens: int, stats: RequestStats,
) -> RunRecord:
    """A record from the coordinator's final :class:`actors.request_schema.RequestStats`."""
    iterations = len(stats.accepted_lengths) or stats.target_calls
    return RunRecord(
        case=case,
        prompt_id=prompt_id,
        prompt_kind=prompt_kind,
        repeat=repeat,
        seed=seed,
        completion_tokens=num_tokens,
        wall_s=wall_s,
        target_calls=stats.target_calls,
        iterations=iterations,
        accepted_lengths=list(stats.accepted_lengths),
        model_calls=dict(stats.model_calls),
        time_draft_s=stats.time_draft_s,
        time_target_s=stats.time_target_s,
        time_verify_s=stats.time_verify_s,
        time_coordination_s=stats.time_coordination_s,
        bytes_moved=stats.bytes_moved,
        draft_lengths=list(stats.draft_lengths),
    )
