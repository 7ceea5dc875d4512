"""From a request's :class:`~actors.coordination.plan.DecodingPlan` to its state machine and random streams.

The strategies themselves live in :mod:`verifiers.machines` (one implementation, also driven by
the reference loops); this module only builds them, keyed by the Strategy literal:

* ``ar``          -- :class:`AutoregressiveMachine`: stream 0 on the target worker.
* ``sd``          -- :class:`SpeculativeMachine` (token / block / greedy_block): stream 0
                     (drafting) on the draft worker, stream 1 (verification) on the target.
* ``multi_draft`` -- :class:`SpeculativeMachine` with K drafts (spectr / sequential_gbv /
                     spectr_gbv): same layout.
* ``ensemble``    -- :class:`EnsembleMachine`: the coordinator combines the members' logits and
                     draws from stream n.
* ``se``          -- :class:`SpeculativeEnsembleMachine` (proposer "alternate"): member i draws
                     its proposals and bonus tokens from stream i on its own worker; segments
                     are verified in the coordinator with stream n. With a model as the
                     proposer, :class:`EnsembleDraftMachine`: it drafts on its worker (its
                     member stream, or stream n + 1), every member scores the block on its
                     own, the coordinator verifies against the ensemble rows with stream n.

Probability rows move from the worker that makes them to the one that consumes them: in ``sd``
/ ``multi_draft`` the draft's proposals go straight to the target worker (an ObjectRef), which
verifies and returns only tokens. Ensemble strategies verify in the coordinator, which is where
the members' rows meet (float32 logits, the smallest exact form).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from actors.coordination.plan import ALTERNATE, DecodingPlan
from verifiers.machines.autoregressive import AutoregressiveMachine
from verifiers.machines.base import DecodeMachine
from verifiers.machines.ensemble import EnsembleMachine, SpeculativeEnsembleMachine
from verifiers.machines.ensemble_draft import EnsembleDraftMachine
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.penalties import NO_PENALTIES, Penalties
from verifiers.proposers import PredictionProposer, PromptLookupProposer, Proposer
from verifiers.randomness import TorchRandomSource, stream_seeds


@dataclass(frozen=True)
class MachineSampling:
    """The request's row transform, as the coordinator-side ensemble rows need it."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    penalties: Penalties = NO_PENALTIES
    prompt: tuple[int, ...] = ()
    logprobs: int | None = None
    prediction: tuple[int, ...] = ()  # the request's predicted output (sd drafts it first when the plan says so)


@dataclass
class BuiltMachine:
    """A request's machine and, per model, the seeds of the streams its worker owns."""

    machine: DecodeMachine
    worker_seeds: dict[str, dict[str, int]] = field(default_factory=dict)


def _layout(machine: DecodeMachine, seeds: list[int]) -> dict[str, dict[str, int]]:
    return {model: {name: seeds[index] for name, index in named.items()} for model, named in machine.streams().items()}


def _ar(plan: DecodingPlan, sampling: MachineSampling, seed: int, max_new_tokens: int, budget: int) -> BuiltMachine:
    machine = AutoregressiveMachine(plan.target, max_new_tokens, budget, logprobs=sampling.logprobs)
    return BuiltMachine(machine, _layout(machine, stream_seeds(seed, 1)))


def model_free_proposers(plan: DecodingPlan, sampling: MachineSampling) -> list[Proposer]:
    """sd's model-free proposers, in the order they are asked: the prediction, then prompt lookup."""
    largest, smallest = plan.ngram
    proposers: list[Proposer] = []
    if plan.prediction and sampling.prediction:
        proposers.append(PredictionProposer(sampling.prediction, ngram_max=largest, ngram_min=smallest))
    if plan.proposer == "ngram":
        proposers.append(PromptLookupProposer(sampling.prompt, ngram_max=largest, ngram_min=smallest))
    return proposers


def _speculative(plan: DecodingPlan, sampling: MachineSampling, seed: int, max_new_tokens: int, budget: int) -> BuiltMachine:
    machine = SpeculativeMachine(
        plan.draft, plan.target, method=plan.method, gamma=plan.gamma, num_drafts=plan.num_drafts,
        max_new_tokens=max_new_tokens, context_budget=budget, logprobs=sampling.logprobs, adaptive=plan.adaptive,
        proposers=model_free_proposers(plan, sampling),
    )
    return BuiltMachine(machine, _layout(machine, stream_seeds(seed, 2)))


def _ensemble_kwargs(plan: DecodingPlan, sampling: MachineSampling, seeds: list[int], max_new_tokens: int, budget: int) -> dict:
    return dict(
        ensemble=plan.ensemble, weights=plan.weights, mu=plan.mu, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p, own_source=TorchRandomSource(torch.Generator().manual_seed(seeds[-1])),
        max_new_tokens=max_new_tokens, context_budget=budget, penalties=sampling.penalties, prompt=sampling.prompt,
        logprobs=sampling.logprobs,
    )


def _ensemble(plan: DecodingPlan, sampling: MachineSampling, seed: int, max_new_tokens: int, budget: int) -> BuiltMachine:
    seeds = stream_seeds(seed, len(plan.members) + 1)
    machine = EnsembleMachine(plan.members, **_ensemble_kwargs(plan, sampling, seeds, max_new_tokens, budget))
    return BuiltMachine(machine, _layout(machine, seeds))


def _speculative_ensemble(plan: DecodingPlan, sampling: MachineSampling, seed: int, max_new_tokens: int, budget: int) -> BuiltMachine:
    if plan.proposer not in (None, ALTERNATE):
        return _drafted_ensemble(plan, sampling, seed, max_new_tokens, budget)
    seeds = stream_seeds(seed, len(plan.members) + 1)
    machine = SpeculativeEnsembleMachine(
        plan.members, gammas=plan.gammas, method=plan.method, adaptive=plan.adaptive,
        **_ensemble_kwargs(plan, sampling, seeds, max_new_tokens, budget)
    )
    return BuiltMachine(machine, _layout(machine, seeds))


def _drafted_ensemble(plan: DecodingPlan, sampling: MachineSampling, seed: int, max_new_tokens: int, budget: int) -> BuiltMachine:
    """se with a draft proposer: streams 0..n-1 the members', n the verification, n + 1 a
    proposer that is not a member (:class:`EnsembleDraftMachine`)."""
    seeds = stream_seeds(seed, len(plan.members) + 2)
    kwargs = _ensemble_kwargs(plan, sampling, seeds, max_new_tokens, budget)
    kwargs["own_source"] = TorchRandomSource(torch.Generator().manual_seed(seeds[len(plan.members)]))
    machine = EnsembleDraftMachine(plan.proposer, plan.members, method=plan.method, gamma=plan.gamma,
                                   num_drafts=plan.num_drafts, adaptive=plan.adaptive, **kwargs)
    return BuiltMachine(machine, _layout(machine, seeds))


#: The strategy registry: ``actors.request_schema.Strategy`` value -> machine builder.
STRATEGIES: dict[str, Callable[..., BuiltMachine]] = {
    "ar": _ar,
    "sd": _speculative,
    "multi_draft": _speculative,
    "ensemble": _ensemble,
    "se": _speculative_ensemble,
}


def build_machine(
    plan: DecodingPlan, sampling: MachineSampling, *, seed: int, max_new_tokens: int, context_budget: int
) -> BuiltMachine:
    """The machine of ``plan.strategy`` for one request (``context_budget``: positions left after
    the prompt in the smallest model context of the plan)."""
    return STRATEGIES[plan.strategy](plan, sampling, seed, max_new_tokens, context_budget)
