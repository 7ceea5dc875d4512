"""The benchmark harness: case suite, peer bookkeeping, analysis, and a smoke run on tiny models.

The smoke run drives ``specserve bench`` (the ``bench`` subcommand's handler) end to end on
tiny random checkpoints in all three modes (separate Ray actors, one process, transformers
assisted generation) with a handful of cases, and checks what it writes. It measures nothing
about speed (timed assertions do not belong in tests); it checks that every case generated
exactly the requested tokens and that the bookkeeping is consistent.
"""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from benchmarks.reports.analysis import adaptive_comparisons, check_targets, paired_ratios, peer_comparisons, summarize
from benchmarks.cli import build_bench_parser, gamma_list, settings_from_args
from benchmarks.peers.peer import accepted_lengths_from_cache
from benchmarks.served.prompts import Prompt, code_prompt, load_prompts, prose_prompts
from benchmarks.reports.records import RunRecord
from benchmarks.reports.report import BenchResults, render_markdown
from benchmarks.served.run import rerender
from benchmarks.served.suite import BenchSettings, build_cases
from tests.conftest import tiny_args_dict

ROLES = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}


# ----------------------------------------------------------------------------- suite

def test_full_suite_holds_every_required_case():
    keys = {case.key for case in build_cases(BenchSettings(), ROLES)}
    for mode in ("ray", "local"):
        assert f"{mode}:ar" in keys
        for method in ("token", "block", "greedy_block"):
            for gamma in (2, 4, 8):
                assert f"{mode}:sd/{method}/g{gamma}" in keys
        for method in ("spectr", "spectr_gbv"):
            for k in (2, 3):
                assert f"{mode}:multi_draft/{method}/k{k}/g4" in keys
        for name in ("weighted/n2", "weighted/n3", "contrastive/n2"):
            assert f"{mode}:ensemble/{name}" in keys
            assert f"{mode}:se/{name}/g1" in keys and f"{mode}:se/{name}/g5" in keys
    assert {"hf:peer/ar", "hf:peer/assisted/g2", "hf:peer/assisted/g4", "hf:peer/assisted/g8"} <= keys


def test_baselines_and_ensemble_parameters():
    cases = {case.key: case for case in build_cases(BenchSettings(), ROLES)}
    assert cases["ray:sd/block/g8"].baseline == "ray:ar"
    assert cases["local:multi_draft/spectr/k3/g4"].baseline == "local:ar"
    assert cases["ray:se/weighted/n3/g1"].baseline == "ray:ensemble/weighted/n3"
    assert cases["hf:peer/assisted/g4"].baseline == "hf:peer/ar"
    weighted = cases["ray:ensemble/weighted/n2"].speculation
    assert weighted.members == ["target", "partner"] and weighted.weights == [0.5, 0.5]
    contrastive = cases["ray:se/contrastive/n2/g5"].speculation
    assert contrastive.members == ["target", "partner2"] and contrastive.mu == 0.1
    assert contrastive.gammas == [1, 5]  # the expert fixed at 1, the amateur proposes 5
    assert cases["local:se/weighted/n3/g1"].speculation.gammas == [1, 1, 1]


def test_strategy_subset_keeps_baselines():
    keys = {c.key for c in build_cases(BenchSettings(strategies=("se",), modes=("local",)), ROLES)}
    names = ("weighted/n2", "weighted/n3", "contrastive/n2")
    assert keys == {f"local:ensemble/{name}" for name in names} | {f"local:se/{name}/g{g}" for name in names for g in (1, 5)}


