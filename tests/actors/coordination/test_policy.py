"""How many tokens a plain iteration draws (actors/coordination/policy.py: plain_tokens): 4 alone,
8 in a step of several requests; an ``ar`` request's tokens do not depend on it (the reference tests
run ``ar`` in cohorts against the reference loop, tests/actors/coordination/test_coordinator_reference.py)."""

from __future__ import annotations

from types import SimpleNamespace

from actors.coordination.policy import COHORT_PLAIN_TOKENS, first_token_due, plain_tokens, set_plain_tokens
from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.machines.autoregressive import AutoregressiveMachine
from verifiers.machines.base import AR_TOKENS_PER_ITERATION
from verifiers.machines.speculative import SpeculativeMachine


def test_an_ar_iteration_draws_more_in_a_step_of_several_requests():
    assert plain_tokens(1) == AR_TOKENS_PER_ITERATION == 4
    assert plain_tokens(2) == plain_tokens(16) == COHORT_PLAIN_TOKENS == 8


def test_the_scheduler_sets_an_ar_machines_draws_per_step():
    machine = AutoregressiveMachine("target", max_new_tokens=20)
    (need,) = machine.needs()
    assert need.count == AR_TOKENS_PER_ITERATION
    set_plain_tokens(machine, 1)  # alone: the first token on its own, then 4 an iteration
    assert machine.needs()[0].count == 1
    machine.committed.append(7)
    assert machine.needs()[0].count == AR_TOKENS_PER_ITERATION
    machine.committed.clear()
    set_plain_tokens(machine, 16)
    (need,) = machine.needs()
    assert need.count == COHORT_PLAIN_TOKENS
    assert machine.needs()[0].count == COHORT_PLAIN_TOKENS  # in a step of several: no lone first draw
    machine.committed.extend(range(17))  # 3 tokens left: never more than max_tokens
    assert machine.needs()[0].count == 3
    set_plain_tokens(machine, 1)
    assert machine.needs()[0].count == 3 and machine.plain_tokens == AR_TOKENS_PER_ITERATION


def test_sd_plain_steps_draw_more_only_where_the_choice_weighs_step_costs():
    """An sd plain step's count decides when its next block is drafted: seeded tokens would depend
    on the batch, so only gamma auto weighing measured step costs (whose tokens already depend on
    timings) draws more in a step of several requests."""
    machine = SpeculativeMachine("draft", "target", method="block", gamma=4, num_drafts=1, max_new_tokens=20,
                                 adaptive=AdaptiveGammaSettings(gamma_max=4))
    set_plain_tokens(machine, 16)
    assert machine.plain_tokens == AR_TOKENS_PER_ITERATION
    machine.step_costs = lambda: None  # goodput: the scheduler binds the step's measured costs
    set_plain_tokens(machine, 16)
    assert machine.plain_tokens == COHORT_PLAIN_TOKENS and machine._plain_needs()[0].count == COHORT_PLAIN_TOKENS
    set_plain_tokens(machine, 1)
    assert machine.plain_tokens == AR_TOKENS_PER_ITERATION


def test_the_step_tokens_setting_sets_a_step_of_severals_draws():
    machine = AutoregressiveMachine("target", max_new_tokens=40)
    machine.committed.append(7)
    set_plain_tokens(machine, 16, tokens=3)
    assert plain_tokens(16, 3) == 3 and machine.needs()[0].count == 3
    set_plain_tokens(machine, 1, tokens=3)  # alone: unchanged by the setting
    assert machine.needs()[0].count == AR_TOKENS_PER_ITERATION


def test_a_first_token_is_due_once_the_prompt_is_in_and_no_token_was_made():
    request = SimpleNamespace(prefilling={"target"}, machine=AutoregressiveMachine("target", max_new_tokens=4))
    assert not first_token_due(request)  # still prefilling
    request.prefilling = set()
    assert first_token_due(request)
    request.machine.committed.append(3)
    assert not first_token_due(request)
