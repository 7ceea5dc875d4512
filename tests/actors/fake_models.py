"""Deterministic fake model workers: the ModelWorker with its model replaced by a function.

This is the one place the test suite substitutes the model: the logits are an exact,
seeded function of the whole prefix (:class:`tests.verifiers.tiny_models.TinyModel`), so the
reference loops in ``verifiers.reference`` can be run on the very same functions and the
distributed coordinator's output compared token for token, and its law computed exactly.
Everything else (sessions, cache bookkeeping, rollback, sampling, verification, the
coordinator, Ray) is the production code: :class:`FunctionModelWorker` only overrides
``ModelWorker._load_backend``.

Models are named by ``spec.path`` (``fake:<name>``, see :data:`FAKE_MODELS`).
"""

from __future__ import annotations

from typing import Any

import torch

from actors.model_worker import ModelWorker
from actors.plan import DecodingDefaults
from cluster.config import GroupConfig, ModelSpec
from tests.verifiers.tiny_models import TinyModel, model_pair

VOCAB = 6
FAKE_CONTEXT = 64

#: A prompt that makes every fake model raise once the context is 3 tokens past it.
POISON_PROMPT = (5, 5, 5, 5)
POISON_AFTER = 3


def _fake_models() -> dict[str, Any]:
    draft, target = model_pair(VOCAB, seed=11, noise=0.6)
    return {
        "target": target,
        "draft": draft,
        "partner": TinyModel(VOCAB, seed=23, base=target, noise=0.8),
        "partner2": TinyModel(VOCAB, seed=37),
    }


FAKE_MODELS = _fake_models()


class PoisonError(RuntimeError):
    """Raised by fake models on the poison prompt (simulates a failing worker)."""


class FunctionBackend:
    """The :class:`actors.backends.ModelBackend` interface over a function of the context.

    The "cache" is the list of token rows whose positions have been computed; ``forward``
    evaluates the function only at the new positions, so ``calls`` counts exactly the
    positions the worker asked for (what a KV cache would compute).
    """

    device = "cpu"

    def __init__(self, model_fn, vocab_size: int, max_context: int = FAKE_CONTEXT):
        self.model_fn = model_fn
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.positions_computed = 0

    def new_cache(self) -> list[list[int]]:
        return [[]]

    def cache_length(self, cache: list[list[int]]) -> int:
        return len(cache[0])

    def forward(self, input_ids: torch.Tensor, cache: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
        rows = input_ids.tolist()  # [B][L]
        if len(cache) == 1 and len(rows) > 1:
            cache = [list(cache[0]) for _ in rows]
        if len(cache) != len(rows):
            raise ValueError(f"cache has {len(cache)} rows, input has {len(rows)}")
        logits = torch.empty(len(rows), len(rows[0]), self.vocab_size, dtype=torch.float64)  # [B, L, V]
        new_cache = []
        for b, (prefix, new_tokens) in enumerate(zip(cache, rows)):
            context = list(prefix)
            for j, token in enumerate(new_tokens):
                context.append(int(token))
                logits[b, j] = self._logits(tuple(context))
            new_cache.append(context)
        return logits, new_cache

    def _logits(self, context: tuple[int, ...]) -> torch.Tensor:
        self.positions_computed += 1
        if context[: len(POISON_PROMPT)] == POISON_PROMPT and len(context) >= len(POISON_PROMPT) + POISON_AFTER:
            raise PoisonError(f"poisoned context {context}")
        return torch.as_tensor(self.model_fn(context), dtype=torch.float64)

    def crop(self, cache: list[list[int]], length: int) -> list[list[int]]:
        return [row[:length] for row in cache]

    def repeat(self, cache: list[list[int]], times: int) -> list[list[int]]:
        return [list(cache[0]) for _ in range(times)] if len(cache) == 1 else cache

    def select(self, cache: list[list[int]], row: int) -> list[list[int]]:
        return [cache[row]]


class FunctionModelWorker(ModelWorker):
    """ModelWorker whose model is ``FAKE_MODELS[name]`` for ``spec.path == "fake:<name>"``."""

    def _load_backend(self) -> FunctionBackend:
        name = self.spec.path.removeprefix("fake:")
        return FunctionBackend(FAKE_MODELS[name], VOCAB)

    def positions_computed(self) -> int:
        return self.backend.positions_computed


def fake_group_config(**defaults: Any) -> GroupConfig:
    """A GroupConfig over the four fake models (no tokenizer: token ids only)."""
    roles = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}
    models = tuple(
        ModelSpec(name=name, path=f"fake:{name}", role=role, num_cpus=0.1) for name, role in roles.items()
    )
    return GroupConfig(
        models=models,
        tokenizer_path=None,
        defaults=DecodingDefaults(**{"strategy": "sd", "method": "token", "gamma": 3, **defaults}),
        max_concurrent_requests=64,
        session_idle_timeout_s=120.0,
    )
