"""The measured step costs behind gamma "auto"'s goodput choice (actors/coordination/step_costs.py), and the
choice served: plain steps and blocks chosen from the costs through the real Coordinator and
Scheduler (in-process workers over the fake models), greedy output equal to the target's and the
sampled law the target's (chi-square)."""

from __future__ import annotations


import pytest
import torch

from actors.request_schema import GenerationRequest
from actors.coordination.coordinator import Coordinator
from actors.coordination.step_costs import (
    BOARD_MIN_VERIFICATIONS,
    BOARD_PRIOR_RANGE,
    BOARD_PRIOR_VERIFICATIONS,
    AcceptanceBoard,
    CallReport,
    MIN_OBSERVATIONS,
    MODE_WINDOW,
    WINDOW,
    CostTable,
    ModeRates,
    StepCostModel,
)
from benchmarks.served.runners import LocalActorHandle
from verifiers.adaptive import expected_tokens
from actors.coordination.policy import COHORT_PROBE_EVERY, COHORT_PROBE_EVERY_MAX, EXPLORE_EVERY
from tests.actors.fake_models import FAKE_MODELS, FunctionModelWorker, fake_group_config, run_in_process
from tests.verifiers.test_adaptive import LONG_BLOCKS_WIN, PLAIN_WINS, SHORT_BLOCKS_WIN
from tests.verifiers.tiny_models import chi_square_pvalue, target_law
from verifiers.reference import autoregressive_generate

PROMPT = (1, 2, 3)
CHI_SQUARE_SIGNIFICANCE = 1e-3


# ------------------------------------------------------------------------- the tables
def test_cost_table_interpolates_between_measured_counts_and_scales_outside():
    table = CostTable()
    assert table.estimate(4) is None
    table.observe(16, 0.016)
    table.observe(80, 0.035)
    assert table.estimate(16) == pytest.approx(0.016)
    assert table.estimate(48) == pytest.approx(0.016 + (0.035 - 0.016) * (48 - 16) / (80 - 16))
    assert table.estimate(1) == pytest.approx(0.016 * (1 + 8) / (16 + 8))  # below: a fixed cost of 8 positions
    assert table.estimate(160) > table.estimate(80)


def test_cost_table_reads_the_median_of_a_buckets_recent_observations():
    table = CostTable()
    table.observe(5, 0.010)
    table.observe(5, 0.020)
    assert 0.010 < table.estimate(5) < 0.020
    for _ in range(WINDOW):
        table.observe(5, 0.012)
    table.observe(5, 0.200)  # a forward the machine's other work delayed
    assert table.estimate(5) == pytest.approx(0.012)


def test_a_delayed_forward_does_not_raise_the_longer_forwards():
    """Buckets are read through a monotone envelope: one slow short forward must not make every
    longer forward look as slow (that favoured some blocks by noise)."""
    table = CostTable()
    for _ in range(4):
        table.observe(2, 0.010)
        table.observe(9, 0.020)
    table.observe(2, 0.080)
    assert table.estimate(2) == pytest.approx(0.010)
    assert table.estimate(9) == pytest.approx(0.020)


def test_a_bucket_seen_fewer_than_min_observations_times_is_not_read_beside_measured_ones():
    table = CostTable()
    for _ in range(MIN_OBSERVATIONS):
        table.observe(2, 0.010)
        table.observe(16, 0.030)
    table.observe(6, 0.090)  # seen once
    assert table.estimate(6) == pytest.approx(0.010 + 0.020 * (6 - 2) / (16 - 2))


def _report(model: str, tokens: int, forwards: int, seconds: float, uniform: bool = True) -> CallReport:
    return CallReport(model=model, tokens_fed=tokens, forwards=forwards, forward_s=seconds, uniform=uniform)


