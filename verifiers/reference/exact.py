"""Exact output laws by enumerating every random choice of a procedure.

``exact_law(procedure)`` runs ``procedure(source)`` once per distinct sequence of random
choices, where ``source`` is a :class:`~verifiers.randomness.RandomSource` that, instead of
drawing, follows a scripted branch and records the probability of the branch it took. Every
leaf of the choice tree is visited exactly once (zero-probability branches are pruned), so
the returned law is exact up to float64 rounding. Because the procedure under test is the
production code itself (only the source of randomness differs), the law it yields is the law
of the code that serves requests.

Tractable for tiny models: vocab 2-4, blocks of 2-4 tokens, a few iterations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable

import torch


class EnumerationTooLarge(RuntimeError):
    """The choice tree has more leaves than the caller allowed."""


class _ScriptedSource:
    """Replays a fixed prefix of choices, then takes the first positive branch of every new
    choice point and remembers the other branches as scripts still to run."""

    def __init__(self, script: list[int]):
        self.script = script
        self.taken: list[int] = []
        self.path_prob = 1.0
        self.new_scripts: list[list[int]] = []

    def _choose(self, option_probs: list[float]) -> int:
        position = len(self.taken)
        if position < len(self.script):
            choice = self.script[position]
        else:
            positive = [i for i, p in enumerate(option_probs) if p > 0.0]
            if not positive:
                raise ValueError(f"a choice point with no positive probability: {option_probs}")
            choice = positive[0]
            self.new_scripts.extend(self.taken + [alt] for alt in positive[1:])
        self.taken.append(choice)
        self.path_prob *= option_probs[choice]
        return choice

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        prob = torch.as_tensor(prob, dtype=torch.float64)
        flat = prob.reshape(-1).tolist()
        draws = [self._choose([1.0 - p, p]) == 1 for p in flat]
        return torch.tensor(draws, dtype=torch.bool).reshape(prob.shape)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        probs = torch.as_tensor(probs, dtype=torch.float64)
        rows = probs.reshape(-1, probs.shape[-1]).tolist()
        draws = [self._choose(row) for row in rows]
        return torch.tensor(draws, dtype=torch.int64).reshape(probs.shape[:-1])


def exact_law(
    procedure: Callable[[object], Hashable], *, max_leaves: int = 2_000_000
) -> dict[Hashable, float]:
    """Exact law of ``procedure(source)``'s (hashable) return value over all random choices.

    Returns ``{outcome: probability}``; the probabilities sum to 1 up to rounding.
    """
    law: dict[Hashable, float] = defaultdict(float)
    pending: list[list[int]] = [[]]
    leaves = 0
    while pending:
        source = _ScriptedSource(pending.pop())
        outcome = procedure(source)
        law[outcome] += source.path_prob
        pending.extend(source.new_scripts)
        leaves += 1
        if leaves > max_leaves:
            raise EnumerationTooLarge(f"more than {max_leaves} leaves in the choice tree")
    return dict(law)


def total_variation(law_a: dict[Hashable, float], law_b: dict[Hashable, float]) -> float:
    """Total variation distance 1/2 sum |a - b| over the union of supports."""
    keys = set(law_a) | set(law_b)
    return 0.5 * sum(abs(law_a.get(k, 0.0) - law_b.get(k, 0.0)) for k in keys)


def sequence_law(
    next_token_probs: Callable[[tuple[int, ...]], torch.Tensor],
    prompt: tuple[int, ...],
    length: int,
) -> dict[tuple[int, ...], float]:
    """Exact law of ``length`` tokens sampled autoregressively from ``next_token_probs``
    (a function of the full context returning a probability row ``[V]``) after ``prompt``.
    This is the law every lossless method must reproduce."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        extended: dict[tuple[int, ...], float] = {}
        for seq, prob in law.items():
            row = next_token_probs(prompt + seq).to(torch.float64).tolist()
            for token, token_prob in enumerate(row):
                if token_prob > 0.0:
                    extended[seq + (token,)] = prob * token_prob
        law = extended
    return law
