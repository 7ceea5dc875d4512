"""gamma "auto" of se's alternating proposer choosing per-member lengths
(verifiers/alternate_gammas.py, verifiers/machines/ensemble.py): the renewal model, and the
ensemble law under lengths that change from iteration to iteration, proved by exact enumeration
(TV < 1e-9) with scripted measured costs, the machine's own chooser reading them."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from tests.verifiers.test_ensemble import EXACT_CASES, EXACT_TV, PROMPT, _ensemble_law, _members
from verifiers.adaptive import AdaptiveGammaSettings, StepCosts
from verifiers.alternate_gammas import alternate_rate, best_alternate_gammas
from verifiers.reference.ensemble import ensemble_generate
from verifiers.reference.exact import exact_law, total_variation


def _calls(overhead: float, forward: float, gamma_max: int = 8) -> tuple[float, ...]:
    return tuple(overhead + g * forward for g in range(1, gamma_max + 1))


def test_one_token_each_at_certain_acceptance_emits_a_token_per_call():
    # g = (1, 1), alpha ~ 1: after the first proposal every call commits one token
    rate = alternate_rate((1, 1), (1.0, 1.0), (_calls(0.0, 0.04), _calls(0.0, 0.04)))
    assert rate == pytest.approx(25.0, rel=1e-6)


def test_rate_matches_a_simulated_alternating_loop():
    """The renewal rate against the loop's expectation computed by hand for g = (2, 1):
    empty -> member 0 proposes 2 (t0); S0: member 1's call (t1), E = 1 + a0, x = a0^2;
    S1: member 0's call (t0), E = 1, x = a1."""
    a0, a1, t0, t1 = 0.7, 0.6, 0.09, 0.05
    x0, x1 = a0 ** 2, a1
    v0 = ((t1 + x0 * t0) / (1 - x0 * x1), ((1 + a0) + x0 * 1.0) / (1 - x0 * x1))
    expected = v0[1] / (t0 + v0[0])
    calls = ((0.05, t0), (t1, 0.1))
    assert alternate_rate((2, 1), (a0, a1), calls) == pytest.approx(expected, rel=1e-9)


def test_short_lengths_when_calls_are_dear_longer_when_the_call_overhead_dominates():
    fixed_heavy = {"a": _calls(0.20, 0.01), "b": _calls(0.20, 0.01)}
    forward_heavy = {"a": _calls(0.0, 0.04), "b": _calls(0.0, 0.04)}
    assert best_alternate_gammas(["a", "b"], [0.9, 0.9], forward_heavy, 8) == [1, 1]
    longer = best_alternate_gammas(["a", "b"], [0.9, 0.9], fixed_heavy, 8)
    assert sum(longer) > 4


def test_no_choice_before_every_member_is_measured_or_for_three_members():
    calls = {"a": _calls(0.0, 0.04)}
    assert best_alternate_gammas(["a", "b"], [0.8, 0.8], calls, 4) is None
    assert best_alternate_gammas(["a", "b", "c"], [0.8] * 3, {**calls, "b": calls["a"], "c": calls["a"]}, 4) is None


def _costs(mode: str, calls: dict) -> StepCosts:
    return StepCosts(draft_s=0.0, verify_s=(0.0,), overhead_s=0.0, plain_s=0.0, plain_overhead_s=0.0, plain_tokens=1,
                     mode=mode, member_call_s=calls)


#: Scripted measurements (a function of the machine's past): member 0 cheap, member 1 cheap,
#: call overheads that favour long segments, nothing measured, a plain step.
COST_SCRIPT = (
    ("speculative", {"member0": (0.01, 0.02, 0.03), "member1": (0.5, 1.0, 1.5)}),
    ("any", {"member0": (0.5, 1.0, 1.5), "member1": (0.01, 0.02, 0.03)}),
    ("speculative", {"member0": (1.0, 1.01, 1.02), "member1": (1.0, 1.01, 1.02)}),
    ("speculative", {}),
    ("plain", {}),
)


class _CostScript:
    """The costs of each step from the script, indexed by the machine's past (iterations so far
    and the tokens committed); the machine's own chooser turns them into lengths."""

    def __init__(self, machine):
        self.machine = machine
        self.iterations = 0
        self.chosen: set[tuple[int, ...]] = set()

    def __call__(self) -> StepCosts:
        self.iterations += 1
        self.chosen.add(tuple(self.machine.chosen_gammas))
        mode, calls = COST_SCRIPT[(self.iterations + sum(self.machine.committed)) % len(COST_SCRIPT)]
        return _costs(mode, calls)


@pytest.mark.parametrize("method", ["token", "block"])
def test_lengths_chosen_from_scripted_costs_keep_the_ensemble_law(method):
    _, vocabs, gammas, length, ensemble_args, seed = EXACT_CASES[1]  # 2 members, vocab 2, 4 tokens
    model_fns = _members(vocabs, seed=seed)
    chosen: set[tuple[int, ...]] = set()
    scripts: list[_CostScript] = []

    def script(machine) -> _CostScript:
        scripts.append(_CostScript(machine))
        return scripts[-1]

    def procedure(source) -> Hashable:
        tokens, stats = ensemble_generate(model_fns, PROMPT, length, generator=source, gammas=(1, 1), method=method,
                                          adaptive=AdaptiveGammaSettings(gamma_max=3), step_costs=script,
                                          **ensemble_args)
        chosen.update(scripts[-1].chosen)
        return tuple(tokens)

    law = exact_law(procedure, max_leaves=50_000)
    assert len({lengths for lengths in chosen if lengths != (1, 1)}) >= 2, chosen  # the lengths really changed
    assert total_variation(law, _ensemble_law(model_fns, length, **ensemble_args)) < EXACT_TV


def test_negative_control_a_choice_that_reads_a_queued_token_fails():
    """A step that turns plain (dropping the queue) when the last queued token is 0 reads a value
    no choice may read: the enumeration sees the law change."""
    _, vocabs, _, length, ensemble_args, seed = EXACT_CASES[1]
    model_fns = _members(vocabs, seed=seed)
    calls = {"member0": (0.01, 0.02, 0.03), "member1": (0.01, 0.02, 0.03)}

    def peeking(machine):
        def costs() -> StepCosts:
            queued = machine.queue.tokens()
            return _costs("plain" if queued and queued[-1] == 0 else "speculative", calls)
        return costs

    def procedure(source) -> Hashable:
        tokens, _ = ensemble_generate(model_fns, PROMPT, length, generator=source, gammas=(1, 1), method="token",
                                      adaptive=AdaptiveGammaSettings(gamma_max=3), step_costs=peeking, **ensemble_args)
        return tuple(tokens)

    law = exact_law(procedure, max_leaves=50_000)
    assert total_variation(law, _ensemble_law(model_fns, length, **ensemble_args)) > 1e-3


def test_the_requests_lengths_stay_unless_others_are_clearly_faster():
    calls = {"a": _calls(0.03, 0.04), "b": _calls(0.03, 0.04)}
    free = best_alternate_gammas(["a", "b"], [0.75, 0.75], calls, 8)
    assert free == [1, 2]  # a little faster than (1, 1) here
    assert alternate_rate(free, [0.75, 0.75], list(calls.values())) < 1.05 * alternate_rate((1, 1), [0.75, 0.75], list(calls.values()))
    assert best_alternate_gammas(["a", "b"], [0.75, 0.75], calls, 8, current=(1, 1)) == [1, 1]
    assert best_alternate_gammas(["a", "b"], [0.75, 0.75], calls, 8, current=(4, 4)) == free  # (4, 4) is far slower
