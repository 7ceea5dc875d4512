"""Adaptive draft length (``gamma: "auto"``, verifiers/adaptive.py): the rule, and proof by exact
enumeration that choosing each block from the request's past keeps every lossless rule exact.

The enumeration cases are chosen so the chosen blocks really differ between branches of the
choice tree (asserted): a test where every branch drafts the same gamma would prove nothing
beyond the fixed-gamma tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.verifiers.tiny_models import model_pair, target_law
from verifiers.adaptive import AdaptiveGamma, AdaptiveGammaSettings, StepCosts, best_block, best_gamma, expected_tokens
from verifiers.reference.exact import exact_law, total_variation
from verifiers.reference.executor import LocalExecutor, layout_sources, run_machine
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.randomness import split_sources
from verifiers.reference import speculative_generate

PROMPT = (1,)
EXACT_TOLERANCE = 1e-9

# A prior and cost that make the first block 1 and move the next ones with each acceptance.
VARYING = dict(draft_cost_ratio=0.3, prior_acceptance=0.6, prior_weight=1.0, decay=1.0)


# ------------------------------------------------------------------------------- the rule
def test_expected_tokens_is_the_geometric_sum():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for gamma in (1, 2, 5):
            direct = sum(alpha**i for i in range(gamma + 1))
            assert expected_tokens(alpha, gamma) == pytest.approx(direct, rel=1e-6)


def test_best_gamma_grows_with_acceptance_and_shrinks_with_draft_cost():
    by_alpha = [best_gamma(alpha, 16, 0.15) for alpha in (0.1, 0.5, 0.7, 0.9, 0.97)]
    assert by_alpha == sorted(by_alpha) and by_alpha[0] == 1 and by_alpha[-1] > 6
    by_cost = [best_gamma(0.8, 16, cost) for cost in (0.01, 0.1, 0.5, 2.0)]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[-1] == 1
    assert best_gamma(0.999, 5, 0.0) == 5  # capped at gamma_max


def test_best_gamma_maximises_tokens_per_unit_time():
    for alpha in (0.2, 0.55, 0.85):
        chosen = best_gamma(alpha, 10, 0.2)
        rates = [expected_tokens(alpha, g) / (0.2 * g + 1.0) for g in range(1, 11)]
        assert rates[chosen - 1] == pytest.approx(max(rates))


def test_chooser_follows_the_request_acceptance():
    chooser = AdaptiveGamma(AdaptiveGammaSettings(gamma_max=8, draft_cost_ratio=0.15))
    start = chooser.choose()
    for _ in range(6):
        chooser.observe(chooser.choose(), chooser.choose())  # every block accepted in full
    assert chooser.choose() > start
    high = chooser.choose()
    chooser.observe(high, 0)
    assert chooser.choose() <= high
    for _ in range(20):
        chooser.observe(chooser.choose(), 0)  # every block rejected at once
    assert chooser.choose() == 1


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("gamma_max", {"gamma_max": 0}),
        ("draft_cost_ratio", {"gamma_max": 4, "draft_cost_ratio": -1.0}),
        ("prior_acceptance", {"gamma_max": 4, "prior_acceptance": 1.5}),
        ("prior_weight", {"gamma_max": 4, "prior_weight": 0.0}),
        ("decay", {"gamma_max": 4, "decay": 0.0}),
    ],
)
def test_bad_settings_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        AdaptiveGammaSettings(**kwargs)


def test_a_plain_step_ages_the_counts_toward_the_prior():
    """An unlucky start (two blocks rejected at once) leaves the estimate below a strong prior;
    plain steps observe nothing, so the counts age and the estimate returns toward the prior
    (before, it stayed at the unlucky value for as long as the request stepped plain)."""
    chooser = AdaptiveGamma(AdaptiveGammaSettings(gamma_max=8, prior_acceptance=0.85, prior_weight=20.0))
    chooser.observe(4, 0)
    chooser.observe(8, 0)
    low = chooser.acceptance
    assert low < 0.85
    for _ in range(10):
        chooser.skip()
    assert low < chooser.acceptance < 0.85
    assert chooser.acceptance == pytest.approx(
        (20.0 * 0.85) / (20.0 + (0.9 ** 10) * (0.9 + 1.0)))  # rejected counts 0.9 + 1, aged 10 times


def test_a_plain_step_of_the_machine_ages_its_chooser():
    """SpeculativeMachine.consume of a plain step (block 0) ages the chooser's counts."""
    machine = SpeculativeMachine("draft", "target", method="block", gamma=1, num_drafts=1, max_new_tokens=8,
                                 adaptive=AdaptiveGammaSettings(gamma_max=4))
    machine.step_costs = lambda: PLAIN_WINS
    machine.chooser.observe(4, 2)
    before = (machine.chooser.accepted, machine.chooser.rejected)
    draft_fn, target_fn = model_pair(3, 5)
    executor = LocalExecutor({"draft": draft_fn, "target": target_fn}, PROMPT,
                             layout_sources(machine.streams(), split_sources(torch.Generator().manual_seed(0), 2)),
                             temperature=1.0, top_k=0, top_p=1.0)
    machine.consume(executor.run_iteration(machine.needs()))
    assert machine.draft_lengths == [0]
    decay = machine.chooser.settings.decay
    assert (machine.chooser.accepted, machine.chooser.rejected) == pytest.approx((decay * before[0], decay * before[1]))


