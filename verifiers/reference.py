"""Reference decode loops: slow, obviously correct, the executable spec.

The distributed coordinator and the tests are checked against these loops, token for token
(same seed, same random streams) and in law (exact enumeration). They recompute every row
from the full context: no caches, no batching tricks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from verifiers.randomness import RandomSource, split_sources
from verifiers.registry import get_verifier
from verifiers.sampling import logits_to_probs

logger = logging.getLogger(__name__)

__all__ = ["autoregressive_generate", "ensemble_generate", "speculative_generate"]


def __getattr__(name: str):
    """Re-export ``ensemble_generate`` from :mod:`verifiers.reference_ensemble` lazily (no
    import cycle, and this module works while that one is absent)."""
    if name == "ensemble_generate":
        from verifiers.reference_ensemble import ensemble_generate

        return ensemble_generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ModelFn = Callable[[tuple[int, ...]], torch.Tensor]


def speculative_generate(
    draft_fn: ModelFn,
    target_fn: ModelFn,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    gamma: int,
    method: str,
    num_drafts: int = 1,
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[int], dict]:
    """Speculative decoding with the verification rule ``method`` (see :mod:`verifiers.registry`).

    ``draft_fn`` / ``target_fn`` map the full context (prompt included) as a tuple of token
    ids to logits ``[V]``; both are turned into rows by
    ``logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)``
    (identically for draft and target). Returns ``(tokens, stats)``: exactly
    ``max_new_tokens`` generated ids (the last block is truncated; no EOS handling) and a
    dict with ``target_calls`` (one per iteration), ``draft_calls`` (``gamma`` per
    iteration: one batched step over the K drafts), ``accepted`` (accepted lengths per
    iteration), ``draft_index`` (multi-draft: the chosen draft per iteration) and
    ``iterations``.

    Random-stream contract (the distributed coordinator reproduces this loop token for
    token, so it is part of the interface):

    1. ``draft_source, verify_source = split_sources(generator, 2)`` once per call
       (stream 0 = drafting, stream 1 = verification; see ``verifiers.randomness.stream_seeds``).
    2. Every iteration drafts a full block of ``gamma`` tokens for each of the ``K =
       num_drafts`` drafts (K = 1 for single-draft rules), step by step: at step ``i`` ONE call
       ``draft_source.categorical(rows)`` with ``rows [K, V]`` (draft k's row after its own
       first ``i`` tokens, in draft order).
    3. The target rows are computed for all ``gamma + 1`` positions of each draft.
    4. ONE verifier call with batch ``B = 1`` (single-draft: ``[1, gamma]``, ``[1, gamma, V]``,
       ``[1, gamma+1, V]``; multi-draft: ``[1, K, gamma]``, ``[1, K, gamma, V]``,
       ``[1, K, gamma+1, V]``) and ``generator=verify_source``; the returned ``state`` is passed
       as ``state=`` to the next iteration's call (stateful rules; None otherwise).
    5. The emitted tokens (accepted prefix + correction-or-bonus) extend the context.
    """
    spec = get_verifier(method)
    _check_loop_args(max_new_tokens, gamma, num_drafts, spec.multi_draft, method)
    draft_source, verify_source = split_sources(generator, 2)

    def rows(model_fn: ModelFn, context: tuple[int, ...]) -> torch.Tensor:
        logits = torch.as_tensor(model_fn(context))  # [V]
        return logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)

    context = tuple(int(t) for t in prompt)
    generated: list[int] = []
    stats: dict = {"target_calls": 0, "draft_calls": 0, "accepted": [], "draft_index": [], "iterations": 0}
    state = None
    while len(generated) < max_new_tokens:
        draft_tokens, draft_probs = _draft_block(
            lambda ctx: rows(draft_fn, ctx), draft_source, context, gamma, num_drafts
        )  # [K, gamma], [K, gamma, V]
        target_probs = torch.stack(
            [
                torch.stack([rows(target_fn, context + tuple(draft[:i])) for i in range(gamma + 1)])
                for draft in draft_tokens.tolist()
            ]
        )  # [K, gamma+1, V]
        if spec.multi_draft:
            batched = (draft_tokens[None], draft_probs[None], target_probs[None])  # B = 1
        else:
            batched = (draft_tokens, draft_probs, target_probs)  # K = 1 is the batch of 1
        result = spec.verify(*batched, generator=verify_source, state=state)
        state = result.state
        emitted = result.emitted(0)
        generated.extend(emitted)
        context = context + tuple(emitted)
        stats["target_calls"] += 1
        stats["draft_calls"] += gamma
        stats["iterations"] += 1
        stats["accepted"].append(int(result.num_accepted[0]))
        if result.draft_index is not None:
            stats["draft_index"].append(int(result.draft_index[0]))
    logger.debug("speculative_generate(%s): %s", method, stats)
    return generated[:max_new_tokens], stats


def _draft_block(
    draft_rows: Callable[[tuple[int, ...]], torch.Tensor],
    draft_source: RandomSource,
    context: tuple[int, ...],
    gamma: int,
    num_drafts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_drafts`` independent draft blocks of ``gamma`` tokens, one categorical call per
    step over the K rows. Returns ``draft_tokens [K, gamma]`` and ``draft_probs [K, gamma, V]``."""
    drafts: list[list[int]] = [[] for _ in range(num_drafts)]
    step_rows: list[torch.Tensor] = []
    for _ in range(gamma):
        rows = torch.stack([draft_rows(context + tuple(draft)) for draft in drafts])  # [K, V]
        tokens = draft_source.categorical(rows)  # [K]
        for draft, token in zip(drafts, tokens.tolist()):
            draft.append(int(token))
        step_rows.append(rows)
    draft_probs = torch.stack(step_rows, dim=1)  # [K, gamma, V]
    return torch.tensor(drafts, dtype=torch.int64), draft_probs


def _check_loop_args(max_new_tokens: int, gamma: int, num_drafts: int, multi_draft: bool, method: str) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or num_drafts < 1:
        raise ValueError(f"num_drafts must be an int >= 1, got {num_drafts!r}")
    if not multi_draft and num_drafts != 1:
        raise ValueError(f"method {method!r} is single-draft; num_drafts must be 1, got {num_drafts}")


def autoregressive_generate(
    target_fn: ModelFn,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[int], dict]:
    """Plain autoregressive sampling from the target (the baseline every method must equal
    in law). Returns ``(tokens, stats)`` with ``stats["target_calls"] == max_new_tokens``.

    Random-stream contract: ``(sampling_source,) = split_sources(generator, 1)``, then ONE
    ``sampling_source.categorical(row)`` per token with ``row [V]`` =
    ``logits_to_probs(target_fn(context), temperature=..., top_k=..., top_p=...)``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    (sampling_source,) = split_sources(generator, 1)
    context = tuple(int(t) for t in prompt)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = torch.as_tensor(target_fn(context))  # [V]
        row = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # [V]
        token = int(sampling_source.categorical(row))
        generated.append(token)
        context = context + (token,)
    return generated, {"target_calls": max_new_tokens}