def test_gammas_accept_auto():
    assert gamma_list("2,4,8,auto") == (2, 4, 8, "auto") and gamma_list(" AUTO ") == ("auto",)
    for bad in ("0", "2,x", "", "33"):
        with pytest.raises(argparse.ArgumentTypeError):
            gamma_list(bad)
    parser = build_bench_parser()
    args = parser.parse_args(["--out", "x", "--gammas", "2,4,auto", "--strategies", "sd,peer"])
    settings = settings_from_args(args)
    assert settings.gammas == (2, 4, "auto") and settings.auto_gamma_max() == 4
    assert BenchSettings(**settings.model_dump(mode="json")) == settings  # results.json round trip
    cases = {case.key: case for case in build_cases(settings, ROLES)}
    auto = cases["ray:sd/block/gauto"].speculation
    assert (auto.strategy, auto.method, auto.gamma, auto.gamma_max) == ("sd", "block", "auto", 4)
    assert cases["local:sd/greedy_block/gauto"].baseline == "local:ar"
    assert cases["ray:sd/block/g4"].speculation.gamma_max is None
    assert not any("auto" in key for key in cases if key.startswith("hf:"))  # the peer has no auto
    assert BenchSettings(gammas=("auto",)).auto_gamma_max() is None  # the deployment's default
    assert BenchSettings(gammas=(2, "auto"), gamma_max=6).auto_gamma_max() == 6
    with pytest.raises(ValueError):
        BenchSettings(gammas=(2, 2))


# ----------------------------------------------------------------------------- prompts

def test_committed_prompt_set_mixes_code_and_prose():
    prompts = load_prompts()
    kinds = [p.kind for p in prompts]
    assert kinds.count("code") >= 8 and kinds.count("prose") >= 4
    assert {"code", "prose"} <= set(kinds[:4])  # the --quick prefix holds both kinds
    assert len({p.id for p in prompts}) == len(prompts)


def test_prompt_builders_are_deterministic():
    source = "import os\n\ndef early():\n    pass\n" + "x = 1\n" * 60 + "def f(a):\n" + "    a += 1\n" * 60
    assert code_prompt(source).startswith("def f(a):\n")
    assert code_prompt(source) == code_prompt(source)
    assert prose_prompts("One. Two.\n\nThree four.") == ["One. Two.", "Three four."]


# ----------------------------------------------------------------------------- peer bookkeeping

def test_accepted_lengths_from_the_target_cache():
    # Prompt of 10 tokens; iteration 0 emits 3 (2 accepted), iteration 1 emits 5 (4 accepted,
    # gamma 4 all accepted), iteration 2 emits 1 (a rejection at the first position).
    # Cache before each forward: 0, then (sequence length - 1).
    cache_lengths = [0, 12, 17]
    assert accepted_lengths_from_cache(cache_lengths, prompt_len=10, total_len=19) == [2, 4, 0]


# ----------------------------------------------------------------------------- analysis

def _record(case: str, prompt: str, tokens_per_s: float, calls: int, accepted=()) -> RunRecord:
    return RunRecord(case=case, prompt_id=prompt, prompt_kind="code", repeat=0, seed=0, completion_tokens=16,
                     wall_s=16 / tokens_per_s, target_calls=calls, iterations=calls, accepted_lengths=list(accepted))


def test_speedups_are_paired_per_prompt_medians():
    records = [
        _record("ray:ar", "a", 100, 16), _record("ray:ar", "b", 50, 16), _record("ray:ar", "c", 80, 16),
        _record("ray:sd/token/g8", "a", 150, 8), _record("ray:sd/token/g8", "b", 100, 8),
        _record("ray:sd/token/g8", "c", 80, 4),
        _record("ray:sd/block/g8", "a", 160, 4), _record("ray:sd/block/g8", "b", 90, 4),
    ]
    assert sorted(paired_ratios(records, "ray:sd/token/g8", "ray:ar", lambda r: r.tokens_per_second)) == [1.0, 1.5, 2.0]
    cases = [c for c in build_cases(BenchSettings(modes=("ray",), strategies=("sd",), gammas=(8,),
                                                  sd_methods=("token", "block")), ROLES)]
    summaries = {s.key: s for s in summarize(cases, records)}
    assert summaries["ray:sd/token/g8"].speedup == 1.5
    assert summaries["ray:sd/token/g8"].block_efficiency == 48 / 20  # pooled: all tokens / all calls
    assert summaries["ray:sd/token/g8"].block_efficiency_median == 2.0
    assert summaries["ray:ar"].speedup == 1.0
    checks = {c.name: c for c in check_targets(BenchSettings(), list(summaries.values()), [])}
    block_check = checks["block efficiency: block vs token at gamma = 8"]
    assert block_check.met is True and block_check.measured.startswith("1.667x")  # 4.0 vs 2.4