def test_observe_rejects_impossible_counts():
    chooser = AdaptiveGamma(AdaptiveGammaSettings(gamma_max=4))
    with pytest.raises(ValueError, match="num_accepted"):
        chooser.observe(2, 3)


# --------------------------------------------------------------------- exact enumeration
def _adaptive_law(method: str, vocab: int, length: int, seed: int, num_drafts: int, settings: AdaptiveGammaSettings):
    """(exact law of the emitted tokens, the set of gamma sequences seen over the choice tree)."""
    draft_fn, target_fn = model_pair(vocab, seed)
    histories: set[tuple[int, ...]] = set()

    def procedure(source):
        tokens, stats = speculative_generate(
            draft_fn, target_fn, PROMPT, length, gamma=1, method=method, num_drafts=num_drafts,
            generator=source, adaptive=settings,
        )
        histories.add(tuple(stats["draft_lengths"]))
        return tuple(tokens)

    return exact_law(procedure), histories, target_fn


# (method, vocab, tokens, seed, K, gamma_max): single-draft rules with blocks of 1-3 over
# 4 tokens; multi-draft rules with 1-2 (their choice trees grow fast with gamma).
ADAPTIVE_CASES = [
    pytest.param("token", 2, 4, 5, 1, 3, id="token-V2"),
    pytest.param("block", 2, 4, 5, 1, 3, id="block-V2"),
    pytest.param("greedy_block", 2, 4, 5, 1, 3, id="greedy_block-V2"),
    pytest.param("spectr", 2, 3, 11, 2, 2, id="spectr-K2"),
    pytest.param("sequential_gbv", 2, 3, 11, 2, 2, id="sequential_gbv-K2"),
    pytest.param("sequential_gbv", 2, 4, 14, 1, 3, id="sequential_gbv-K1-nested"),
]


@pytest.mark.parametrize("method,vocab,length,seed,num_drafts,gamma_max", ADAPTIVE_CASES)
def test_adaptive_gamma_keeps_the_target_law_exactly(method, vocab, length, seed, num_drafts, gamma_max):
    settings = AdaptiveGammaSettings(gamma_max=gamma_max, **VARYING)
    law, histories, target_fn = _adaptive_law(method, vocab, length, seed, num_drafts, settings)
    blocks_used = {gamma for history in histories for gamma in history}
    assert len(histories) > 1 and len(blocks_used) > 1, f"gamma never varied: {histories}"
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


def test_greedy_rules_get_blocks_that_cover_their_pending_modification():
    """After a short accepted prefix greedy_block carries a modification over the rest of the
    block; the adaptive rule never drafts less than that (a shorter block is an error in the
    verifier), so some histories lift a block above the chooser's own pick."""
    settings = AdaptiveGammaSettings(gamma_max=3, **VARYING)
    _, histories, _ = _adaptive_law("greedy_block", 2, 4, 5, 1, settings)
    _, stateless, _ = _adaptive_law("block", 2, 4, 5, 1, settings)
    assert any(history[1:] == (3, 3) for history in histories)
    assert not any(history[1:] == (3, 3) for history in stateless)


def _run_local(machine: SpeculativeMachine, draft_fn, target_fn, source) -> list[int]:
    """Drive ``machine`` (built by the test, unlike in ``speculative_generate``) with the
    reference executor at temperature 1, on ``source``'s two streams."""
    executor = LocalExecutor({"draft": draft_fn, "target": target_fn}, PROMPT,
                             layout_sources(machine.streams(), split_sources(source, 2)),
                             temperature=1.0, top_k=0, top_p=1.0)
    return run_machine(machine, executor)


