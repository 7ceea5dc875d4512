"""The ensemble placement benchmark's cases (benchmarks/served/ensemble_placement.py); no server is started."""

from __future__ import annotations

from benchmarks.served.ensemble_placement import parse_args, placement_cases
from benchmarks.served.load_cases import ServeLoadSettings

ROLES = {"target": "target", "draft": "draft", "partner": "member"}


def test_several_draft_blocks_give_one_case_each_after_the_plain_ensemble_and_the_alternate_case_once():
    args = parse_args(["--se-proposers", "draft,alternate", "--se-draft-gamma", "4,5,auto", "--se-gamma", "auto"])
    assert args.se_draft_gamma == (4, 5, "auto")
    settings = ServeLoadSettings(concurrency=(1,), strategies=("ensemble", "se"), se_gamma=args.se_gamma[0],
                                 se_proposers=("draft", "alternate"), se_draft_gamma=4, bare_limit=False)
    cases = placement_cases(settings, ROLES, args.se_draft_gamma)
    assert [case.label for case in cases] == [
        "ensemble/weighted/n2", "se/draft/weighted/n2/g4", "se/weighted/n2/gauto", "se/draft/weighted/n2/g5",
        "se/draft/weighted/n2/gauto"]
    assert [case.speculation.get("gamma") for case in cases if case.label.startswith("se/draft")] == [4, 5, "auto"]
    assert "gamma_max" in cases[-1].speculation and "gamma_max" not in cases[1].speculation


def test_one_draft_block_by_default():
    args = parse_args([])
    assert args.se_draft_gamma == (4,)


def test_several_alternate_gammas_give_one_case_each():
    args = parse_args(["--se-proposers", "alternate", "--se-gamma", "1,auto"])
    assert args.se_gamma == (1, "auto")
    settings = ServeLoadSettings(concurrency=(1,), strategies=("ensemble", "se"), se_proposers=("alternate",),
                                 bare_limit=False)
    cases = placement_cases(settings, ROLES, args.se_draft_gamma, args.se_gamma)
    assert [case.label for case in cases] == ["ensemble/weighted/n2", "se/weighted/n2/g1", "se/weighted/n2/gauto"]
    assert cases[1].speculation["gammas"] == [1, 1] and cases[2].speculation["gamma"] == "auto"