def test_model_gives_no_costs_until_both_models_and_a_speculative_step_are_measured():
    model = StepCostModel(plain_tokens=4)
    assert model.costs("draft", "target", batch=1, gamma_max=4) is None
    model.observe_step(1, [_report("draft", 4, 4, 0.004)], 0.0, speculative=False)
    assert model.costs("draft", "target", batch=1, gamma_max=4) is None
    model.observe_step(1, [_report("draft", 4, 4, 0.004), _report("target", 5, 1, 0.008)], 0.015, speculative=True)
    costs = model.costs("draft", "target", batch=1, gamma_max=4)
    assert costs.draft_s == pytest.approx(0.001)
    assert costs.verify_s[3] == pytest.approx(0.008)  # gamma 4: 5 tokens, as measured
    assert costs.overhead_s == pytest.approx(0.003)  # the step's wall time minus its forwards
    assert costs.plain_overhead_s == pytest.approx(0.0)  # as measured (the first step)
    assert costs.plain_tokens == 4


def test_a_calls_own_work_is_charged_to_its_forwards_not_to_the_step():
    """A draft call of 4 forwards (4 ms) that spent 6 ms in the worker (sampling after each
    forward) and a verifying call of 8 ms forward, 10 ms in all (verification): their host work
    scales with the block, so it is charged per forward; the step's overhead is what no call
    covers (hops, the scheduler)."""
    model = StepCostModel(plain_tokens=4)
    draft = CallReport(model="draft", tokens_fed=4, forwards=4, forward_s=0.004, uniform=True, call_s=0.006)
    target = CallReport(model="target", tokens_fed=5, forwards=1, forward_s=0.008, uniform=True, call_s=0.010)
    model.observe_step(1, [draft, target], 0.019, speculative=True)
    costs = model.costs("draft", "target", batch=1, gamma_max=4)
    assert costs.draft_s == pytest.approx(0.0015)
    assert costs.verify_s[3] == pytest.approx(0.010)
    assert costs.overhead_s == pytest.approx(0.003)


def _draft_call(forwards: int, first_s: float, later_s: float) -> CallReport:
    """A draft call of ``forwards`` rounds: the first ``first_s``, each further one ``later_s``."""
    seconds = first_s + (forwards - 1) * later_s
    return CallReport(model="draft", tokens_fed=forwards, forwards=forwards, forward_s=0.8 * seconds, uniform=True,
                      call_s=seconds, first_round_s=first_s)


def test_a_drafts_first_round_is_priced_once_per_block_not_per_token():
    """Served, a draft call's first round costs more than each further one (the call's set-up,
    the accepted tokens it feeds, caches the target's forward evicted). Spread over the block's
    forwards, it made the per-token draft cost depend on the blocks measured: 2-token blocks
    read 1.3 ms a draft, 8-token blocks 0.8 ms, and a chooser that drafted short blocks saw long
    ones as dear. Priced as first round + (g - 1) further rounds, the costs are the same
    whichever blocks were measured."""
    first_s, later_s = 0.0016, 0.0006
    estimates = []
    for blocks in ((2,), (8,), (2, 8, 3)):
        model = StepCostModel(plain_tokens=4)
        for _ in range(MIN_OBSERVATIONS):
            for block in blocks:
                target = _report("target", block + 1, 1, 0.004)
                model.observe_step(1, [_draft_call(block, first_s, later_s), target], 0.02, speculative=True)
        costs = model.costs("draft", "target", batch=1, gamma_max=8)
        assert costs.draft_first_s == pytest.approx(first_s)
        assert costs.draft_s == pytest.approx(later_s)
        estimates.append([costs.draft_seconds(g) for g in range(1, 9)])
    for gamma, seconds in enumerate(estimates[0], start=1):
        assert seconds == pytest.approx(first_s + (gamma - 1) * later_s)
    assert estimates[1] == pytest.approx(estimates[0])
    assert estimates[2] == pytest.approx(estimates[0])


def test_a_single_forward_draft_call_is_a_first_round():
    model = StepCostModel(plain_tokens=4)
    model.observe_step(1, [_draft_call(4, 0.0016, 0.0006), _report("target", 5, 1, 0.004)], 0.02, speculative=True)
    model.observe_step(1, [_draft_call(1, 0.0016, 0.0006), _report("target", 2, 1, 0.004)], 0.02, speculative=True)
    costs = model.costs("draft", "target", batch=1, gamma_max=4)
    assert costs.draft_first_s == pytest.approx(0.0016)
    assert costs.draft_s == pytest.approx(0.0006)