class _HistoryPeekingChooser:
    """Not the production rule: a block length that depends on the committed tokens and the last
    accepted length (anything fixed before the draft is sampled is allowed)."""

    def __init__(self, machine: SpeculativeMachine, gamma_max: int):
        self.machine, self.gamma_max = machine, gamma_max

    def choose(self) -> int:
        last = self.machine.accepted_lengths[-1] if self.machine.accepted_lengths else 0
        return 1 + (sum(self.machine.committed) + last) % self.gamma_max

    def observe(self, gamma: int, num_accepted: int) -> None:
        pass


@pytest.mark.parametrize("method", [pytest.param("token", marks=pytest.mark.slow), "block", "greedy_block"])
def test_any_rule_fixed_before_the_draft_is_exact(method):
    draft_fn, target_fn = model_pair(3, 7)
    length, gamma_max = 3, 3
    histories: set[tuple[int, ...]] = set()

    def procedure(source):
        machine = SpeculativeMachine("draft", "target", method=method, gamma=1, num_drafts=1, max_new_tokens=length,
                                     adaptive=AdaptiveGammaSettings(gamma_max=gamma_max))
        machine.chooser = _HistoryPeekingChooser(machine, gamma_max)
        tokens = _run_local(machine, draft_fn, target_fn, source)
        histories.add(tuple(machine.draft_lengths))
        return tuple(tokens[:length])

    law = exact_law(procedure)
    assert len({g for history in histories for g in history}) == gamma_max
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


