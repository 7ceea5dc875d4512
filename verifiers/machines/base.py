"""The base of every decode machine: committed tokens, their log-probabilities, the context
budget, and the per-model ``append`` bookkeeping (:class:`Unsent`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from verifiers.machines.needs import DrawLogprob, Need

#: Tokens a plain iteration draws by default (``ar``, ``sd``'s plain steps): a request alone (its
#: iterations run in a burst, each streamed as it ends). The scheduler sets each step's count
#: (``plain_tokens``; ``actors.coordination.policy.set_plain_tokens``) where that cannot change a
#: seeded request's tokens: an ``ar`` iteration's draws never change them (one draw per token, in
#: order, on stream 0); an ``sd`` plain step's count decides when the next block is drafted, so it
#: changes only for ``gamma: "auto"`` weighing measured step costs, whose tokens already depend on timings.
AR_TOKENS_PER_ITERATION = 4


class DecodeMachine(ABC):
    """One request decoded with one strategy.

    max_new_tokens: the most tokens this machine will ever commit (the driver may stop earlier:
    EOS, stop strings). context_budget: positions left after the prompt in the smallest model
    context (None: unlimited, as in the reference loops); blocks are clipped near its end.
    logprobs: when not None, ``token_logprobs`` gets one entry per committed token: its
    log-probability under the law it was sampled from (the target's for ar / sd / multi_draft,
    the ensemble's for ensemble / se, never the draft's) and the ``logprobs`` most likely ids.
    """

    def __init__(self, max_new_tokens: int, context_budget: int | None = None, logprobs: int | None = None):
        self.max_new_tokens = int(max_new_tokens)
        self.context_budget = context_budget
        self.committed: list[int] = []
        self.accepted_lengths: list[int] = []
        self.logprobs = logprobs  # None: not asked for; k: the token's and k alternatives
        self.token_logprobs: list[DrawLogprob] = []  # aligned with committed, when asked for

    @property
    def done(self) -> bool:
        return len(self.committed) >= self.max_new_tokens

    @abstractmethod
    def streams(self) -> dict[str, dict[str, int]]:
        """Model name -> {stream name: stream index in the request's layout} its executor owns
        (every model the machine uses appears, possibly with no stream)."""

    @abstractmethod
    def needs(self) -> list[Need]:
        """What the models must do this iteration (never empty while not done)."""

    @abstractmethod
    def consume(self, results: Sequence[object]) -> list[int]:
        """Take the results of :meth:`needs` (same order); return the tokens made final."""

    def lookahead(self, block: int) -> int:
        """Clip a block so no position passes the model context."""
        if self.context_budget is None:
            return max(1, block)
        return max(1, min(block, self.context_budget - len(self.committed)))

    def _commit(self, tokens: Sequence[int], logprobs: Sequence[DrawLogprob] | None = None) -> list[int]:
        tokens = [int(t) for t in tokens]
        self.committed.extend(tokens)
        if self.logprobs is not None:
            if logprobs is None or len(logprobs) != len(tokens):
                raise RuntimeError("log-probabilities were asked for but the iteration did not return one per token")
            self.token_logprobs.extend(logprobs)
        return tokens


class Unsent:
    """Per model, how many committed tokens it has been told about (``append`` bookkeeping)."""

    def __init__(self, models: Sequence[str], committed: list[int]):
        self.synced = {name: 0 for name in models}
        self.committed = committed

    def take(self, model: str) -> tuple[int, ...]:
        tokens = tuple(self.committed[self.synced[model]:])
        self.synced[model] = len(self.committed)
        return tokens

    def mark(self, model: str | None) -> None:
        """``model`` committed the tokens itself (the verifier commits what it emits); None: no
        model did (a machine that verifies itself)."""
        if model is not None:
            self.synced[model] = len(self.committed)
