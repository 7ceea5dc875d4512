"""Reference decode loops: slow, obviously correct, the executable spec.

The distributed coordinator and the tests are checked against these loops, token for token
(same seed, same random streams) and in law (exact enumeration). Each loop drives the same
state machine the serving engine drives (:mod:`verifiers.machines`), with an executor that
recomputes every row from the full context (:class:`verifiers.reference.executor.LocalExecutor`): no
caches, no batching tricks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.reference.executor import LocalExecutor, layout_sources, run_machine
from verifiers.machines.autoregressive import AutoregressiveMachine
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.penalties import NO_PENALTIES, Penalties
from verifiers.proposers import Proposer
from verifiers.randomness import RandomSource, split_sources
from verifiers.registry import get_verifier

logger = logging.getLogger(__name__)

__all__ = ["autoregressive_generate", "speculative_generate"]


ModelFn = Callable[[tuple[int, ...]], torch.Tensor]


def speculative_generate(
    draft_fn: ModelFn | None,
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
    penalties: Penalties = NO_PENALTIES,
    adaptive: AdaptiveGammaSettings | None = None,
    pre_drafting: int = 0,
    dtype: torch.dtype = torch.float64,
    proposers: Sequence[Proposer] = (),
) -> tuple[list[int], dict]:
    """Speculative decoding with the verification rule ``method`` (see :mod:`verifiers.registry`).

    ``draft_fn`` / ``target_fn`` map the full context (prompt included) as a tuple of token
    ids to logits ``[V]``; both are turned into rows by
    ``penalized_probs(logits, temperature=..., top_k=..., top_p=..., penalties=...)``
    (identically for draft and target; each row penalized with the tokens generated before
    its own position, :mod:`verifiers.penalties`). Returns ``(tokens, stats)``: exactly
    ``max_new_tokens`` generated ids (the last block is truncated; no EOS handling) and a
    dict with ``target_calls`` (one per iteration), ``draft_calls`` (``gamma`` per
    iteration: one batched call per draft position over the K drafts), ``accepted`` (accepted lengths per
    iteration), ``draft_lengths`` (the block drafted per iteration), ``draft_index`` (multi-draft: the
    chosen draft per iteration) and ``iterations``. ``adaptive``: choose each iteration's block
    from the accepted lengths so far (:mod:`verifiers.adaptive`; ``gamma`` is then unused).
    ``pre_drafting`` (K > 0): the draft drafts the next block after each of K candidate bonus
    tokens while the target verifies (:class:`verifiers.machines.needs.PreDraft`; ``pre_drafted`` in
    the stats counts the iterations that verified such a block). ``proposers``: model-free
    proposers asked before each block (:mod:`verifiers.proposers`; ``draft_fn`` None: a plain
    step where none proposes; ``proposed`` / ``accepted_proposed`` in the stats, per proposer). The random streams then differ
    from the contract below (the drafting stream also serves the pre-drafts, in iteration order), the
    law does not. ``dtype``: the rows' precision (float64, or float32 as a GPU worker computes them;
    ``tests/verifiers/test_precision.py``).

    Random-stream contract (the distributed coordinator reproduces this loop token for
    token, so it is part of the interface):

    1. ``draft_source, verify_source = split_sources(generator, 2)`` once per call
       (stream 0 = drafting, stream 1 = verification; see ``verifiers.randomness.stream_seeds``).
    2. Every iteration drafts a full block of ``gamma`` tokens for each of the ``K =
       num_drafts`` drafts (K = 1 for single-draft rules), position by position: at position ``i`` ONE call
       ``draft_source.categorical(rows)`` with ``rows [K, V]`` (draft k's row after its own
       first ``i`` tokens, in draft order).
    3. The target rows are computed for all ``gamma + 1`` positions of each draft.
    4. ONE verifier call with batch ``B = 1`` (single-draft: ``[1, gamma]``, ``[1, gamma, V]``,
       ``[1, gamma+1, V]``; multi-draft: ``[1, K, gamma]``, ``[1, K, gamma, V]``,
       ``[1, K, gamma+1, V]``) and ``generator=verify_source``; the returned ``state`` is passed
       as ``state=`` to the next iteration's call (stateful rules; None otherwise).
    5. The emitted tokens (accepted prefix + correction-or-bonus) extend the context.
    """
    _check_loop_args(max_new_tokens, gamma, num_drafts, get_verifier(method).multi_draft, method)
    draft_source, verify_source = split_sources(generator, 2)
    machine = SpeculativeMachine(
        None if draft_fn is None else "draft", "target", method=method, gamma=gamma, num_drafts=num_drafts,
        max_new_tokens=max_new_tokens, adaptive=adaptive, pre_drafting=pre_drafting, proposers=proposers,
    )
    model_fns = {"target": target_fn} if draft_fn is None else {"draft": draft_fn, "target": target_fn}
    executor = LocalExecutor(
        model_fns,
        prompt,
        layout_sources(machine.streams(), [draft_source, verify_source]),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        penalties=penalties,
        dtype=dtype,
    )
    generated = run_machine(machine, executor)
    iterations = len(machine.accepted_lengths)
    stats = {
        "target_calls": iterations,
        "draft_calls": sum(machine.draft_lengths),
        "accepted": list(machine.accepted_lengths),
        "draft_lengths": list(machine.draft_lengths),
        "draft_index": list(machine.draft_indices),
        "iterations": iterations,
        "pre_drafted": machine.pre_drafted_iterations,
        "proposed": list(machine.proposed_tokens),
        "accepted_proposed": list(machine.accepted_proposed),
    }
    logger.debug("speculative_generate(%s): %s", method, stats)
    return generated[:max_new_tokens], stats


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
    penalties: Penalties = NO_PENALTIES,
    dtype: torch.dtype = torch.float64,
) -> tuple[list[int], dict]:
    """Plain autoregressive sampling from the target (the baseline every method must equal
    in law). Returns ``(tokens, stats)`` with ``stats["target_calls"] == max_new_tokens``.
    ``dtype``: the rows' precision (as :func:`speculative_generate`).

    Random-stream contract: ``(sampling_source,) = split_sources(generator, 1)``, then ONE
    ``sampling_source.categorical(row)`` per token with ``row [V]`` =
    ``logits_to_probs(target_fn(context), temperature=..., top_k=..., top_p=...)``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    (sampling_source,) = split_sources(generator, 1)
    machine = AutoregressiveMachine("target", max_new_tokens)
    executor = LocalExecutor(
        {"target": target_fn},
        prompt,
        layout_sources(machine.streams(), [sampling_source]),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        penalties=penalties,
        dtype=dtype,
    )
    generated = run_machine(machine, executor)
    return generated, {"target_calls": max_new_tokens}