def test_auto_gamma_is_set_against_the_best_fixed_gamma():
    def record(case, prompt, tokens_per_s, calls, drafted):
        return RunRecord(case=case, prompt_id=prompt, prompt_kind="code", repeat=0, seed=0, completion_tokens=16,
                         wall_s=16 / tokens_per_s, target_calls=calls, iterations=calls,
                         accepted_lengths=[1] * calls, draft_lengths=drafted)

    records = []
    for prompt, scale in (("a", 1.0), ("b", 2.0)):
        records += [record("ray:ar", prompt, 50 * scale, 16, []),
                    record("ray:sd/block/g2", prompt, 80 * scale, 8, [2] * 8),
                    record("ray:sd/block/g4", prompt, 100 * scale, 6, [4] * 6),
                    record("ray:sd/block/gauto", prompt, 110 * scale, 5, [3, 4, 4, 5, 4])]
    settings = BenchSettings(modes=("ray",), strategies=("sd",), gammas=(2, 4, "auto"), sd_methods=("block",))
    cases = build_cases(settings, ROLES)
    summaries = summarize(cases, records)
    by_key = {s.key: s for s in summaries}
    assert by_key["ray:sd/block/gauto"].mean_draft_length == 4.0 and by_key["ray:sd/block/g2"].mean_draft_length == 2.0
    assert by_key["ray:ar"].mean_draft_length is None
    (row,) = adaptive_comparisons(summaries, records)
    assert (row.best_fixed_key, row.best_fixed_gamma) == ("ray:sd/block/g4", 4)
    assert row.tokens_per_second_ratio == pytest.approx(1.1)
    assert (row.auto_block_efficiency, row.best_fixed_block_efficiency) == (16 / 5, 16 / 6)
    assert peer_comparisons(summaries) == []  # no peer, and auto has no peer counterpart
    results = BenchResults(settings=settings, environment={}, command="specserve bench", summaries=summaries,
                           overhead=[], peer=[], checks=[], records=records, adaptive=[row])
    markdown = render_markdown(results, {})
    assert "## Adaptive draft length (gamma auto)" in markdown and "gamma_max = 4" in markdown
    assert "| case | mode | block eff. | mean accepted | mean drafted | tok/s | speedup |" in markdown
    assert "| sd/block/gauto | ray | 3.20 | 1.00 | 4.00 |" in markdown
    assert "| sd/block/g2 | ray | 2.00 | 1.00 | 2.00 |" in markdown
    assert ("- best fixed gamma vs auto, block (ray): best fixed gamma 4 150 tok/s, auto 165 tok/s: auto / best fixed "
            "1.10x tokens/s (paired median); block efficiency 2.67 vs 3.20") in markdown
    assert results.to_json()["adaptive_gamma"][0]["best_fixed_gamma"] == 4
    plain = BenchSettings(modes=("ray",), strategies=("sd",), gammas=(2, 4), sd_methods=("block",))
    fixed_only = [r for r in records if "auto" not in r.case]
    no_auto = BenchResults(settings=plain, environment={}, command="specserve bench",
                           summaries=summarize(build_cases(plain, ROLES), fixed_only), overhead=[], peer=[],
                           checks=[], records=fixed_only)
    assert "Adaptive" not in render_markdown(no_auto, {})


# ----------------------------------------------------------------------------- smoke run

SMOKE_PROMPTS = [
    Prompt(id="code-a", kind="code", source="test", text="def add(a, b):\n    return a + b\n\ndef main(argv=None):\n"),
    Prompt(id="prose-a", kind="prose", source="test", text="The quick brown fox jumps over the lazy dog."),
]