def test_plain_overhead_defaults_to_half_the_speculative_one():
    model = StepCostModel(plain_tokens=4)
    model.observe_step(1, [_report("draft", 4, 4, 0.004), _report("target", 5, 1, 0.008)], 0.015, speculative=True)
    assert model.costs("draft", "target", batch=1, gamma_max=4).plain_overhead_s == pytest.approx(0.0015)


def test_prefill_calls_do_not_enter_the_forward_tables():
    model = StepCostModel(plain_tokens=4)
    model.observe_step(1, [_report("target", 130, 1, 0.05, uniform=False)], 0.06, speculative=False)
    assert "target" not in model.forwards


# ------------------------------------------------------------------- the choice, served
class _ScheduledCosts:
    """A stand-in for the measured costs (timings of fake models are meaningless): a schedule of
    plain-favoured, long-block and short-block costs by the number of steps seen."""

    def __init__(self):
        self.calls = 0

    def costs(self, draft, target, *, batch, gamma_max, num_drafts=1):
        self.calls += 1
        return (LONG_BLOCKS_WIN, PLAIN_WINS, SHORT_BLOCKS_WIN)[self.calls % 3]

    def observe_step(self, *args, **kwargs):
        pass


def _coordinator(goodput: bool) -> Coordinator:
    config = fake_group_config(overlap=False, goodput_gamma=goodput)
    workers = {m.name: LocalActorHandle(FunctionModelWorker(m, config.session_idle_timeout_s)) for m in config.models}
    coordinator = Coordinator(workers, config, export_to_ray=False)
    coordinator.scheduler.policy.cost_model = _ScheduledCosts()
    return coordinator


def _run(coordinator: Coordinator, requests: list[GenerationRequest]) -> list[list]:
    return run_in_process(coordinator, requests)


def _request(seed: int, method: str, *, temperature: float, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"req-{seed}", prompt_ids=list(PROMPT),
        sampling={"max_tokens": max_tokens, "seed": seed, "temperature": temperature},
        speculation={"strategy": "sd", "method": method, "gamma": "auto", "gamma_max": 3},
    )


def _tokens(chunks) -> list[int]:
    assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    return [t for chunk in chunks for t in chunk.token_ids]


@pytest.mark.parametrize("method", ["block", "greedy_block"])
def test_costs_choose_plain_steps_and_blocks_and_greedy_output_is_the_targets(method):
    coordinator = _coordinator(goodput=True)
    # _ScheduledCosts is a schedule by cost call; engine.first_step_tokens' short first steps add
    # calls and shift it. This test is about what the costs choose: first steps draw as many as the rest.
    coordinator.scheduler.first_step_tokens = coordinator.scheduler.policy.step_tokens
    results = _run(coordinator, [_request(seed, method, temperature=0.0, max_tokens=24) for seed in range(4)])
    expected, _ = autoregressive_generate(FAKE_MODELS["target"], PROMPT, 24, temperature=0.0,
                                          generator=torch.Generator().manual_seed(0))
    blocks = set()
    for chunks in results:
        assert _tokens(chunks) == expected
        blocks.update(chunks[-1].stats.draft_lengths)
    assert 0 in blocks and max(blocks) >= 2, blocks


def test_goodput_off_ignores_the_costs():
    coordinator = _coordinator(goodput=False)
    for chunks in _run(coordinator, [_request(seed, "block", temperature=1.0, max_tokens=12) for seed in range(3)]):
        assert 0 not in chunks[-1].stats.draft_lengths
    assert coordinator.scheduler.policy.cost_model.calls == 0


def test_sampled_law_with_costs_choosing_plain_steps_and_blocks():
    """Chi-square of 3-token sequences against the target's exact law (vocab 6), the blocks chosen
    by the costs (plain steps included) through the real scheduler and workers."""
    length, count = 3, 600
    coordinator = _coordinator(goodput=True)
    results = _run(coordinator, [_request(2000 + seed, "block", temperature=1.0, max_tokens=length)
                                 for seed in range(count)])
    samples = [tuple(_tokens(chunks)) for chunks in results]
    assert any(0 in chunks[-1].stats.draft_lengths for chunks in results)
    assert chi_square_pvalue(samples, target_law(FAKE_MODELS["target"], PROMPT, length)) > CHI_SQUARE_SIGNIFICANCE


