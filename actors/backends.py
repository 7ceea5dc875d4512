"""Forward passes with a KV cache, behind one small interface.

A :class:`ModelBackend` runs a causal LM over new tokens on top of a cache and manipulates the
cache (crop to a length, repeat rows for a batch of drafts, keep one row). The ModelWorker's
session logic (prefill / propose / score / rollback) is written once against this interface;
:class:`TransformersBackend` is the production implementation (a transformers causal LM with a
``DynamicCache``), and the tests plug in a backend whose logits are an exact function of the
prefix, which is what makes the distributed coordinator's output law computable.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONTEXT = 2048


class ModelBackend(Protocol):
    """A causal LM with a KV cache. Caches hold ``[B, length]`` tokens' keys/values."""

    vocab_size: int
    max_context: int
    device: str

    def new_cache(self) -> Any:
        """An empty cache."""
        ...

    def cache_length(self, cache: Any) -> int:
        """Tokens held per row."""
        ...

    def forward(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """Run ``input_ids [B, L]`` after the cached tokens -> ``(logits [B, L, V], cache)``
        with the cache extended by the ``L`` tokens."""
        ...

    def crop(self, cache: Any, length: int) -> Any:
        """Keep the first ``length`` tokens of every row."""
        ...

    def repeat(self, cache: Any, times: int) -> Any:
        """A one-row cache -> ``times`` identical rows."""
        ...

    def select(self, cache: Any, row: int) -> Any:
        """Keep only row ``row``."""
        ...


class TransformersBackend:
    """A transformers ``AutoModelForCausalLM`` with a ``DynamicCache`` reused across calls."""

    def __init__(self, model: Any, device: str, max_context: int | None = None):
        self.model = model
        self.device = device
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(max_context or _config_context(model.config))

    @classmethod
    def load(
        cls, path: str, *, dtype: str = "float32", revision: str | None = None, device: str = "cpu",
        max_context: int | None = None,
    ) -> TransformersBackend:
        """Load with ``AutoModelForCausalLM.from_pretrained`` (local dirs never touch the hub)."""
        from transformers import AutoModelForCausalLM

        local = os.path.isdir(path)
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=getattr(torch, dtype),
            revision=revision,
            local_files_only=local,
        )
        model.to(device).eval()
        logger.info("loaded %s (%s, %s) on %s", path, type(model).__name__, dtype, device)
        return cls(model, device, max_context)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def cache_length(self, cache: Any) -> int:
        return int(cache.get_seq_length())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        input_ids = input_ids.to(self.device)  # [B, L]
        output = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return output.logits.float().cpu(), output.past_key_values  # [B, L, V]

    def crop(self, cache: Any, length: int) -> Any:
        current = self.cache_length(cache)
        if length == 0:
            return self.new_cache()
        if length < current:
            # A negative count removes that many tokens (the form every transformers version accepts).
            cache.crop(-(current - length))
        return cache

    def repeat(self, cache: Any, times: int) -> Any:
        if times > 1 and self.cache_length(cache) > 0:
            cache.batch_repeat_interleave(times)
        return cache

    def select(self, cache: Any, row: int) -> Any:
        if self.cache_length(cache) > 0:
            cache.batch_select_indices(torch.tensor([row], device=self.device))
        return cache


def _config_context(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    logger.warning("model config names no context length; assuming %d", DEFAULT_MAX_CONTEXT)
    return DEFAULT_MAX_CONTEXT
