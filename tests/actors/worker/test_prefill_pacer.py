"""Decode first (actors/worker/prefill_pacer.py): while other rows run, a step's prefill chunks are
sized from the measured step costs; alone, a prompt keeps the static budget."""

from __future__ import annotations

import pytest

from actors.worker.prefill_pacer import FIRST_PACED_TOKENS, MIN_PACED_TOKENS, WINDOW, PrefillPacer, paced, theil_sen


def test_no_pacing_without_other_rows_or_before_a_decode_step_is_measured():
    pacer = PrefillPacer()
    assert pacer.allowed(other_tokens=8) is None  # nothing measured yet
    pacer.observe(0.1, other_tokens=8)
    assert pacer.allowed(other_tokens=0) is None  # alone: nothing to stall
    assert pacer.allowed(other_tokens=8) == FIRST_PACED_TOKENS  # a first chunk measures the cost


def test_the_chunk_adds_the_stretch_of_a_decode_step_at_the_measured_token_cost():
    pacer = PrefillPacer(stretch=0.25)
    for _ in range(3):
        pacer.observe(0.100, other_tokens=8)
    pacer.observe(0.164, other_tokens=8, prefill_tokens=64, prefill_s=0.064)  # 1 ms a prefill token
    assert pacer.token_cost_at(0) == pytest.approx(0.01)  # a hundredth of a decode step
    assert pacer.allowed(other_tokens=8) == 25  # 0.25 x 100 ms / 1 ms
    for _ in range(2):  # very slow tokens: the floor holds
        pacer.observe(2.1, other_tokens=8, prefill_tokens=25, prefill_s=2.0)
    assert pacer.allowed(other_tokens=8) == MIN_PACED_TOKENS


def test_chunks_converge_to_the_forward_the_stretch_affords():
    """A forward of n prefill tokens costs a + b n: the chunks settle where a + b n = stretch x decode."""
    a, b, decode = 0.005, 0.0001, 0.100
    pacer = PrefillPacer(stretch=0.25)
    pacer.observe(decode, other_tokens=8)
    chunk = pacer.allowed(other_tokens=8)
    for _ in range(40):
        pacer.observe(decode + a + b * chunk, other_tokens=8, prefill_tokens=chunk, prefill_s=a + b * chunk)
        chunk = pacer.allowed(other_tokens=8)
    assert chunk == pytest.approx((0.25 * decode - a) / b, rel=0.02)  # 200 tokens


def test_one_outlier_moves_the_estimates_little():
    pacer = PrefillPacer(stretch=0.25)
    for step_s in (0.1, 0.1, 3.0):  # a step the busy host stretched
        pacer.observe(step_s, other_tokens=8)
    for prefill_s in (0.064, 0.064, 5.0):
        pacer.observe(0.1 + prefill_s, other_tokens=8, prefill_tokens=64, prefill_s=prefill_s)
    assert pacer.allowed(other_tokens=8) == 25


def test_steps_that_carry_chunks_teach_the_decode_time_outside_them():
    """Chunks back to back: the decode figure follows the streams (whose steps grow with their
    context) through the time the chunks' steps take outside their forwards."""
    pacer = PrefillPacer(stretch=0.25)
    pacer.observe(0.100, other_tokens=8)
    for _ in range(WINDOW):
        pacer.observe(0.300 + 0.050, other_tokens=8, prefill_tokens=50, prefill_s=0.050)  # 1 ms a token
    assert pacer.decode_step_s == pytest.approx(0.300)
    assert pacer.allowed(other_tokens=8) == 75  # 0.25 x 300 ms / 1 ms