def test_more_tokens_never_look_cheaper():
    table = CostTable()
    table.observe(3, 0.034)  # a noisy bucket
    table.observe(5, 0.027)
    assert table.estimate(5) == pytest.approx(0.034)
    assert table.estimate(4) == pytest.approx(0.034)


def test_the_acceptance_board_learns_a_pairs_rate():
    board = AcceptanceBoard()
    key = ("draft", "target", "block", 1)
    for _ in range(BOARD_MIN_VERIFICATIONS - 1):
        board.observe(key, 4, 3)  # 3 accepted, then a rejection: rate 3/4
    assert board.acceptance(key) is None  # too few verifications yet
    board.observe(key, 4, 3)
    assert board.acceptance(key) == pytest.approx(0.75)
    for _ in range(200):
        board.observe(key, 4, 4)  # every block accepted in full
    assert board.acceptance(key) == BOARD_PRIOR_RANGE[1]
    assert board.acceptance(("draft", "target", "token", 1)) is None


def test_the_board_measures_what_blocks_yield_where_requests_differ():
    """Half the requests accept every draft, half none: a block of g emits 1 + g/2 tokens on
    average. The pooled rate is 8/9 and the geometric formula at it overstates every block (5.9
    tokens at g = 8 instead of 5); the board's position-by-position estimate does not."""
    board = AcceptanceBoard()
    key = ("draft", "target", "block", 1)
    assert board.expected_tokens(key, 8) is None
    for _ in range(100):
        board.observe(key, 8, 8)
        board.observe(key, 8, 0)
    alpha = board.acceptance(key)
    assert alpha == pytest.approx(8 / 9, abs=0.01)
    measured = board.expected_tokens(key, 8)
    for gamma in range(1, 9):
        assert measured[gamma - 1] == pytest.approx(1 + gamma / 2, rel=0.02)
        assert expected_tokens(alpha, gamma) > 1.15 * measured[gamma - 1]  # the formula overstates by 15-26%
    # Positions never judged take the pooled rate: blocks of 2 only, asked up to 4.
    short = AcceptanceBoard()
    for _ in range(50):
        short.observe(key, 2, 2)
        short.observe(key, 2, 1)
    survival_2 = short.expected_tokens(key, 2)[1] - short.expected_tokens(key, 2)[0]
    rate = short.acceptance(key)
    tokens = short.expected_tokens(key, 4)
    assert tokens[2] - tokens[1] == pytest.approx(survival_2 * rate)
    assert tokens[3] - tokens[2] == pytest.approx(survival_2 * rate * rate)


def _state(coordinator, seed: int):
    """The scheduler's state of a block request of ``seed`` (not submitted)."""
    request = _request(seed, "block", temperature=1.0, max_tokens=12)
    return coordinator.preparer.request_state(request, coordinator.preparer.plan(request), list(PROMPT), 6, 64)


def _admitted_cohort(coordinator, requests: int = 3):
    """The first cohort, running ``requests`` block requests the policy admitted (seeds 0..)."""
    cohort = coordinator.scheduler.cohorts[0]
    for seed in range(requests):
        request = _state(coordinator, seed)
        coordinator.scheduler.policy.admit(request)
        cohort.running.append(request)
    return cohort


def test_a_new_auto_request_starts_from_the_groups_acceptance():
    """With goodput on, requests admitted after the pair was verified often enough start from the
    board's rate (fixed at admission, before their first draft); the first ones from the settings' prior."""
    coordinator = _coordinator(goodput=True)
    first = _run(coordinator, [_request(seed, "block", temperature=1.0, max_tokens=24) for seed in range(8)])
    assert all(chunks[-1].error is None for chunks in first)
    board = coordinator.scheduler.policy.acceptance_board
    alpha = board.acceptance(("draft", "target", "block", 1))
    assert alpha is not None
    state = _state(coordinator, 99)
    assert state.machine.chooser.settings.prior_acceptance != alpha
    coordinator.scheduler.policy.start_from_group_acceptance(state)
    assert state.machine.chooser.settings.prior_acceptance == pytest.approx(alpha)
    # ... counted as BOARD_PRIOR_VERIFICATIONS verifications at that rate, next to its own counts.
    assert state.machine.chooser.settings.prior_weight == pytest.approx(BOARD_PRIOR_VERIFICATIONS / (1.0 - alpha))


