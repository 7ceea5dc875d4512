"""The KV capacity benchmark runs end to end with the real-shape models shrunk (vocabulary 4,352,
context 256): a budget of two and a half whole slots runs more requests at once than it has
slots, and every request completes."""

from __future__ import annotations

import re

import pytest

from benchmarks.peers import kv_capacity, real_shape


@pytest.mark.slow  # builds and serves the shrunk real-shape target
def test_kv_capacity_runs_more_requests_than_whole_slots(monkeypatch, capsys):
    monkeypatch.setattr(real_shape, "COMMON_SHAPE", dict(real_shape.COMMON_SHAPE, vocab_size=4352,
                                                         max_position_embeddings=256))
    monkeypatch.setattr(kv_capacity, "CONTEXT", 256)
    slot = 3072 * 16 * -(-(256 + 288) // 16)  # 6 layers x 2 x 2 heads x 32 x 4 B a token, 34 blocks
    args = ["--kv-cache-memory", str(5 * slot // 2), "--requests", "8", "--prompt", "40", "--max-tokens", "4"]
    assert kv_capacity.main(args) == 0
    row = re.search(r"\| 8 x 40 \| (\d+) \| 8 \| 0 \| \d+ \|", capsys.readouterr().out)
    assert row and int(row.group(1)) > 2  # more at once than the 2 whole slots the budget holds
