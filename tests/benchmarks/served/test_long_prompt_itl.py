"""The long-prompt latency benchmark runs end to end with its model shrunk (vocabulary 4,352,
context 1,024): a row per budget, with stream gaps measured while the long prompts ran, and the
baseline at the same stream positions without them (alone)."""

from __future__ import annotations

import re

import pytest

from benchmarks.peers import real_shape
from benchmarks.served import long_prompt_itl


@pytest.mark.slow  # runs the benchmark on the embedded models
def test_long_prompt_itl_prints_a_row_per_budget(monkeypatch, capsys):
    monkeypatch.setattr(real_shape, "COMMON_SHAPE", dict(real_shape.COMMON_SHAPE, vocab_size=4352,
                                                         max_position_embeddings=1024))
    monkeypatch.setattr(long_prompt_itl, "CONTEXT", 1024)
    monkeypatch.setattr(long_prompt_itl, "NO_CHUNKING", 1024)
    args = ["--streams", "2", "--decode-tokens", "40", "--long-prompts", "1", "--long-tokens", "300",
            "--budgets", "off,64", "--quiet-s", "0"]
    assert long_prompt_itl.main(args) == 0
    rows = re.findall(r"^\| (off|64) \| (\d+) \| \d+ \| \d+ \| \d+ \| (?:\d+|-) \| (?:[\d.]+|-) \| (?:\d+|-) \| (?:[\d.]+|-) \| [\d.]+ \|$",
                      capsys.readouterr().out, re.M)
    assert [budget for budget, _ in rows] == ["off", "64"] and all(int(count) > 0 for _, count in rows)


def test_budgets_parse_to_a_token_budget_and_a_stretch():
    assert long_prompt_itl._budget("512", 1024) == (512, None)  # the engine's own pacing
    assert long_prompt_itl._budget("512:static", 1024) == (512, long_prompt_itl.UNPACED)
    assert long_prompt_itl._budget("512:0.35", 1024) == (512, 0.35)
    assert long_prompt_itl._budget("off", 1024) == (long_prompt_itl.NO_CHUNKING, long_prompt_itl.UNPACED)
    with pytest.raises(ValueError, match="--budgets"):
        long_prompt_itl._budget("512:fast", 1024)


def test_the_alone_baseline_reads_the_positions_the_gaps_span():
    """(gap, stream tokens before the chunk): the streams alone count at positions 16..32 only."""
    gaps = [(0.3, 16), (0.4, 24), (0.2, 32)]
    alone = [(0.1, 8), (0.15, 16), (0.2, 24), (0.25, 32), (0.5, 40)]
    assert long_prompt_itl.alone_gaps(gaps, alone) == [0.15, 0.2, 0.25]
    assert long_prompt_itl.alone_gaps([], alone) == []