def test_mode_rates_read_the_nearest_measured_batch():
    rates = ModeRates()
    assert rates.rate("plain", 16) is None
    rates.observe("plain", 16, 64, 0.1)  # 640 tok/s
    rates.observe("speculative", 4, 30, 0.1)
    assert rates.rate("plain", 16) == pytest.approx(640.0)
    assert rates.rate("plain", 2) == pytest.approx(640.0)  # the only measured bucket
    rates.observe("plain", 16, 32, 0.1)
    assert rates.rate("plain", 16) == pytest.approx((640.0 + 320.0) / 2)  # the median of the recent steps
    for _ in range(MODE_WINDOW - 1):
        rates.observe("plain", 16, 90, 0.1)
    assert rates.rate("plain", 16) == pytest.approx(900.0)  # a slow first step is outvoted, then forgotten
    assert rates.rate("speculative", 3) == pytest.approx(300.0)


def test_a_cohort_steps_in_the_faster_mode_and_probes_the_other():
    coordinator = _coordinator(goodput=True)
    scheduler = coordinator.scheduler
    requests = [_state(coordinator, seed) for seed in range(3)]
    cohort = scheduler.cohorts[0]
    for request in requests:
        request.machine.step_costs = lambda: None
        cohort.running.append(request)
    scheduler.policy.mode_rates.observe("plain", 3, 12, 0.1)  # 120 tok/s
    scheduler.policy.mode_rates.observe("speculative", 3, 9, 0.05)  # 180 tok/s
    modes = [scheduler.policy.decide(cohort).mode for _ in range(4 * COHORT_PROBE_EVERY + 3)]
    assert [i for i, mode in enumerate(modes) if mode == "plain"] == [COHORT_PROBE_EVERY, 3 * COHORT_PROBE_EVERY + 1]
    # the first probe after COHORT_PROBE_EVERY speculative steps, the next after twice as many: each confirmed
    assert cohort.probe_every == 4 * COHORT_PROBE_EVERY
    assert scheduler.policy.decide(type(cohort)(index=9, running=cohort.running[:1])).mode == "any"  # alone


def test_probes_back_off_while_they_confirm_and_start_over_when_the_faster_mode_changes():
    coordinator = _coordinator(goodput=True)
    policy = coordinator.scheduler.policy
    cohort = _admitted_cohort(coordinator)
    policy.mode_rates.observe("plain", 3, 12, 0.1)  # 120 tok/s
    policy.mode_rates.observe("speculative", 3, 9, 0.05)  # 180 tok/s
    probes = 0
    for _ in range(2000):
        if policy.decide(cohort).mode == "plain":
            probes += 1
    assert cohort.probe_every == COHORT_PROBE_EVERY_MAX  # 16, 32, 64, 128, then every 128
    assert probes < 2000 / COHORT_PROBE_EVERY / 2
    while cohort.probe_steps_left or cohort.probed_from:  # not in a probe
        policy.decide(cohort)
    for _ in range(MODE_WINDOW):  # plain now measured faster: the next decision steps plain, and starts over
        policy.mode_rates.observe("plain", 3, 100, 0.1)
    assert policy.decide(cohort).mode == "plain" and cohort.probe_every == COHORT_PROBE_EVERY


def test_the_policy_returns_its_decision_and_the_machines_read_that_one():
    """A speculative step's decision names the block; each gamma-auto request's costs carry the
    decision of its own step, also after the policy decided another step (the other cohort's)."""
    coordinator = _coordinator(goodput=True)
    policy = coordinator.scheduler.policy
    requests = [_state(coordinator, seed) for seed in range(4)]
    first, second = coordinator.scheduler.cohorts[0], type(coordinator.scheduler.cohorts[0])(index=1)
    for request in requests:
        policy.admit(request)
    first.running, second.running = requests[:2], requests[2:]
    policy.mode_rates.observe("plain", 2, 4, 0.1)  # 40 tok/s
    policy.mode_rates.observe("speculative", 2, 9, 0.05)  # 180 tok/s
    decision = policy.decide(first)
    assert decision.mode == "speculative" and decision.block >= 1 and decision.batch == 2
    policy.mode_rates.observe("plain", 2, 400, 0.1)  # now plain wins: the other cohort steps plain
    assert policy.decide(second).mode == "plain"
    costs = requests[0].machine.step_costs()
    assert (costs.mode, costs.block) == (decision.mode, decision.block)
    assert requests[2].machine.step_costs().mode == "plain"