def test_a_host_that_slows_down_slows_the_chunks_and_the_decode_steps_alike():
    """A token's cost is learned against the decode time of its own step: halve the host's speed
    for everything and the chunk stays the same size."""
    fast, slow = PrefillPacer(stretch=0.5), PrefillPacer(stretch=0.5)
    for pacer, speed in ((fast, 1.0), (slow, 2.0)):
        pacer.observe(0.1 * speed, other_tokens=8)
        for _ in range(4):
            pacer.observe(speed * (0.1 + 0.05), other_tokens=8, prefill_tokens=50, prefill_s=speed * 0.05)
    assert fast.allowed(other_tokens=8) == slow.allowed(other_tokens=8) == 50


def test_a_short_first_token_step_teaches_no_chunk_cost():
    """A step that gave a newcomer its first token ran few decode forwards beside its chunk: the
    chunk against that short time would look four times dearer."""
    pacer = PrefillPacer(stretch=0.5)
    for decode_s in (0.1, 0.1, 0.025, 0.025):
        pacer.observe(decode_s + 0.05, other_tokens=8, prefill_tokens=50, prefill_s=0.05)
    assert pacer.token_cost_at(0) == pytest.approx(0.01)  # not 0.04: half the chunks against a quarter step


def test_the_chunk_shrinks_as_the_context_it_attends_to_grows():
    """Seconds per token 1 ms + 1 us per earlier position: the chunk whose n tokens cost
    n (1 ms + 1 us (context + n / 2)) = stretch x decode, read at the chunk's own context."""
    pacer = PrefillPacer(stretch=0.5)
    pacer.observe(0.100, other_tokens=8)
    for mid in (50, 200, 350, 500, 650, 800):
        prefill_s = 50 * (0.001 + 1e-6 * mid)
        pacer.observe(0.100 + prefill_s, other_tokens=8, prefill_tokens=50, prefill_s=prefill_s, prefill_context=mid)
    assert pacer.token_cost_at(650) == pytest.approx(0.0165)  # 1.65 ms in decode steps of 100 ms
    # n (0.001 + 1e-6 (c + n / 2)) = 0.05: n = 48.8 at context 0, 30.9 at context 600
    assert pacer.allowed(other_tokens=8, context=0) in (47, 48)
    assert pacer.allowed(other_tokens=8, context=600) in (30, 31)


def test_the_cost_line_shrugs_off_one_outlier():
    points = [(float(x), 1.0 + 0.01 * x) for x in range(0, 800, 100)] + [(350.0, 50.0)]
    intercept, slope = theil_sen(points)
    assert slope == pytest.approx(0.01, rel=0.2) and intercept == pytest.approx(1.0, abs=0.5)
    assert theil_sen([(10.0, 2.0), (20.0, 1.0)]) == (2.0, 0.0)  # too close for a slope: the median alone
    assert theil_sen([]) is None


def test_steps_without_other_rows_teach_nothing():
    pacer = PrefillPacer()
    pacer.observe(5.0, other_tokens=0, prefill_tokens=512, prefill_s=5.0)
    assert pacer.decode_step_s is None and pacer.token_cost_at(0) is None


def test_a_prompt_cut_short_is_fed_in_even_chunks():
    """250 tokens at most 100 a step: 84, 83, 83, not 100, 100, 50."""
    fed, chunks = 0, []
    while fed < 250:
        chunks.append(paced([250 - fed], 100, [250 - fed])[0])
        fed += chunks[-1]
    assert chunks == [84, 83, 83]


@pytest.mark.parametrize(
    ("grants", "allowed", "expected"),
    [
        ([300, 200], None, [300, 200]),
        ([300, 200], 50, [50, 0]),
        ([30, 200], 50, [30, 20]),
        ([0, 200], 16, [0, 16]),
        ([290, 200], 300, [290, 0]),  # 10 left: below MIN_PACED_TOKENS, no forward for them
        ([10, 200], 12, [10, 0]),
    ],
)
def test_paced_cuts_the_grants_in_line_order(grants, allowed, expected):
    assert paced(grants, allowed) == expected


def test_a_stretch_of_zero_is_refused():
    with pytest.raises(ValueError, match="stretch"):
        PrefillPacer(stretch=0)
