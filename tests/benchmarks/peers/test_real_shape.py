"""The real-shape benchmark runs end to end with its shapes shrunk (vocabulary 4,352: the tokenizer's 4,096 ids plus padding; context 256):
every section prints its table with positive figures, the grouped attention is the one timed,
and the engine section generates with both strategies."""

from __future__ import annotations

import re

import pytest

from benchmarks.peers import real_shape


@pytest.mark.slow  # runs the benchmark on the embedded models
def test_real_shape_prints_every_section(monkeypatch, capsys):
    monkeypatch.setattr(real_shape, "VOCAB", 4352)
    monkeypatch.setattr(real_shape, "CONTEXT", 256)
    monkeypatch.setattr(real_shape, "COMMON_SHAPE", dict(real_shape.COMMON_SHAPE, vocab_size=4352,
                                                         max_position_embeddings=256))
    args = ["--repeats", "1", "--kv-cache-memory", str(64 * 2**20), "--contexts", "32",
            "--prompt-lengths", "40,100", "--requests", "1", "--max-tokens", "4", "--engine-prompt", "64"]
    assert real_shape.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"\| 3,072 \| [\d.]+ MiB \| 0\.06 GiB \| [\d,]+ x 16 \|", out)  # 6 layers x 2 x 2 heads x 32 x 4 B
    assert len(re.findall(r"\| \d x \d \| 32 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", out)) == 3
    assert re.search(r"\| ar \| [\d.]+ \| 1\.00 \|", out) and re.search(r"\| sd \| [\d.]+ \| [\d.]+ \|", out)
    assert re.search(r"\| 100 \| [\d.]+ \|", out)