def test_a_speculative_probe_after_plain_steps_runs_two_steps_and_only_the_second_counts():
    """The first speculative step after plain ones feeds the draft the plain steps' tokens: its
    yield is not the mode's (counted, it kept a cohort plain where speculative steps were faster)."""
    coordinator = _coordinator(goodput=True)
    policy = coordinator.scheduler.policy
    cohort = _admitted_cohort(coordinator)
    policy.mode_rates.observe("plain", 3, 12, 0.05)  # 240 tok/s
    policy.mode_rates.observe("speculative", 3, 9, 0.05)  # 180 tok/s
    decisions = [policy.decide(cohort) for _ in range(COHORT_PROBE_EVERY + 3)]
    assert [d.mode for d in decisions] == ["plain"] * COHORT_PROBE_EVERY + ["speculative", "speculative", "plain"]
    assert [d.representative for d in decisions[COHORT_PROBE_EVERY:]] == [False, True, True]
    before = policy.mode_rates.rate("speculative", 3)
    policy.observe_mode(decisions[COHORT_PROBE_EVERY], 3, 3, 0.05)  # the catch-up step: not counted
    assert policy.mode_rates.rate("speculative", 3) == before
    policy.observe_mode(decisions[COHORT_PROBE_EVERY + 1], 3, 15, 0.05)
    assert policy.mode_rates.rate("speculative", 3) > before


def test_every_explore_every_th_speculative_step_drafts_a_neighbour_of_the_best_block():
    """The token counts the choice avoids are measured again now and then (the next longer block,
    then the next shorter one); the other steps draft the best block."""
    coordinator = _coordinator(goodput=True)
    policy = coordinator.scheduler.policy
    policy.cost_model = StepCostModel(plain_tokens=4)
    for _ in range(MIN_OBSERVATIONS):  # a draft forward 1 ms, a verifying forward 10 ms + 1 ms per token
        for tokens in (3, 9, 15, 24):
            policy.cost_model.observe_step(3, [_report("draft", 3, 1, 0.001), _report("target", tokens, 1, 0.010 + 0.001 * tokens)],
                                           0.02 + 0.001 * tokens, speculative=True)
    cohort = _admitted_cohort(coordinator)
    blocks = [policy._cohort_block(cohort) for _ in range(2 * EXPLORE_EVERY)]
    best = blocks[0]
    assert 1 < best < len(policy.cost_model.costs("draft", "target", batch=3, gamma_max=8).verify_s)
    assert blocks[EXPLORE_EVERY - 1] == best + 1 and blocks[2 * EXPLORE_EVERY - 1] == best - 1
    assert all(block == best for i, block in enumerate(blocks) if (i + 1) % EXPLORE_EVERY)


def test_a_step_giving_a_request_its_first_token_draws_fewer_and_still_stands_for_its_mode():
    """engine.first_step_tokens: a newcomer's first chunk after few draws; that step's yield is
    taken as its mode's rate (under arrivals such steps are most of a mode's steps)."""
    coordinator = _coordinator(goodput=True)
    scheduler = coordinator.scheduler
    cohort = _admitted_cohort(coordinator)
    scheduler.policy.mode_rates.observe("plain", 3, 24, 0.1)  # plain measured faster
    scheduler.policy.mode_rates.observe("speculative", 3, 9, 0.1)
    decision = scheduler._schedule(cohort)
    assert decision.mode == "plain" and decision.representative
    assert all(r.machine.plain_tokens == scheduler.first_step_tokens < scheduler.policy.step_tokens for r in cohort.running)
    for request in cohort.running:  # each has its first token: the next step draws step_tokens
        request.machine.committed.append(1)
    decision = scheduler._schedule(cohort)
    assert decision.representative and all(r.machine.plain_tokens == scheduler.policy.step_tokens for r in cohort.running)
