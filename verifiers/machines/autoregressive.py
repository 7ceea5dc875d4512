"""``ar``'s machine: the target alone."""

from __future__ import annotations

from collections.abc import Sequence

from verifiers.machines.base import AR_TOKENS_PER_ITERATION, DecodeMachine, Unsent
from verifiers.machines.needs import Need, Sample


class AutoregressiveMachine(DecodeMachine):
    """``ar``: the target alone; ``plain_tokens`` draws per iteration (``tokens_per_iteration`` at
    first; ``first_tokens``, when set, for the first iteration), one per token, stream 0 on the
    target (``verifiers.reference.autoregressive_generate``)."""

    def __init__(self, target: str, max_new_tokens: int, context_budget: int | None = None,
                 tokens_per_iteration: int = AR_TOKENS_PER_ITERATION, logprobs: int | None = None):
        super().__init__(max_new_tokens, context_budget, logprobs)
        self.target = target
        self.plain_tokens = int(tokens_per_iteration)  # draws per iteration (set per step by the scheduler)
        self.first_tokens: int | None = None  # draws of the first iteration, when set (its first chunk sooner)
        self.unsent = Unsent([target], self.committed)

    def streams(self) -> dict[str, dict[str, int]]:
        return {self.target: {"sample": 0}}

    def needs(self) -> list[Need]:
        remaining = self.max_new_tokens - len(self.committed)
        draws = self.first_tokens if self.first_tokens and not self.committed else self.plain_tokens
        count = self.lookahead(min(draws, max(1, remaining)))
        return [Sample(self.target, self.unsent.take(self.target), count, logprobs=self.logprobs)]

    def consume(self, results: Sequence[object]) -> list[int]:
        (sampled,) = results
        return self._commit(sampled.tokens[0].tolist(), sampled.logprobs)
