"""The one implementation of a :class:`verifiers.machines.needs.ScoreVerify`'s verification, driven
by both executors of needs: the reference (:class:`verifiers.reference.executor.LocalExecutor`, rows
recomputed from full contexts) and the serving engine (:mod:`actors.worker.engine`, rows from cached
forwards, many requests' blocks in one verifier call).

Each executor computes a block's rows its own way; from the rows on, the steps are these
functions, so the exactness proofs that run through the reference executor run the verification
that serves:

1. :func:`block_inputs`: the draft tokens ``[K, gamma]``, the draft's rows ``[K, gamma, V]`` and
   the target's rows ``[K, gamma+1, V]`` in the rule's batch layout (a multi-draft rule gets a
   batch of one; for a single-draft rule K = 1 is the batch of one);
2. :func:`verify_blocks`: ONE call of the rule over the blocks of one or many requests (same rule,
   same block length), batch row ``b`` drawing from request ``b``'s own verification stream
   (:class:`verifiers.randomness.RowSources`), so a request gets the tokens a call of its block
   alone gives (block verification: Sun et al. 2024, Algorithm 2; token verification: Leviathan
   et al. 2023, Algorithm 1; multi-draft rules: Sun et al. 2023, SpecTr, arXiv:2310.15141);
3. :func:`verified_row`: batch row ``row`` of the rule's result as a
   :class:`verifiers.machines.needs.Verified` (emitted tokens, accepted count, chosen draft, and each
   emitted token's log-probability under the target's row at its position when asked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from verifiers.machines.needs import Verified
from verifiers.randomness import RandomSource, RowSources, cat_adjacent
from verifiers.sampling import token_logprob

#: (draft tokens, draft rows, target rows) in a rule's batch layout: ``[B, gamma]``,
#: ``[B, gamma, V]``, ``[B, gamma+1, V]`` single-draft; ``[B, K, gamma]``, ``[B, K, gamma, V]``,
#: ``[B, K, gamma+1, V]`` multi-draft.
BlockInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def block_inputs(
    spec: Any, draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> BlockInputs:
    """One request's block in ``spec``'s batch layout (batch of one).

    draft_tokens ``[K, gamma]``, draft_probs ``[K, gamma, V]`` (what each draft token was drawn
    from), target_probs ``[K, gamma+1, V]`` (the target's row before each draft position and
    after the whole chain)."""
    if spec.multi_draft:
        return draft_tokens[None], draft_probs[None], target_probs[None]  # B = 1
    return draft_tokens, draft_probs, target_probs  # K = 1 is the batch of one


def block_key(method: str, spec: Any, inputs: BlockInputs) -> tuple[str, int] | None:
    """Blocks one :func:`verify_blocks` call may take together: a stateless single-draft rule and
    the block length; None: verified alone (multi-draft rules and stateful ones, whose state
    belongs to one request)."""
    if not _shareable(spec):
        return None
    return method, int(inputs[0].shape[-1])


def _shareable(spec: Any) -> bool:
    """Whether blocks of several requests may share one call of ``spec``'s rule: single-draft
    and stateless (a stateful rule's state belongs to one request)."""
    return not (spec.multi_draft or spec.stateful)


def verify_blocks(
    spec: Any, blocks: Sequence[BlockInputs], sources: Sequence[RandomSource], state: Any = None
) -> Any:
    """ONE verifier call over ``blocks`` (each a batch of one from :func:`block_inputs`; several
    only for a :func:`block_key` that is not None), block ``b`` drawing from ``sources[b]``.
    Returns the rule's result; its batch row ``b`` is block ``b``'s (:func:`verified_row`)."""
    if len(blocks) != len(sources) or not blocks:
        raise ValueError(f"verify_blocks needs one source per block, got {len(blocks)} blocks, {len(sources)} sources")
    if len(blocks) == 1:
        return spec.verify(*blocks[0], generator=sources[0], state=state)
    if not _shareable(spec) or state is not None:
        raise ValueError("only stateless single-draft blocks are verified together")
    draft_tokens = torch.cat([block[0] for block in blocks])  # [B, gamma]
    draft_probs = cat_adjacent([block[1] for block in blocks])  # [B, gamma, V]; no copy for adjacent rows
    target_probs = cat_adjacent([block[2] for block in blocks])  # [B, gamma+1, V]
    return spec.verify(draft_tokens, draft_probs, target_probs, generator=RowSources(list(sources)), state=None)


def verified_row(
    spec: Any, inputs: BlockInputs, result: Any, row: int, logprobs: int | None = None
) -> Verified:
    """Batch row ``row`` of ``result`` (a :func:`verify_blocks` call that took ``inputs`` at that
    row) as :class:`Verified`; with ``logprobs`` (the request's top-logprobs count) each emitted
    token's log-probability under the target row at its position of the chosen draft."""
    draft_index = None if result.draft_index is None else int(result.draft_index[row])
    emitted = result.emitted(row)
    token_logprobs = None
    if logprobs is not None:
        target_probs = inputs[2][0] if spec.multi_draft else inputs[2]  # [K, gamma+1, V]
        chosen = 0 if draft_index is None else draft_index
        token_logprobs = [token_logprob(target_probs[chosen, j], t, logprobs) for j, t in enumerate(emitted)]
    return Verified(emitted=emitted, num_accepted=int(result.num_accepted[row]), draft_index=draft_index,
                    logprobs=token_logprobs)
