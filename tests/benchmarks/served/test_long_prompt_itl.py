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
