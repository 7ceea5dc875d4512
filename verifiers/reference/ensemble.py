"""Reference ensemble loops: the standard ensemble and the speculative ensemble (SE).

Paper: Fu et al., "Speculative Ensemble: Fast Large Language Model Ensemble via Speculation"
(2025), arXiv:2502.01662: Sec. 3.2 (verification against the ensemble law), Sec. 3.3 + App. B.1
Alg. 1 (alternate proposal framework), Sec. 3.4 + App. B.2 Alg. 2 (n models). Slow and obviously
correct: every row is recomputed from the full context (no caches). The distributed coordinator
must reproduce :func:`ensemble_generate` token for token (same seed, same streams, same calls in
the same order) and the tests prove its law exact by enumeration.

Both loops take ``model_fns``: one function per member mapping the full context (prompt
included) as a tuple of token ids to logits ``[V_i]``. The vocabularies are truncated to the
shared one (``V = min_i V_i``, read from each member's logits on the prompt: the prefill every
member does anyway, not counted in ``model_calls``). Rows come from
:func:`verifiers.penalties.penalized_probs`: a member's own logits for its proposals, the
ensemble's logits (``EnsembleFunction.logits``) for verification, both with the same
``temperature`` / ``top_k`` / ``top_p`` and penalties (see :mod:`verifiers.machines`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from verifiers.ensemble import SEGMENT_METHODS, EnsembleKind, VerifyMethod, make_ensemble, shared_vocab_logits
from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.reference.executor import LocalExecutor, layout_sources, run_machine
from verifiers.machines.ensemble import EnsembleMachine, SpeculativeEnsembleMachine
from verifiers.machines.ensemble_draft import EnsembleDraftMachine
from verifiers.penalties import NO_PENALTIES, Penalties, penalized_probs
from verifiers.randomness import RandomSource, split_sources

logger = logging.getLogger(__name__)

ModelFn = Callable[[tuple[int, ...]], torch.Tensor]


def ensemble_next_token_probs(
    model_fns: Sequence[ModelFn],
    *,
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    penalties: Penalties = NO_PENALTIES,
    prompt: Sequence[int] = (),
) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """The ensemble law as a function of the context: ``context -> row [V]`` (what every
    ensemble loop must reproduce; feed it to :func:`verifiers.reference.exact.sequence_law`). With
    penalties, the tokens after ``prompt`` are the generated ones."""
    function = make_ensemble(ensemble, len(model_fns), weights=weights, mu=mu)
    prompt = tuple(prompt)

    def next_token_probs(context: tuple[int, ...]) -> torch.Tensor:
        member_logits = shared_vocab_logits([torch.as_tensor(fn(tuple(context))) for fn in model_fns])  # [n, V]
        logits = function.logits(member_logits)[None]  # [1, V]
        generated = [tuple(context)[len(prompt):]]
        return penalized_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, penalties=penalties,
                               prompt=prompt, generated=generated)[0]

    return next_token_probs


def ensemble_autoregressive_generate(
    model_fns: Sequence[ModelFn],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
    penalties: Penalties = NO_PENALTIES,
) -> tuple[list[int], dict]:
    """The standard (non-speculative) ensemble: every member scores every token.

    Returns ``(tokens, stats)``: exactly ``max_new_tokens`` ids and ``stats["model_calls"] =
    [max_new_tokens] * n``.

    Random-stream contract: ``sources = split_sources(generator, n + 1)`` (the SE layout of
    ``verifiers.randomness.stream_seeds``); every token is ONE ``sources[n].categorical(row)``
    with ``row [V]`` the ensemble row after the current context. Streams 0..n-1 are unused.
    """
    _check_count(max_new_tokens)
    sources = split_sources(generator, len(model_fns) + 1)
    machine = EnsembleMachine(
        _member_names(model_fns), ensemble=ensemble, weights=weights, mu=mu, temperature=temperature, top_k=top_k,
        top_p=top_p, own_source=sources[-1], max_new_tokens=max_new_tokens, penalties=penalties, prompt=prompt,
    )
    generated = run_machine(machine, _executor(machine, model_fns, prompt, sources, temperature, top_k, top_p, penalties))
    return generated, {"model_calls": [max_new_tokens] * len(model_fns)}


def ensemble_generate(
    model_fns: Sequence[ModelFn],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    gammas: Sequence[int],
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    method: VerifyMethod = "token",
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
    penalties: Penalties = NO_PENALTIES,
    adaptive: AdaptiveGammaSettings | None = None,
    step_costs: Callable[[SpeculativeEnsembleMachine], Callable[[], object]] | None = None,
) -> tuple[list[int], dict]:
    """Speculative ensemble (arXiv:2502.01662): lossless sampling from the ensemble law.

    ``gammas[i]`` is member i's proposal length (>= 1). ``ensemble``: "weighted" (``weights``,
    default uniform) or "contrastive" (two members: ``model_fns[0]`` expert, ``model_fns[1]``
    amateur, strength ``mu``). ``method``: "token" or "block" verification of each segment
    against the ensemble rows (:func:`verifiers.ensemble.verify_segment`).

    Returns ``(tokens, stats)``: exactly ``max_new_tokens`` generated ids and a dict with
    ``model_calls`` (per member: one per scoring call, one per proposed token; a bonus token
    comes with its scoring call), ``accepted`` (accepted tokens per verification),
    ``segment_lengths`` (length of each verified segment), ``proposers`` (the member whose
    segment each verification checked) and ``verifications``.

    The loop (Alg. 2 with n members; n = 2 is Alg. 1's alternate proposal framework). State:
    the committed context, and a queue of unverified segments, each drawn by one member; every
    member holds rows for a prefix of the queue (its *coverage*). ``d`` = the default proposer
    = the member with the largest gamma, the first on ties. ``room`` = ``max_new_tokens`` -
    committed - queued: no token is ever drawn past the requested length.

    1. Queue empty (start, or after a rejection): member ``d`` PROPOSES ``min(gamma_d, room)``
       tokens one at a time; each step computes its row after context + queued tokens and draws
       the token with ONE ``sources[d].categorical(row)`` (``row [V]``). One call per token.
    2. Otherwise member ``i`` = the member with the smallest coverage (the first on ties; it is
       always a member with coverage 0, i.e. none of whose rows is queued) SCORES: one call
       computing its rows at every queued position plus the row after the queue. If ``room >=
       1`` it then draws its bonus token from that last row with ONE ``sources[i].categorical``
       and PROPOSES ``min(gamma_i, room) - 1`` more tokens as in step 1 with ``sources[i]``
       (one call each); the bonus plus these are member i's segment.
    3. While every member covers the first segment: VERIFY it with ONE call
       ``verify_segment(tokens [1, g], proposal_probs [1, g, V], ensemble_probs [1, g, V],
       next_tokens [1], method=method, generator=sources[n])``: proposal rows are the
       producer's own rows, ensemble rows combine every member's rows at those positions,
       ``next_tokens`` is the head of the second segment (PAD_TOKEN if none). Fully accepted:
       commit the g tokens and drop the segment and everyone's rows for it (the member that
       drew it now covers nothing and scores next). Otherwise commit the accepted prefix and
       the correction token and clear the queue and every member's rows.
    4. Repeat until ``max_new_tokens`` tokens are committed.

    Random-stream contract: ``sources = split_sources(generator, n + 1)``; member i's draws
    (proposals and bonus tokens, in the order above) use ``sources[i]``; every verification uses
    ``sources[n]`` through :func:`verify_segment` (the registry verifier's own draw order).

    ``adaptive`` (gamma "auto") with ``step_costs(machine)``, the machine's ``step_costs``
    callable (tests script the choice through it): at an empty queue a step whose costs name
    the mode ``plain`` is the plain ensemble's, ONE ``sources[n].categorical(row)``
    (``stats["plain_steps"]`` counts them), unverified queued tokens dropped
    (``stats["dropped_tokens"]``).

    Deviation from Alg. 2 as printed: after a rejection the printed pseudocode lets the scoring
    member propose ``gamma_i - 1`` tokens; the text (Sec. 3.4 / App. B.2, step 6) and this loop
    restart from the default proposer. Both are exact; see docs/ensembles.md.
    """
    _check_count(max_new_tokens)
    num_members = len(model_fns)
    gammas = _checked_gammas(gammas, num_members)
    if method not in SEGMENT_METHODS:
        raise ValueError(f"method must be one of {list(SEGMENT_METHODS)}, got {method!r}")
    sources = split_sources(generator, num_members + 1)
    machine = SpeculativeEnsembleMachine(
        _member_names(model_fns), gammas=gammas, method=method, ensemble=ensemble, weights=weights, mu=mu,
        temperature=temperature, top_k=top_k, top_p=top_p, own_source=sources[-1], max_new_tokens=max_new_tokens,
        penalties=penalties, prompt=prompt, adaptive=adaptive,
    )
    if step_costs is not None:
        machine.step_costs = step_costs(machine)
    executor = _executor(machine, model_fns, prompt, sources, temperature, top_k, top_p, penalties)
    generated = run_machine(machine, executor)
    stats: dict = {
        "model_calls": [executor.model_calls[name] for name in machine.members],
        "accepted": list(machine.accepted_lengths),
        "segment_lengths": list(machine.segment_lengths),
        "proposers": list(machine.proposers),
        "verifications": len(machine.accepted_lengths),
        "plain_steps": machine.plain_steps,
        "dropped_tokens": machine.dropped_tokens,
    }
    logger.debug("ensemble_generate(%s, %s): %s", ensemble, method, stats)
    return generated, stats


def ensemble_draft_generate(
    model_fns: Sequence[ModelFn],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    proposer: int | ModelFn,
    gamma: int,
    method: str = "block",
    num_drafts: int = 1,
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
    penalties: Penalties = NO_PENALTIES,
    adaptive: AdaptiveGammaSettings | None = None,
    step_costs: Callable[[EnsembleDraftMachine], Callable[[], object]] | None = None,
) -> tuple[list[int], dict]:
    """Speculative ensemble with a draft proposer (Speculative Ensemble, arXiv:2502.01662, Sec. 3.2: "WE-SD" / "CD-SD"):
    speculative decoding (:func:`verifiers.reference.speculative_generate`) with the ensemble law
    as the target. ``proposer``: a member's index (its draft rows are its member rows) or a
    separate draft model's function. ``method``: any single-draft rule of ``sd`` (token, block,
    greedy_block) or a multi-draft rule with ``num_drafts`` K. ``adaptive``: gamma "auto"
    (``gamma`` unused); ``step_costs(machine)``: the machine's ``step_costs`` callable (tests
    script the choice sequence through it, plain ensemble steps included).

    Returns ``(tokens, stats)``: exactly ``max_new_tokens`` ids and ``model_calls`` (per member,
    then the draft's when it is not a member), ``accepted``, ``draft_lengths`` (0: a plain step)
    and ``iterations``.

    Random-stream contract: ``sources = split_sources(generator, n + 2)``; the proposer draws
    from ``sources[i]`` when it is member i, else from ``sources[n + 1]`` (at position j of a
    block ONE ``categorical(rows [K, V])``, a member proposer drawing ``gamma + 1`` positions);
    every verification and every plain step's draw uses ``sources[n]``.
    """
    _check_count(max_new_tokens)
    names = _member_names(model_fns)
    functions = dict(zip(names, model_fns))
    if isinstance(proposer, int):
        proposer_name = names[proposer]
    else:
        proposer_name = "draft"
        functions[proposer_name] = proposer
    sources = split_sources(generator, len(model_fns) + 2)
    machine = EnsembleDraftMachine(
        proposer_name, names, method=method, gamma=gamma, num_drafts=num_drafts, ensemble=ensemble, weights=weights,
        mu=mu, temperature=temperature, top_k=top_k, top_p=top_p, own_source=sources[len(model_fns)],
        max_new_tokens=max_new_tokens, penalties=penalties, prompt=prompt, adaptive=adaptive,
    )
    if step_costs is not None:
        machine.step_costs = step_costs(machine)
    executor = _executor(machine, list(functions.values()), prompt, sources, temperature, top_k, top_p, penalties,
                         names=list(functions))
    generated = run_machine(machine, executor)
    stats: dict = {
        "model_calls": [executor.model_calls[name] for name in functions],
        "accepted": list(machine.accepted_lengths),
        "draft_lengths": list(machine.draft_lengths),
        "iterations": len(machine.draft_lengths),
    }
    logger.debug("ensemble_draft_generate(%s, %s): %s", ensemble, method, stats)
    return generated[:max_new_tokens], stats


def _member_names(model_fns: Sequence[ModelFn]) -> list[str]:
    return [f"member{i}" for i in range(len(model_fns))]


def _executor(
    machine: EnsembleMachine | SpeculativeEnsembleMachine,
    model_fns: Sequence[ModelFn],
    prompt: Sequence[int],
    sources: list[RandomSource],
    temperature: float,
    top_k: int,
    top_p: float,
    penalties: Penalties,
    names: Sequence[str] | None = None,
) -> LocalExecutor:
    """The members (``names``: the models of ``model_fns``, default the machine's members) as
    functions on the shared vocabulary (``V = min_i V_i``, read from each model's logits on the
    prompt: the prefill every model does anyway, not counted)."""
    prompt = tuple(int(t) for t in prompt)
    prompt_logits = [torch.as_tensor(fn(prompt)) for fn in model_fns]
    for i, logits in enumerate(prompt_logits):
        if logits.dim() != 1:
            raise ValueError(f"member {i} returned logits of shape {tuple(logits.shape)}; expected [V]")
    vocab = shared_vocab_logits(prompt_logits).shape[-1]
    return LocalExecutor(
        dict(zip(names if names is not None else machine.members, model_fns)),
        prompt,
        layout_sources(machine.streams(), sources),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        vocab_limit=vocab,
        penalties=penalties,
    )


def _check_count(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")


def _checked_gammas(gammas: Sequence[int], num_members: int) -> tuple[int, ...]:
    gammas = tuple(gammas)
    if len(gammas) != num_members:
        raise ValueError(f"expected {num_members} gammas (one per member), got {len(gammas)}: {list(gammas)}")
    for gamma in gammas:
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"every gamma must be an int >= 1, got {list(gammas)}")
    return gammas
