"""``specserve bench --mode serve-load``: level statistics, strategies, docs splice, and one tiny
run end to end against the real HTTP server (``specserve serve`` in a subprocess with its own
Ray) on the embedded target and draft. Nothing about speed is asserted, only that every level
ran its requests and that the bookkeeping holds together."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import yaml

from benchmarks.cli import add_bench_parser
from benchmarks.publish import SERVE_LOAD_END, SERVE_LOAD_START, results_section, splice
from benchmarks.run import rerender
from benchmarks.serve_load import LoadClient, ServeLoadSettings, _api_key, serve_load_cases
from benchmarks.serve_load_report import PLOT_FILES, LevelRun, RequestRecord, percentile, summarize_level

REPO = pathlib.Path(__file__).resolve().parents[2]
ROLES = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


def _record(index: int, times: list[float], tokens: list[int], ok: bool = True) -> RequestRecord:
    return RequestRecord(label="sd/block/g4", concurrency=2, index=index, prompt_id="p", seed=index, ok=ok,
                         error=None if ok else "HTTP 500: boom", sent_s=0.0, e2e_s=times[-1] if times else 0.5,
                         chunk_times_s=times, chunk_tokens=tokens, target_calls=2 if ok else None)


def test_level_statistics_amortise_a_chunk_over_its_tokens():
    records = [_record(0, [0.1, 0.5, 0.6], [1, 2, 1]), _record(1, [0.3, 0.7], [2, 2]), _record(2, [], [], ok=False)]
    run = LevelRun(label="sd/block/g4", strategy="sd", concurrency=2, requests=3, wall_s=2.0, warmup_ok=True,
                   warmup_s=0.1, memory={"workers": {"11": {"peak_rss_bytes": 100 * 2**20, "rss_bytes": 0},
                                                     "12": {"peak_rss_bytes": 50 * 2**20, "rss_bytes": 0}}})
    summary = summarize_level(run, records, max_tokens=4)
    assert (summary.requests, summary.completed, summary.failed, summary.short) == (3, 2, 1, 0)
    assert summary.tokens == 8 and summary.tokens_per_second == 4.0
    assert summary.ttft_median_s == pytest.approx(0.2)  # 0.1 and 0.3
    # ITL samples: 0.4 s over 2 tokens (0.2, 0.2), 0.1 s over 1 (0.1), 0.4 s over 2 (0.2, 0.2)
    assert summary.itl_median_s == pytest.approx(0.2)
    assert summary.chunk_gap_median_s == pytest.approx(0.4)  # gaps 0.4, 0.1, 0.4
    assert summary.tpot_median_s == pytest.approx((0.5 / 3 + 0.4 / 3) / 2)
    assert summary.tokens_per_chunk == pytest.approx(8 / 5)
    assert summary.block_efficiency == 2.0  # 8 tokens / 4 target calls
    assert (summary.worker_peak_rss_mib_total, summary.worker_peak_rss_mib_max, summary.workers) == (150, 100, 2)
    assert summary.errors == ["HTTP 500: boom"]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_strategies_send_the_requested_speculation():
    settings = ServeLoadSettings(strategies=("ar", "sd", "multi_draft", "ensemble", "se"))
    cases = {case.strategy: case for case in serve_load_cases(settings, ROLES)}
    assert cases["ar"].speculation == {"strategy": "ar"}
    assert cases["sd"].label == "sd/block/g4"
    assert cases["sd"].speculation == {"strategy": "sd", "method": "block", "gamma": 4}
    assert cases["multi_draft"].speculation == {"strategy": "multi_draft", "method": "spectr", "num_drafts": 2, "gamma": 4}
    assert cases["se"].speculation["members"] == ["target", "partner"] and cases["se"].speculation["gammas"] == [1, 1]
    assert settings.requests_for(1) == 32 and settings.requests_for(32) == 128
    with pytest.raises(ValueError, match="peer"):
        ServeLoadSettings(strategies=("peer",))
    with pytest.raises(ValueError, match="draft"):
        serve_load_cases(ServeLoadSettings(strategies=("sd",)), {"target": "target"})


def test_the_client_sends_the_api_key_of_the_application(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert _api_key({"args": {}}) is None
    assert _api_key({"args": {"security": {"api_key": "k" * 32}}}) == "k" * 32
    monkeypatch.setenv("SPECSERVE_API_KEY", "e" * 32)
    assert _api_key({"args": {}}) == "e" * 32
    client = LoadClient("http://127.0.0.1:1", "specserve", ServeLoadSettings(), [], api_key="e" * 32)
    assert client.headers == {"Authorization": "Bearer " + "e" * 32}


def test_flags_of_the_other_mode_are_refused(tmp_path):
    args = _parser().parse_args(["bench", "--mode", "serve-load", "--quick", "--out", str(tmp_path)])
    assert args.handler(args) == 2
    args = _parser().parse_args(["bench", "--concurrency", "1,2", "--out", str(tmp_path)])
    assert args.handler(args) == 2


def test_serve_load_section_is_appended_once_then_replaced():
    page = "# Benchmarks\n\n<!-- results:start -->\nold\n<!-- results:end -->\n"
    section = results_section("# Serving under load\n\n![serve_load](serve_load.png)\n", PLOT_FILES)
    assert section == "## Serving under load\n\n![serve_load](img/bench_serve_load.png)\n"
    once = splice(page, section, SERVE_LOAD_START, SERVE_LOAD_END, append=True)
    assert once.startswith(page) and once.count(SERVE_LOAD_START) == 1
    twice = splice(once, section.replace("Serving", "Still serving"), SERVE_LOAD_START, SERVE_LOAD_END, append=True)
    assert twice.count(SERVE_LOAD_START) == 1 and "Still serving" in twice and "## Serving" not in twice
    with pytest.raises(ValueError):
        splice("no markers", section, SERVE_LOAD_START, SERVE_LOAD_END)


@pytest.mark.timeout(300)
def test_serve_load_end_to_end(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the server starts its own local Ray
    document = yaml.safe_load((REPO / "deploy" / "default.yaml").read_text())
    args = document["applications"][0]["args"]
    args["models"] = {name: args["models"][name] for name in ("target", "draft")}  # embedded; fewer workers to start
    args["defaults"] = {key: value for key, value in args["defaults"].items() if key not in ("members", "ensemble", "mu")}
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    cli = _parser().parse_args([
        "bench", "--mode", "serve-load", "--config", str(config), "--concurrency", "1,2", "--strategies", "ar,sd",
        "--requests-per-level", "2", "--max-tokens", "4", "--out", str(out),
    ])
    assert cli.handler(cli) == 0

    results = json.loads((out / "results.json").read_text())
    assert results["kind"] == "serve-load"
    summaries = {(s["label"], s["concurrency"]): s for s in results["summaries"]}
    assert set(summaries) == {(label, c) for label in ("ar", "sd/block/g4") for c in (1, 2)}
    for key, s in summaries.items():
        assert (s["requests"], s["completed"], s["failed"], s["short"], s["tokens"]) == (2, 2, 0, 0, 8), key
        assert s["tokens_per_second"] > 0 and s["wall_s"] > 0
        assert 0 < s["ttft_median_s"] <= s["ttft_p99_s"] <= s["e2e_p99_s"]
        assert s["workers"] == 2 and s["worker_peak_rss_mib_max"] > 0
        assert s["worker_peak_rss_mib_total"] >= s["worker_peak_rss_mib_max"]
        assert s["block_efficiency"] >= 1.0
    records = results["records"]
    assert len(records) == 8 and sorted({r["seed"] for r in records}) == [0, 1]
    for record in records:
        assert record["ok"] and sum(record["chunk_tokens"]) == 4 and record["usage_completion_tokens"] == 4
        assert record["chunk_times_s"] == sorted(record["chunk_times_s"])
    assert all(level["warmup_ok"] and level["memory"]["peak"] == "during the level" for level in results["levels"])
    markdown = (out / "results.md").read_text()
    assert markdown.startswith("# Serving under load") and "Command: `specserve bench --mode serve-load" in markdown
    assert "| sd/block/g4 | 2 | 2 / 0 |" in markdown and "Peak resident memory of the model workers at concurrency 2" in markdown
    assert (out / "serve_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "specserve is serving" in (out / "server.log").read_text()  # the server's own output is kept
    # Re-rendering from results.json gives the same summaries.
    rerendered = rerender(out)
    assert [s.label for s in rerendered.summaries] == [s["label"] for s in results["summaries"]]
    assert json.loads((out / "results.json").read_text())["summaries"] == results["summaries"]