def test_adaptive_loop_is_reproducible_and_reports_its_blocks():
    draft_fn, target_fn = model_pair(6, 3, noise=0.5)
    settings = AdaptiveGammaSettings(gamma_max=6)
    runs = [
        speculative_generate(draft_fn, target_fn, PROMPT, 40, gamma=1, method="block", adaptive=settings,
                             generator=torch.Generator().manual_seed(9))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    _, stats = runs[0]
    assert len(stats["draft_lengths"]) == stats["iterations"] == len(stats["accepted"])
    assert all(1 <= g <= 6 for g in stats["draft_lengths"])
    assert all(a <= g for a, g in zip(stats["accepted"], stats["draft_lengths"]))
    assert stats["draft_calls"] == sum(stats["draft_lengths"])


@pytest.mark.parametrize("method,adaptive", [("greedy_block", None), ("greedy_block", AdaptiveGammaSettings(gamma_max=3))])
def test_greedy_rules_stay_exact_at_the_context_end(method, adaptive):
    """With 4 positions of context left and blocks of 3, a greedy rule's pending modification
    reaches past the end on some branches; the block then runs past the end (never emitted)
    instead of being clipped below the modification, and the law stays exact."""
    draft_fn, target_fn = model_pair(2, 5)
    length = 4
    past_the_end: list[bool] = []

    def procedure(source):
        machine = SpeculativeMachine("draft", "target", method=method, gamma=3, num_drafts=1, max_new_tokens=length,
                                     context_budget=length, adaptive=adaptive)
        tokens = _run_local(machine, draft_fn, target_fn, source)
        committed = 0
        for block, accepted in zip(machine.draft_lengths, machine.accepted_lengths):
            past_the_end.append(committed + block > length)
            committed += accepted + 1
        return tuple(tokens[:length])

    law = exact_law(procedure)
    assert any(past_the_end), "no branch needed a block past the context end"
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


# ------------------------------------------------- a choice that reads the step's costs
def _costs(plain_s: float, draft_s: float, verify_per_token_s: float, gamma_max: int = 3) -> StepCosts:
    return StepCosts(draft_s=draft_s, verify_s=tuple(0.01 + verify_per_token_s * (g + 1) for g in range(1, gamma_max + 1)),
                     overhead_s=0.002, plain_s=plain_s, plain_overhead_s=0.002, plain_tokens=4)


PLAIN_WINS = _costs(plain_s=0.001, draft_s=0.01, verify_per_token_s=0.01)
LONG_BLOCKS_WIN = _costs(plain_s=0.05, draft_s=0.0001, verify_per_token_s=0.0001)
SHORT_BLOCKS_WIN = _costs(plain_s=0.012, draft_s=0.004, verify_per_token_s=0.002)


def test_best_block_is_plain_when_a_plain_step_is_cheaper_per_token():
    assert best_block(0.9, 4, PLAIN_WINS) == 0
    assert best_block(0.9, 4, PLAIN_WINS, allow_plain=False) >= 1
    assert best_block(0.9, 3, LONG_BLOCKS_WIN) == 3
    assert best_block(0.0, 3, LONG_BLOCKS_WIN) == 1  # nothing is ever accepted: the shortest block


def test_best_block_weighs_measured_tokens_by_block_when_given():
    """With the tokens each block length measured to yield (flat beyond 2 drafts here), the
    longer blocks the geometric formula favours at a high rate lose."""
    assert best_block(0.95, 3, LONG_BLOCKS_WIN, allow_plain=False) == 3
    flat = (1.9, 2.5, 2.5)
    assert best_block(0.95, 3, LONG_BLOCKS_WIN, allow_plain=False, tokens_by_block=flat) == 2
    rates = [LONG_BLOCKS_WIN.speculative_rate(0.95, g, flat[g - 1]) for g in (1, 2, 3)]
    assert rates[1] == max(rates)


def test_best_block_maximises_the_measured_rate():
    for alpha in (0.1, 0.5, 0.8, 0.95):
        chosen = best_block(alpha, 3, SHORT_BLOCKS_WIN)
        rates = [SHORT_BLOCKS_WIN.plain_rate()] + [SHORT_BLOCKS_WIN.speculative_rate(alpha, g) for g in (1, 2, 3)]
        assert rates[chosen] == max(rates)


def test_a_drafts_first_round_is_paid_once_per_block():
    """A draft call whose first round costs more than each further one (its set-up, paid once):
    a block of g drafts costs first + (g - 1) further rounds, so a long block pays the set-up
    once over more tokens. Charged per token instead (the same seconds at the block the costs
    were measured on, 2 here), the longest block loses to a short one at the same acceptance."""
    first, later, measured_at = 0.004, 0.0005, 2
    once = dataclasses.replace(_costs(plain_s=0.05, draft_s=later, verify_per_token_s=0.0005, gamma_max=8),
                               draft_first_s=first)
    per_token = dataclasses.replace(once, draft_s=(first + (measured_at - 1) * later) / measured_at, draft_first_s=None)
    assert once.draft_seconds(measured_at) == pytest.approx(per_token.draft_seconds(measured_at))
    assert [once.draft_seconds(g) for g in (1, 4)] == pytest.approx([first, first + 3 * later])
    assert best_block(0.85, 8, once, allow_plain=False) == 8
    assert best_block(0.85, 8, per_token, allow_plain=False) < 8


@pytest.mark.parametrize("field,kwargs", [
    ("draft_s", dict(draft_s=-1.0)), ("verify_s", dict(verify_s=())), ("plain_tokens", dict(plain_tokens=0)),
    ("draft_first_s", dict(draft_first_s=-1.0)),
])
def test_bad_step_costs_name_the_field(field, kwargs):
    values = dict(draft_s=0.001, verify_s=(0.01,), overhead_s=0.0, plain_s=0.01, plain_overhead_s=0.0, plain_tokens=4)
    values.update(kwargs)
    with pytest.raises(ValueError, match=field if field not in ("draft_s", "draft_first_s") else ">= 0"):
        StepCosts(**values)


class _OutsideSchedule:
    """Step costs that change from step to step by a schedule outside the request (here: the
    number of steps the request has made so far and the sum of its tokens, standing in for the
    load and timings a served step sees), cycling through plain-favoured, long-block-favoured and
    short-block-favoured costs."""

    SCHEDULE = (LONG_BLOCKS_WIN, SHORT_BLOCKS_WIN, PLAIN_WINS)

    def __init__(self, machine: SpeculativeMachine):
        self.machine = machine

    def __call__(self) -> StepCosts:
        steps = len(self.machine.draft_lengths)
        return self.SCHEDULE[(steps + sum(self.machine.committed)) % len(self.SCHEDULE)]


# (method, vocab, tokens, seed, K, gamma_max)
COST_CASES = [
    pytest.param("token", 2, 4, 5, 1, 3, id="token"),
    pytest.param("block", 3, 3, 7, 1, 3, id="block"),
    pytest.param("greedy_block", 2, 4, 5, 1, 3, id="greedy_block"),
    pytest.param("spectr", 2, 3, 11, 2, 2, id="spectr-K2"),
    pytest.param("sequential_gbv", 2, 3, 11, 2, 2, id="sequential_gbv-K2"),
]


@pytest.mark.parametrize("method,vocab,length,seed,num_drafts,gamma_max", COST_CASES)
def test_a_choice_reading_outside_costs_keeps_the_target_law_exactly(method, vocab, length, seed, num_drafts, gamma_max):
    """The production chooser with step costs from an outside schedule: blocks of 0 (plain steps)
    to gamma_max really occur on different branches, and the law is the target's exactly."""
    draft_fn, target_fn = model_pair(vocab, seed)
    histories: set[tuple[int, ...]] = set()

    def procedure(source):
        machine = SpeculativeMachine("draft", "target", method=method, gamma=1, num_drafts=num_drafts,
                                     max_new_tokens=length,
                                     adaptive=AdaptiveGammaSettings(gamma_max=gamma_max, **VARYING))
        machine.step_costs = _OutsideSchedule(machine)
        tokens = _run_local(machine, draft_fn, target_fn, source)
        histories.add(tuple(machine.draft_lengths))
        return tuple(tokens[:length])

    law = exact_law(procedure)
    blocks_used = {gamma for history in histories for gamma in history}
    assert 0 in blocks_used and max(blocks_used) >= 2, f"the costs never moved the block: {histories}"
    assert any(0 in history and any(g > 0 for g in history) for history in histories)
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


class _OutsideModes:
    """Step modes decided outside the request, as the scheduler decides one for a whole cohort:
    plain forced where long blocks would win, speculative forced where plain would win, by the
    request's step count and tokens (standing in for what the other requests of a step do)."""

    SCHEDULE = (dataclasses.replace(PLAIN_WINS, mode="speculative"), dataclasses.replace(LONG_BLOCKS_WIN, mode="plain"),
                SHORT_BLOCKS_WIN, dataclasses.replace(SHORT_BLOCKS_WIN, mode="speculative", block=2))

    def __init__(self, machine: SpeculativeMachine):
        self.machine = machine

    def __call__(self) -> StepCosts:
        return self.SCHEDULE[(len(self.machine.draft_lengths) + sum(self.machine.committed)) % len(self.SCHEDULE)]


@pytest.mark.parametrize("method,vocab,length,seed,num_drafts,gamma_max", COST_CASES)
def test_a_step_mode_decided_outside_keeps_the_target_law_exactly(method, vocab, length, seed, num_drafts, gamma_max):
    """Plain or speculative decided for the request from outside (the scheduler's cohort mode):
    followed on every branch (a forced plain step is plain unless a greedy modification is
    pending; a forced speculative step drafts), and the law is the target's exactly."""
    draft_fn, target_fn = model_pair(vocab, seed)
    followed: list[bool] = []

    def procedure(source):
        machine = SpeculativeMachine("draft", "target", method=method, gamma=1, num_drafts=num_drafts,
                                     max_new_tokens=length,
                                     adaptive=AdaptiveGammaSettings(gamma_max=gamma_max, **VARYING))
        schedule = _OutsideModes(machine)
        modes: list[tuple[str, bool, int]] = []  # (mode, plain allowed, block named) at each choice

        def costs() -> StepCosts:
            value = schedule()
            modes.append((value.mode, machine.pending_positions == 0, value.block))
            return value

        machine.step_costs = costs
        tokens = _run_local(machine, draft_fn, target_fn, source)
        for (mode, plain_allowed, named), block in zip(modes, machine.draft_lengths):
            if mode == "speculative" and named:  # the named block (longer only over a pending greedy modification)
                followed.append(("named block", block == named or (method == "greedy_block" and block > named)))
            elif mode == "speculative":
                followed.append(("speculative", block >= 1))
            elif mode == "plain":
                followed.append(("plain", block == 0 if plain_allowed else block >= 1))
        return tuple(tokens[:length])

    law = exact_law(procedure)
    assert {mode for mode, _ in followed} == {"plain", "speculative", "named block"}, followed
    assert all(ok for _, ok in followed)
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


@pytest.mark.slow
def test_a_greedy_rule_never_steps_plain_over_a_pending_modification():
    """Plain steps favoured after a first long block: on branches where greedy_block left a
    modification pending, the next step is still a verified block covering it; elsewhere it is
    plain. Exact either way."""
    draft_fn, target_fn = model_pair(2, 5)
    second_blocks: set[int] = set()

    def procedure(source):
        machine = SpeculativeMachine("draft", "target", method="greedy_block", gamma=1, num_drafts=1, max_new_tokens=4,
                                     adaptive=AdaptiveGammaSettings(gamma_max=3, **VARYING))
        machine.step_costs = _FirstBlockThenPlain(machine)
        tokens = _run_local(machine, draft_fn, target_fn, source)
        second_blocks.update(machine.draft_lengths[1:2])
        return tuple(tokens[:4])

    law = exact_law(procedure)
    assert 0 in second_blocks and any(block > 0 for block in second_blocks), second_blocks
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) < EXACT_TOLERANCE


class _FirstBlockThenPlain:
    """Long blocks favoured on the first step, plain steps after it."""

    def __init__(self, machine: SpeculativeMachine):
        self.machine = machine

    def __call__(self) -> StepCosts:
        return LONG_BLOCKS_WIN if not self.machine.draft_lengths else PLAIN_WINS
