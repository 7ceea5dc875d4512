"""The EAGLE-3 acceptance benchmark (benchmarks/micro/eagle3_acceptance.py) runs both proposers."""

from __future__ import annotations

import re

from benchmarks.micro import eagle3_acceptance


def test_eagle3_acceptance_reports_both_proposers(capsys):
    eagle3_acceptance.main(["--prompts", "1", "--max-tokens", "8"])
    out = capsys.readouterr().out
    for name in ("draft model", "eagle3 head"):
        match = re.search(rf"{name}: block efficiency ([\d.]+)", out)
        assert match and 1.0 <= float(match.group(1)) <= 5.0, out
