"""benchmarks/served/predictions.py: the edited prediction and the cases (no model run here; the
benchmark's figures are in docs/benchmarks.md)."""

from __future__ import annotations

from benchmarks.served.predictions import cases, edited

TEXT = "\n".join(f"    line_{i} = {i}" for i in range(12))


def test_edited_changes_exactly_the_asked_lines_and_keeps_the_rest():
    changed = edited(TEXT, 3)
    before, after = TEXT.split("\n"), changed.split("\n")
    differing = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(before) == len(after) and len(differing) == 3
    assert all(after[i].startswith("    value = compute(") for i in differing)  # indentation kept


def test_every_case_is_built_against_its_baseline():
    built = cases(TEXT, 3)
    names = [case.name for case in built]
    assert names[0] == "ar" and names[-1] == "ngram+ar-prompt"
    predictions = {case.name: case.prediction for case in built if case.prediction is not None}
    assert predictions["prediction/exact"] == TEXT and predictions["prediction/edited"] == edited(TEXT, 3)
    unrelated = predictions["prediction/unrelated"]
    assert len(unrelated) == len(TEXT) and "line_" not in unrelated
    assert all(case.speculation.get("proposer") == "ngram" for case in built if case.name.startswith("ngram/"))
