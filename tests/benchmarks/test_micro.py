"""The engine micro-benchmarks run end to end on the embedded models (tiny settings): they
print a row per case with a positive time, and the engine-load run generates every token it
asked for."""

from __future__ import annotations

import re

from benchmarks import engine_load, forward_micro


def test_forward_micro_prints_every_case(capsys):
    assert forward_micro.main(["--rows", "1,2", "--context", "8", "--repeats", "1", "--run-steps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    cases = [row.split("|")[1].strip() for row in rows[1:]]
    assert cases[0].startswith("decode run: 2 x 1")
    assert "2 x 5, every other slot (gathered)" in cases and "prefill of 131 tokens" in cases
    assert all(float(row.split("|")[2]) > 0 for row in rows[1:])


def test_engine_load_generates_every_token(capsys):
    args = ["--strategy", "sd", "--concurrency", "2", "--requests", "3", "--max-tokens", "5", "--prefix-caching", "off"]
    assert engine_load.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"sd at concurrency 2: 15 tokens in [\d.]+ s", out)
    assert re.search(r"target short: \d+ forwards", out) and re.search(r"draft short: \d+ forwards", out)
