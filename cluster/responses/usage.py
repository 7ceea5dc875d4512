"""Usage and the ``speculation`` block of responses: one choice's chunks collected
(:class:`CompletionAccumulator`), the usage of all choices (:func:`total_usage`) and their
merged stats (:func:`merged_speculation`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actors.request_schema import GenerationChunk, RequestStats, TokenLogprob


def usage_block(stats: RequestStats | None) -> dict[str, Any]:
    """OpenAI ``usage`` from the request's stats (with ``completion_tokens_details`` when a
    prediction drafted: :func:`prediction_details`)."""
    prompt_tokens = stats.prompt_tokens if stats else 0
    completion_tokens = stats.completion_tokens if stats else 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    details = prediction_details([stats] if stats else [])
    if details is not None:
        usage["completion_tokens_details"] = details
    return usage


def prediction_details(stats: Sequence[RequestStats]) -> dict[str, int] | None:
    """OpenAI's ``completion_tokens_details`` of predicted outputs: the predicted tokens verification
    accepted (``accepted_prediction_tokens``) and rejected (``rejected_prediction_tokens``); None
    when no choice had a prediction drafted."""
    used = [s for s in stats if "prediction" in s.proposed_tokens]
    if not used:
        return None
    accepted = sum(s.accepted_proposed["prediction"] for s in used)
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(s.proposed_tokens["prediction"] for s in used) - accepted}


def speculation_block(stats: RequestStats | None) -> dict[str, Any] | None:
    """The ``speculation`` extension block: every RequestStats field except the token counts."""
    if stats is None:
        return None
    return stats.model_dump(exclude={"prompt_tokens", "completion_tokens"})


class CompletionAccumulator:
    """Collects one choice's chunk stream into its text, token ids, log-probabilities, finish
    reason and stats. ``prefix`` (the echoed prompt) starts the text; ``counts_prompt``: this
    choice's prompt tokens count in the usage (the first sample of each prompt)."""

    def __init__(self, index: int = 0, prefix: str = "", counts_prompt: bool = True) -> None:
        self.index = index
        self.prefix = prefix
        self.counts_prompt = counts_prompt
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_logprobs = chunk.prompt_token_ids, chunk.prompt_logprobs
        self.text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(chunk.logprobs)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stats = chunk.stats

    @property
    def generated_text(self) -> str:
        """The generated text alone (without the echoed prompt)."""
        return "".join(self.text_parts)

    @property
    def text(self) -> str:
        return self.prefix + self.generated_text


def results_of(results: CompletionAccumulator | Sequence[CompletionAccumulator]) -> list[CompletionAccumulator]:
    return [results] if isinstance(results, CompletionAccumulator) else list(results)


def total_usage(results: CompletionAccumulator | Sequence[CompletionAccumulator]) -> dict[str, int]:
    """``usage`` of a request's choices: the prompt tokens of each prompt once, the completion
    tokens of every choice."""
    results = results_of(results)
    prompt_tokens = sum(r.stats.prompt_tokens for r in results if r.stats is not None and r.counts_prompt)
    completion_tokens = sum(r.stats.completion_tokens for r in results if r.stats is not None)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    details = prediction_details([r.stats for r in results if r.stats is not None])
    if details is not None:
        usage["completion_tokens_details"] = details
    return usage


def merged_speculation(
    results: CompletionAccumulator | Sequence[CompletionAccumulator], wall_s: float | None = None
) -> dict[str, Any] | None:
    """The request's ``speculation`` block. One choice: its stats. Several: counts, calls, times
    and bytes summed, ``accepted_lengths`` concatenated in choice order, ``block_efficiency``
    = all generated tokens / all target calls, and ``tokens_per_second`` = all generated tokens
    / the request's wall-clock seconds (``wall_s``; the choices run concurrently)."""
    results = results_of(results)
    stats = [r.stats for r in results if r.stats is not None]
    if not stats:
        return None
    if len(results) == 1:
        return speculation_block(stats[0])
    blocks = [speculation_block(s) for s in stats]
    merged: dict[str, Any] = dict(blocks[0])
    for key, first in blocks[0].items():
        values = [block[key] for block in blocks]
        if isinstance(first, bool) or isinstance(first, str) or first is None:
            continue
        if isinstance(first, (int, float)):
            merged[key] = sum(values)
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        elif isinstance(first, dict):
            summed: dict[str, Any] = {}
            for value in values:
                for name, count in value.items():
                    summed[name] = summed.get(name, 0) + count
            merged[key] = summed
    completion_tokens = sum(s.completion_tokens for s in stats)
    target_calls = sum(s.target_calls for s in stats)
    merged["block_efficiency"] = completion_tokens / target_calls if target_calls else 0.0
    merged["tokens_per_second"] = completion_tokens / wall_s if wall_s else 0.0
    return merged