@pytest.mark.timeout(300)
def test_bench_command_smoke(tiny_checkpoints, ray_session, tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need the `bench` extra: pip install -e '.[bench]'")
    # Three models (target, draft, partner) keep start-up short: every strategy still runs.
    app_args = tiny_args_dict({name: tiny_checkpoints[name] for name in ("target", "draft", "partner")})
    # The smoke compares seeded runs on Ray actors and in one process (same tokens); gamma auto's
    # goodput choice reads timings, which promise the law, not the tokens: off here.
    app_args.setdefault("engine", {})["goodput_gamma"] = False
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "specserve", "route_prefix": "/", "import_path": "cluster.app:build_app", "args": app_args,
    }]}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(p.model_dump_json() + "\n" for p in SMOKE_PROMPTS))
    out = tmp_path / "bench-out"
    parser = build_bench_parser()
    args = parser.parse_args([
        "--config", str(config), "--out", str(out), "--quick", "--prompts", str(prompts),
        "--strategies", "ar,sd,ensemble,se,peer", "--gammas", "2,auto", "--max-tokens", "8", "--max-prompt-tokens", "48",
    ])
    assert args.handler(args) == 0

    results = json.loads((out / "results.json").read_text())
    keys = {s["key"] for s in results["summaries"]}
    for mode in ("ray", "local"):
        assert {f"{mode}:ar", f"{mode}:sd/block/g2", f"{mode}:ensemble/weighted/n2", f"{mode}:se/weighted/n2/g1"} <= keys
    assert {"hf:peer/ar", "hf:peer/assisted/g2"} <= keys
    records = results["records"]
    assert len(records) == len(keys) * len(SMOKE_PROMPTS)
    assert all(r["completion_tokens"] == 8 for r in records)
    summaries = {s["key"]: s for s in results["summaries"]}
    for key, summary in summaries.items():
        assert summary["runs"] == len(SMOKE_PROMPTS)
        assert summary["tokens_per_second"] > 0
        if summary["group"] in ("ar", "sd", "peer"):
            assert summary["block_efficiency"] >= 1.0, key
        elif summary["group"] == "ensemble":  # every member scores every token
            assert summary["block_efficiency"] == 1.0, key
            assert sum(summary["model_calls_per_token"].values()) == 2.0, key
    for key in ("ray:sd/token/g2", "local:sd/token/g2", "hf:peer/assisted/g2"):
        # one correction/bonus token per target call, at most gamma accepted on top
        assert 1.0 <= summaries[key]["block_efficiency"] <= 3.0
        assert 0.0 <= summaries[key]["mean_accepted"] <= 2.0
    # The same seeds give the same tokens on Ray actors and in one process: same counts.
    for label in ("sd/block/g2", "sd/greedy_block/g2", "se/contrastive/n2/g5", "sd/block/gauto"):
        assert summaries[f"ray:{label}"]["block_efficiency"] == summaries[f"local:{label}"]["block_efficiency"]
    # gamma auto (gamma_max 2, the largest fixed gamma) ran through the coordinator: blocks of 1 or 2 drafts
    for mode in ("ray", "local"):
        auto = summaries[f"{mode}:sd/block/gauto"]
        assert 1.0 <= auto["mean_draft_length"] <= 2.0 and auto["block_efficiency"] >= 1.0
        assert summaries[f"{mode}:sd/block/g2"]["mean_draft_length"] == 2.0
    assert {row["auto_key"] for row in results["adaptive_gamma"]} >= {"ray:sd/block/gauto", "local:sd/token/gauto"}
    assert all(max(r["draft_lengths"]) <= 2 for r in records if r["case"].endswith("gauto"))
    assert "hf:peer/assisted/gauto" not in keys
    assert summaries["ray:sd/block/g2"]["bytes_per_token"] > 0
    assert {row["label"] for row in results["distribution_overhead"]} >= {"ar", "sd/token/g2", "se/weighted/n2/g1"}
    assert "ray:ensemble/weighted/n3" not in keys  # two weighted members only in this group
    assert results["peer_comparison"]
    markdown = (out / "results.md").read_text()
    for heading in ("## Speculative decoding", "## Ensembles and speculative ensembles",
                    "## sd versus transformers assisted generation", "## Distribution overhead", "## Targets",
                    "## Adaptive draft length (gamma auto)", "- best fixed gamma vs auto, block (ray)"):
        assert heading in markdown
    for name in ("block_efficiency.png", "speedup.png", "time_split.png", "distribution_overhead.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Re-rendering from results.json reproduces the analysis exactly.
    rerendered = rerender(out)
    assert [s["key"] for s in results["summaries"]] == [s.key for s in rerendered.summaries]
    assert json.loads((out / "results.json").read_text())["summaries"] == results["summaries"]
