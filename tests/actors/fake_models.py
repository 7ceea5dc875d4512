"""Deterministic fake model workers: the ModelWorker with its model replaced by a function.

This is the one place the test suite substitutes the model: the logits are an exact,
seeded function of the whole prefix (:class:`tests.verifiers.tiny_models.TinyModel`), so the
reference loops in ``verifiers.reference`` can be run on the very same functions and the
distributed coordinator's output compared token for token, and its law computed exactly.
Everything else (sessions, slot and column bookkeeping, rollback, the batched step, sampling,
verification, the scheduler, Ray) is the production code: :class:`FunctionModelWorker` only
overrides ``ModelWorker._load_backend``, and the fake backend computes each token's logits from
exactly the columns the engine's attention mask lets it see.

Models are named by ``spec.path`` (``fake:<name>``, see :data:`FAKE_MODELS`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from actors.model.backends import FORWARD_OVERHEAD_TOKENS
from actors.worker.model_worker import ModelWorker
from cluster.config import GroupConfig, parse_app_args
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
    """The :class:`actors.model.backends.SlotBackend` interface over a function of the context.

    Each slot remembers, per storage column, the token written there and its position. A new
    token's logits are the function of the tokens it can see -- the slot's prefix columns and
    its ``attend`` columns, ordered by position -- plus itself, so a wrong column, position or
    mask in the engine changes the logits and the tests see it. ``positions_computed`` counts
    exactly the positions the worker asked for (what a KV cache would compute).
    """

    device = "cpu"
    forward_overhead_tokens = FORWARD_OVERHEAD_TOKENS["cpu"]  # how the engine cuts a step into forwards

    def __init__(self, model_fn, vocab_size: int, max_context: int = FAKE_CONTEXT, max_slots: int = 256,
                 scratch_columns: int = 288):
        self.model_fn = model_fn
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.capacity = max_context + scratch_columns
        self.max_slots = max_slots
        # slot -> column -> (token, position); a freed slot keeps what it holds, like the real cache
        self.columns: dict[int, dict[int, tuple[int, int]]] = {}
        self.allocated: set[int] = set()
        self.positions_computed = 0

    def allocate(self) -> int:
        free = next((slot for slot in range(self.max_slots) if slot not in self.allocated), None)
        if free is None:
            raise RuntimeError(f"all max_slots={self.max_slots} cache slots are in use")
        self.allocated.add(free)
        self.columns.setdefault(free, {})
        return free

    def free(self, slot: int) -> None:
        self.allocated.discard(slot)

    def resize_slots(self, slots: int) -> None:
        """Hold ``slots`` slots (as :meth:`actors.model.backends.SlotBackend.resize_slots`)."""
        self.max_slots = int(slots)

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.max_slots) if slot not in self.allocated]

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        source = self.columns.get(src_slot, {})
        target = self.columns.setdefault(dst_slot, {})
        for column in range(length):
            target[column] = source[column]  # a KeyError: the prefix cache copied columns nothing wrote

    def truncate(self, slot: int, length: int) -> None:
        """Forget every column from ``length`` on (as the paged cache gives back its blocks), so
        a later read of one fails here."""
        stored = self.columns.get(slot, {})
        for column in [c for c in stored if c >= length]:
            del stored[column]

    def held_columns(self, slot: int) -> int:
        stored = self.columns.get(slot, {})
        return next(n for n in range(len(stored) + 1) if n not in stored)

    def copy_columns(self, slot: int, src, dst) -> None:
        stored = self.columns[slot]
        values = [stored[c] for c in src]
        for column, value in zip(dst, values):
            stored[column] = value

    def forward(self, rows) -> list[torch.Tensor]:
        outputs = []
        for row in rows:
            stored = self.columns[row.slot]
            for token, column, position in zip(row.token_ids, row.columns, row.positions):
                stored[column] = (int(token), int(position))
            logits = torch.empty(len(row.keep), self.vocab_size, dtype=torch.float64)  # [len(keep), V]
            for out, index in enumerate(row.keep):
                visible = list(range(row.prefix_length)) + list(row.attend[index])
                logits[out] = self._logits(self._context(stored, visible, row.positions[index]))
            outputs.append(logits)
        return outputs

    @staticmethod
    def _context(stored: dict[int, tuple[int, int]], visible: list[int], position: int) -> tuple[int, ...]:
        entries = sorted(stored[c] for c in set(visible))  # (token, position) pairs
        by_position = sorted(entries, key=lambda entry: entry[1])
        positions = [p for _, p in by_position]
        if positions != list(range(position + 1)):
            raise AssertionError(f"visible positions {positions} are not 0..{position}")
        return tuple(token for token, _ in by_position)

    def _logits(self, context: tuple[int, ...]) -> torch.Tensor:
        self.positions_computed += 1
        if context[: len(POISON_PROMPT)] == POISON_PROMPT and len(context) >= len(POISON_PROMPT) + POISON_AFTER:
            raise PoisonError(f"poisoned context {context}")
        return torch.as_tensor(self.model_fn(context), dtype=torch.float64)


class FunctionModelWorker(ModelWorker):
    """ModelWorker whose model is ``FAKE_MODELS[name]`` for ``spec.path == "fake:<name>"``."""

    def _load_backend(self) -> FunctionBackend:
        name = self.spec.path.removeprefix("fake:")
        return FunctionBackend(FAKE_MODELS[name], VOCAB, max_slots=self.max_sessions)

    def positions_computed(self) -> int:
        return self.backend.positions_computed


class SlowFunctionModelWorker(FunctionModelWorker):
    """A :class:`FunctionModelWorker` whose forwards each last ``forward_delay_s`` more (only the
    models named in ``slow_models``; all when None): requests stay in flight long enough for a
    test to act while they run (kill a worker, arrive during a burst, pass a timeout)."""

    forward_delay_s = 0.02
    slow_models: frozenset[str] | None = None

    def _load_backend(self) -> FunctionBackend:
        backend = super()._load_backend()
        if self.slow_models is None or self.spec.name in self.slow_models:
            forward, delay_s = backend.forward, self.forward_delay_s

            def slow_forward(rows):
                time.sleep(delay_s)
                return forward(rows)

            backend.forward = slow_forward
        return backend


#: resources.placement with the target and the draft on one worker, each member on its own.
CO_LOCATED = {"target": 0, "draft": 0, "partner": 1, "partner2": 2}


def fake_group_config(overlap: bool = True, request_timeout_s: float = 600.0, goodput_gamma: bool = False,
                      pre_drafting: int = 0, burst_ms: float | None = None, sampling_precision: str = "auto",
                      placement: Any = "separate", **defaults: Any) -> GroupConfig:
    """The GroupConfig of YAML args over the four fake models (validated and derived like any
    deployment's), without a tokenizer (token ids only); ``overlap``: two alternating cohorts
    (the default) or one; ``goodput_gamma``: gamma "auto" weighs measured step costs (off by
    default here, so seeded requests equal the reference loops token for token); ``pre_drafting``:
    engine.pre_drafting (candidate bonus tokens, 0 off); ``burst_ms``: engine.burst_ms (solo bursts; None: the
    default); ``sampling_precision``: engine.sampling_precision (auto: float64 here, no GPU); ``placement``:
    resources.placement (:data:`CO_LOCATED`: target and draft share a worker; default a worker per model); ``defaults``: the
    args' ``defaults`` over sd / token / gamma 3."""
    roles = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}
    args = parse_app_args({
        "models": {name: {"path": f"fake:{name}", "role": role} for name, role in roles.items()},
        "defaults": {"strategy": "sd", "method": "token", "gamma": 3, **defaults},
        "resources": {"gpus_per_model": 0, "cpus_per_model": 0.1, "placement": placement},
        "limits": {"max_concurrent_requests": 64, "max_queued_requests": 1024, "session_idle_timeout_s": 120.0,
                   "request_timeout_s": request_timeout_s},
        "engine": {"overlap": overlap, "goodput_gamma": goodput_gamma, "pre_drafting": pre_drafting,
                   "sampling_precision": sampling_precision, **({} if burst_ms is None else {"burst_ms": burst_ms})},
    })
    return args.freeze().model_copy(update={"tokenizer_path": None})


def run_in_process(coordinator: Any, requests: list, timeout_s: float | None = None) -> list[list]:
    """Every request's chunks, the requests served concurrently by an in-process
    :class:`actors.coordination.coordinator.Coordinator`, whose scheduler is closed afterwards;
    ``timeout_s`` bounds the whole (a hang fails instead of waiting for ever)."""

    async def collect(request):
        return [chunk async for chunk in coordinator.generate(request)]

    async def run_all():
        try:
            return await asyncio.wait_for(asyncio.gather(*(collect(r) for r in requests)), timeout=timeout_s)
        finally:
            await coordinator.scheduler.close()

    return asyncio.run(run_all())
