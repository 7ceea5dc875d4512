"""Decode first (actors/worker/prefill_pacer.py): while other rows run, a step's prefill chunks are
sized from the measured step costs; alone, a prompt keeps the static budget."""

from __future__ import annotations

import pytest

from actors.worker.prefill_pacer import FIRST_PACED_TOKENS, MIN_PACED_TOKENS, PrefillPacer, paced


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
    pacer.observe(0.200, other_tokens=8, prefill_tokens=64, prefill_s=0.064)  # 1 ms a prefill token
    assert pacer.token_s == pytest.approx(0.001)
    assert pacer.allowed(other_tokens=8) == 25  # 0.25 x 100 ms / 1 ms
    for _ in range(2):  # very slow tokens: the floor holds
        pacer.observe(2.0, other_tokens=8, prefill_tokens=25, prefill_s=2.0)
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
        pacer.observe(0.2, other_tokens=8, prefill_tokens=64, prefill_s=prefill_s)
    assert pacer.allowed(other_tokens=8) == 25


def test_steps_without_other_rows_teach_nothing():
    pacer = PrefillPacer()
    pacer.observe(5.0, other_tokens=0, prefill_tokens=512, prefill_s=5.0)
    assert pacer.decode_step_s is None and pacer.token_s is None


@pytest.mark.parametrize(
    ("grants", "allowed", "expected"),
    [
        ([300, 200], None, [300, 200]),
        ([300, 200], 50, [50, 0]),
        ([30, 200], 50, [30, 20]),
        ([0, 200], 16, [0, 16]),
    ],
)
def test_paced_cuts_the_grants_in_line_order(grants, allowed, expected):
    assert paced(grants, allowed) == expected


def test_a_stretch_of_zero_is_refused():
    with pytest.raises(ValueError, match="stretch"):
        PrefillPacer(stretch=0)
