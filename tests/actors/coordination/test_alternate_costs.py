"""The alternating ensemble's measured member calls and pooled step rates
(actors/coordination/alternate_costs.py)."""

from __future__ import annotations

import pytest

from actors.coordination.alternate_costs import AlternateCallCosts, PooledRates
from actors.coordination.step_costs import CallReport


def _call(model: str, forwards: int, *, call_s: float, first_round_s: float, forward_s: float,
          uniform: bool = True) -> CallReport:
    return CallReport(model=model, tokens_fed=forwards, forwards=forwards, forward_s=forward_s, uniform=uniform,
                      call_s=call_s, first_round_s=first_round_s)


def test_a_step_costs_overhead_plus_first_round_plus_further_rounds():
    costs = AlternateCallCosts()
    for _ in range(3):
        costs.observe_step(1, {"a": 1}, [_call("a", 3, call_s=0.13, first_round_s=0.05, forward_s=0.12)], wall_s=0.15)
        costs.observe_step(1, {"b": 1}, [_call("b", 1, call_s=0.06, first_round_s=0.06, forward_s=0.04)], wall_s=0.08)
    calls = costs.member_call_s(["a", "b"], 1, 3)
    overhead = 0.02  # the median of the steps' seconds outside their calls
    assert calls["a"] == pytest.approx((overhead + 0.05, overhead + 0.09, overhead + 0.13))
    # b never ran a further round: one forward alone (0.04) stands for it
    assert calls["b"] == pytest.approx((overhead + 0.06, overhead + 0.10, overhead + 0.14))


def test_nothing_before_every_member_is_measured_and_prefills_are_left_out():
    costs = AlternateCallCosts()
    costs.observe_step(1, {"a": 1}, [_call("a", 1, call_s=0.5, first_round_s=0.5, forward_s=0.5, uniform=False)], 0.6)
    assert costs.member_call_s(["a"], 1, 2) == {}
    costs.observe_step(1, {"a": 1}, [_call("a", 1, call_s=0.05, first_round_s=0.05, forward_s=0.04)], 0.06)
    assert costs.member_call_s(["a", "b"], 1, 2) == {}
    assert costs.member_call_s(["a"], 1, 2)["a"] == pytest.approx((0.06, 0.10))


def test_pooled_rates_are_tokens_over_seconds_not_a_median_of_steps():
    rates = PooledRates()
    for tokens in (0, 0, 0, 0, 1, 2, 2):  # four steps of seven committed nothing
        rates.observe("speculative", 1, tokens, 0.05)
    assert rates.rate("speculative", 1) == pytest.approx(5 / 0.35)
    assert rates.rate("plain", 1) is None
    assert rates.rate("speculative", 16) == pytest.approx(5 / 0.35)  # the nearest measured bucket


def test_a_probe_forgets_what_the_mode_measured_before():
    rates = PooledRates()
    rates.observe("speculative", 1, 1, 0.5)  # measured while the machine was slow
    rates.forget("speculative", 1)
    assert rates.rate("speculative", 1) is None
    rates.observe("speculative", 1, 1, 0.05)
    assert rates.rate("speculative", 1) == pytest.approx(20.0)
