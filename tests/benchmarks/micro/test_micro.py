"""The engine micro-benchmarks run end to end on the embedded models (tiny settings): they
print a row per case with a positive time, and the engine-load run generates every token it
asked for."""

from __future__ import annotations

import re

import pytest

from benchmarks.micro import forward_micro, forward_profile, quantized_gemm
from benchmarks.served import engine_load


@pytest.mark.slow  # runs the benchmark on the embedded models
def test_forward_micro_prints_every_case(capsys):
    assert forward_micro.main(["--rows", "1,2", "--context", "8", "--repeats", "1", "--run-steps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    cases = [row.split("|")[1].strip() for row in rows[1:]]
    assert cases[0].startswith("decode run: 2 x 1")
    assert "2 x 5, lean, every other slot" in cases and "prefill of 131 tokens, lean" in cases
    assert {"1 x 1, lean, slots in a run", "1 x 1, model, slots in a run"} <= set(cases)
    assert all(float(row.split("|")[2]) > 0 for row in rows[1:])


def test_forward_profile_splits_every_forward(capsys):
    assert forward_profile.main(["--shapes", "2x1", "--context", "8", "--repeats", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[2].strip() for row in rows[1:]] == ["lean", "model"]
    for row in rows[1:]:
        shares = [float(cell.strip().rstrip("%")) for cell in row.split("|")[4:-1]]  # [5] percent of the wall time
        assert len(shares) == len(forward_profile.COLUMNS) and shares[0] > 0 and 90 <= sum(shares) <= 110


@pytest.mark.slow  # runs the benchmark on the embedded models
def test_engine_load_generates_every_token(capsys):
    args = ["--strategy", "sd", "--concurrency", "2", "--requests", "3", "--max-tokens", "5", "--prefix-caching", "off"]
    assert engine_load.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"sd at concurrency 2: 15 tokens in [\d.]+ s = [\d.]+ tok/s, TTFT p50 [\d.]+ ms", out)
    assert re.search(r"target short: \d+ forwards", out) and re.search(r"draft short: \d+ forwards", out)


def test_engine_load_with_a_quantized_self_draft_reports_block_efficiency(capsys):
    args = ["--config", "deploy/self_draft.yaml", "--quantization", "int4", "--strategy", "sd", "--concurrency", "1",
            "--requests", "1", "--max-tokens", "6"]
    assert engine_load.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"sd at concurrency 1: 6 tokens in", out)
    assert 1.0 <= float(re.search(r"block efficiency ([\d.]+) \(generated tokens per target call", out).group(1)) <= 5.0


def test_engine_load_with_an_eagle3_head_counts_its_forwards(capsys):
    args = ["--config", "deploy/eagle3.yaml", "--strategy", "sd", "--concurrency", "1", "--requests", "1", "--max-tokens", "6"]
    assert engine_load.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"sd at concurrency 1: 6 tokens in", out) and re.search(r"draft head: \d+ forwards", out)


def test_quantized_gemm_times_every_kernel(capsys):
    assert quantized_gemm.main(["--shapes", "32x64", "--rows", "1,2", "--repeats", "1", "--inner", "1", "--copies", "2",
                                 "--fp32-kernels"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 x 64")]
    assert len(rows) == 2 and all(float(cell) > 0 for row in rows for cell in row.split("|")[3:-1] if cell.strip() != "-")
