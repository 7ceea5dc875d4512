"""Per-member proposal lengths for the alternating proposer of ``se`` (gamma "auto").

Two members propose in turn (Fu et al. 2025, App. B.1 Alg. 1): a call of member ``j`` scores the
other member's queued segment, draws its own bonus token and proposes after it, ``g_j`` tokens in
all (``g_j`` forwards); the segment it scored is then verified against the ensemble rows. Under
the i.i.d. acceptance model (member ``i``'s proposed tokens are each accepted with probability
``a_i`` given the previous ones were) the loop is a three-state renewal process:

* empty queue: the default proposer ``p`` (the longest length, the first on ties) proposes:
  ``C_p(g_p)`` seconds, no token, then ``S_p``;
* ``S_i`` (member ``i``'s segment queued): the other member ``j``'s call, ``C_j(g_j)`` seconds;
  the verification emits ``E_i = sum_{k < g_i} a_i^k`` tokens on average (the accepted prefix,
  plus the correction when one is rejected, none after a fully accepted segment: the next
  segment starts with ``j``'s bonus token); the segment is fully accepted with probability
  ``x_i = a_i^(g_i)`` (then ``S_j``), else the queue is dropped (empty).

From entering ``S_i`` until the queue next empties the expected (seconds, tokens) are
``V_i = c_i + x_i V_j``, so ``V_i = (c_i + x_i c_j) / (1 - x_i x_j)`` with ``c_i = (C_j(g_j),
E_i)``; a cycle from the empty queue is ``(C_p(g_p), 0) + V_p``, and the rate is its tokens over
its seconds (renewal reward). :func:`best_alternate_gammas` maximises it over
``[1, gamma_max]^2``; ``C_m(g)`` is what the scheduler measured a step of member ``m``'s call
drawing ``g`` tokens to cost (:class:`verifiers.adaptive.StepCosts` ``member_call_s``).

Why it stays lossless: the lengths are chosen before the iteration's draws, from measured
seconds and the verdicts already made (never a queued token's value); each iteration is then one
of the fixed-length iterations, whose law is the ensemble's (:mod:`verifiers.adaptive`; exact
enumeration with scripted lengths in ``tests/verifiers/test_ensemble_auto.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from verifiers.adaptive import ALPHA_CEILING, expected_tokens

#: Members the renewal model covers (the n-model chain of Alg. 2 keeps its fixed lengths).
MODELLED_MEMBERS = 2
#: Other lengths than the request's are chosen only when the model expects this much more (relative):
#: the estimates of a short request's acceptance are noisy, and a wrong switch costs more than a
#: small gain brings (served on a shared modelled device, lengths chosen at no margin ran 6% slower
#: than the request's [1, 1]).
SWITCH_MARGIN = 0.05


def _segment(alpha: float, gamma: int) -> tuple[float, float]:
    """``(E, x)`` of a segment of ``gamma`` proposed tokens at acceptance ``alpha``: the tokens its
    verification emits on average and the probability it is accepted whole."""
    alpha = min(max(alpha, 0.0), ALPHA_CEILING)
    return expected_tokens(alpha, gamma - 1), alpha ** gamma


def alternate_rate(gammas: Sequence[int], alphas: Sequence[float], call_s: Sequence[Sequence[float]]) -> float:
    """Expected tokens per second of two members alternating with proposal lengths ``gammas``,
    member ``i``'s tokens accepted at ``alphas[i]``, a step of member ``i`` drawing ``g`` tokens
    costing ``call_s[i][g - 1]`` seconds (the module doc's renewal model)."""
    if len(gammas) != MODELLED_MEMBERS or len(alphas) != MODELLED_MEMBERS or len(call_s) != MODELLED_MEMBERS:
        raise ValueError(f"the alternating model takes {MODELLED_MEMBERS} members, got {len(gammas)} gammas")
    (e0, x0), (e1, x1) = _segment(alphas[0], gammas[0]), _segment(alphas[1], gammas[1])
    t0, t1 = call_s[0][gammas[0] - 1], call_s[1][gammas[1] - 1]  # seconds of member 0's / 1's call
    c = ((t1, e0), (t0, e1))  # entering S_i: the other member's call, then i's segment verified
    x = (x0, x1)
    proposer = 0 if gammas[0] >= gammas[1] else 1
    other = 1 - proposer
    scale = 1.0 / (1.0 - x[proposer] * x[other])
    seconds = (t0 if proposer == 0 else t1) + scale * (c[proposer][0] + x[proposer] * c[other][0])
    tokens = scale * (c[proposer][1] + x[proposer] * c[other][1])
    return tokens / max(seconds, 1e-12)


def best_alternate_gammas(members: Sequence[str], alphas: Sequence[float], member_call_s: Mapping[str, Sequence[float]],
                          gamma_max: int, current: Sequence[int] | None = None) -> list[int] | None:
    """The proposal lengths in ``[1, gamma_max]`` per member with the most expected tokens per
    second (:func:`alternate_rate`; ties go to the shorter total, then the earlier pair), or
    ``current`` unless the best beats it by :data:`SWITCH_MARGIN`; None when the members are not
    two or a member's calls are not measured."""
    if len(members) != MODELLED_MEMBERS or any(name not in member_call_s for name in members):
        return None
    call_s = [member_call_s[name] for name in members]
    longest = min(gamma_max, *(len(seconds) for seconds in call_s))
    if longest < 1:
        return None
    best, best_rate = None, -1.0
    for total in range(2, 2 * longest + 1):
        for g0 in range(max(1, total - longest), min(longest, total - 1) + 1):
            rate = alternate_rate((g0, total - g0), alphas, call_s)
            if rate > best_rate * (1.0 + 1e-12):
                best, best_rate = [g0, total - g0], rate
    if current is not None and all(1 <= g <= longest for g in current) and len(current) == MODELLED_MEMBERS:
        if best_rate <= alternate_rate(current, alphas, call_s) * (1.0 + SWITCH_MARGIN):
            return list(current)
    return best
