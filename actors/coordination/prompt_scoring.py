"""Prompt log-probabilities: each prompt token's log-probability under the model's raw law.

What is scored (vLLM's semantics for ``prompt_logprobs`` and completions ``echo`` with
``logprobs``): the model's own distribution, ``log_softmax`` of its logits at temperature 1,
with no top-k / top-p, penalties or ``logit_bias`` (vLLM computes prompt log-probabilities from
the raw logits, before any sampling parameter). Whose law: the target's for ``ar`` / ``sd`` /
``multi_draft`` (drafts only propose), the ensemble's for ``ensemble`` / ``se``
(:meth:`verifiers.ensemble.EnsembleFunction.probs` of the members' logits at temperature 1) —
the law generated tokens follow, so a prompt scored here and the same text generated are
measured alike. Token ``0`` has no log-probability (nothing precedes it); entry ``j`` is token
``j + 1`` given tokens ``0..j``.

The logits come from each law model's worker (:meth:`actors.worker.engine.WorkerEngine.prompt_logits`:
one forward over the whole prompt, keeping every position).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from actors.request_schema import TokenLogprob
from actors.coordination.plan import ENSEMBLE_STRATEGIES, DecodingPlan
from verifiers.ensemble import make_ensemble


def law_models(plan: DecodingPlan) -> tuple[str, ...]:
    """The models whose logits make the request's law: its ensemble members, else its target."""
    if plan.strategy in ENSEMBLE_STRATEGIES:
        return tuple(plan.members)
    assert plan.target is not None, "a non-ensemble plan has a target"
    return (plan.target,)


def prompt_log_rows(plan: DecodingPlan, logits: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-probability rows ``[P - 1, V]`` (float64) of the request's raw law from each law
    model's prompt logits ``[P - 1, V]`` (:func:`law_models`)."""
    models = law_models(plan)
    member_logits = torch.stack([logits[name].to(torch.float64) for name in models])  # [n, P-1, V]
    if plan.strategy not in ENSEMBLE_STRATEGIES:
        return torch.log_softmax(member_logits[0], dim=-1)  # [P-1, V]
    weights = plan.weights if plan.ensemble == "weighted" else None
    function = make_ensemble(plan.ensemble, len(models), weights=weights, mu=plan.mu)
    return torch.log(function.probs(member_logits, temperature=1.0))  # [P-1, V]; log 0 = -inf


def prompt_logprobs(log_rows: torch.Tensor, prompt_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per prompt token after the first: its log-probability under
    ``log_rows[j]`` (``[P - 1, V]``), its rank (1 = the most likely) and the ``top`` most likely
    ids."""
    tokens = torch.tensor(list(prompt_ids[1:]), dtype=torch.int64)  # [P-1]
    chosen = log_rows.gather(1, tokens[:, None])[:, 0]  # [P-1]
    ranks = (log_rows > chosen[:, None]).sum(dim=1) + 1  # [P-1]
    best = torch.topk(log_rows, min(top, log_rows.shape[-1]), dim=-1) if top > 0 else None
    entries = []
    for j, token in enumerate(tokens.tolist()):
        alternatives = [] if best is None else list(zip(best.indices[j].tolist(), best.values[j].tolist()))
        entries.append(TokenLogprob(token_id=token, logprob=float(chosen[j]), top=alternatives, rank=int(ranks[j])))
    return entries


__all__ = ["law_models", "prompt_log_rows", "prompt_logprobs"]
