"""The bare-model limit of serve-load levels: the per-strategy formulas, one tiny measurement on
the embedded models, and how the report carries it. Nothing about speed is asserted beyond the
arithmetic that ties a limit to its measured forwards."""

from __future__ import annotations

import json

import pytest

from benchmarks.served.bare_limit import (
    Forward,
    LevelShape,
    bare_limits,
    level_forwards,
    limit_record,
    prefill_forwards,
    representative_context,
    tokens_per_iteration,
)
from benchmarks.cli import build_bench_parser, serve_load_settings_from_args
from benchmarks.served.load_cases import ServeLoadSettings
from benchmarks.served.serve_load import level_shape
from benchmarks.served.serve_load_records import LevelRun, RequestRecord, ServeLoadResults
from benchmarks.served.serve_load_report import render_markdown
from models import embedded_model_path

ROLES = {"target": "target", "draft": "draft", "partner": "member"}


def _summarized(strategy: str, concurrency: int, max_tokens: int, run: LevelRun,
                records: list[RequestRecord]) -> ServeLoadResults:
    """One level's results, summarized as the report summarizes them."""
    settings = ServeLoadSettings(concurrency=(concurrency,), strategies=(strategy,), max_tokens=max_tokens)
    return ServeLoadResults(settings=settings.model_dump(mode="json"),
                            environment={"config": "x.yaml", "num_prompts": 1},
                            command="specserve bench --mode serve-load", levels=[run], records=records).summarize()


def test_forwards_per_iteration_follow_the_strategy():
    assert level_forwards(LevelShape("ar", 16), ROLES) == [Forward("target", 16, 1)]
    assert level_forwards(LevelShape("sd", 4, gamma=4), ROLES) == [Forward("draft", 4, 1, 4), Forward("target", 4, 5)]
    assert level_forwards(LevelShape("multi_draft", 4, gamma=3, num_drafts=2), ROLES) == [
        Forward("draft", 8, 1, 3), Forward("target", 8, 4)]
    assert level_forwards(LevelShape("ensemble", 2), ROLES) == [Forward("target", 2, 1), Forward("partner", 2, 1)]
    assert level_forwards(LevelShape("se", 2, gamma=1), ROLES) == [Forward("target", 2, 2), Forward("partner", 2, 2)]
    with pytest.raises(ValueError, match="role 'draft'"):
        level_forwards(LevelShape("sd", 1), {"target": "target"})
    with pytest.raises(ValueError, match="strategy"):
        level_forwards(LevelShape("beam", 1), ROLES)


def test_limit_is_tokens_per_iteration_over_the_iteration_time():
    ms = {"target: 16 x 1": 16.0, "draft: 16 x 1": 1.0, "target: 16 x 5": 36.0}
    ar = limit_record(LevelShape("ar", 16), [Forward("target", 16, 1)], ms, None, context=155)
    assert ar["limit_tokens_per_second"] == pytest.approx(1000.0)  # 16 tokens per 16 ms
    assert ar["block_efficiency"] is None and ar["forwards"][0]["ms"] == 16.0 and ar["context"] == 155
    sd_forwards = level_forwards(LevelShape("sd", 16, gamma=4), ROLES)
    sd = limit_record(LevelShape("sd", 16, gamma=4), sd_forwards, ms, 2.5, context=155)
    assert sd["iteration_ms"] == pytest.approx(4 * 1.0 + 36.0)
    assert sd["tokens_per_iteration"] == pytest.approx(40.0)
    assert sd["limit_tokens_per_second"] == pytest.approx(1000.0)  # 40 tokens per 40 ms
    # a verifying strategy without a measured block efficiency has no limit
    assert limit_record(LevelShape("sd", 16, gamma=4), sd_forwards, ms, None, 155)["limit_tokens_per_second"] is None
    assert tokens_per_iteration(LevelShape("ensemble", 3), None) == 3.0
    assert tokens_per_iteration(LevelShape("se", 3), 1.5) == pytest.approx(4.5)


def test_the_limit_with_the_prompt_adds_each_requests_prompt_forwards():
    assert prefill_forwards(LevelShape("ar", 16), ROLES, 131) == [Forward("target", 1, 131, cached=0)]
    assert prefill_forwards(LevelShape("sd", 2, gamma=4), ROLES, 131) == [
        Forward("draft", 1, 131, cached=0), Forward("target", 1, 131, cached=0)]
    assert Forward("target", 1, 131, cached=0).shape == "target: 1 x 131 after 0"
    with pytest.raises(ValueError, match="prompt_tokens"):
        prefill_forwards(LevelShape("ar", 1), ROLES, 0)
    ms = {"target: 2 x 1": 8.0, "target: 1 x 100 after 0": 40.0, "draft: 2 x 1": 1.0, "target: 2 x 5": 12.0,
          "draft: 1 x 100 after 0": 4.0}
    shape = LevelShape("ar", 2)
    ar = limit_record(shape, level_forwards(shape, ROLES), ms, None, context=120,
                      prompt=prefill_forwards(shape, ROLES, 100), max_tokens=11)
    # 2 requests of 11 tokens: 2 prompts (2 x 40 ms), then 10 iterations of 2 tokens (10 x 8 ms)
    assert ar["prompt_ms"] == 40.0 and ar["max_tokens"] == 11
    assert ar["limit_with_prompt_tokens_per_second"] == pytest.approx(22 / 0.160)
    assert ar["limit_tokens_per_second"] == pytest.approx(250.0)  # unchanged: 2 tokens per 8 ms
    shape = LevelShape("sd", 2, gamma=4)
    sd = limit_record(shape, level_forwards(shape, ROLES), ms, 2.5, context=120,
                      prompt=prefill_forwards(shape, ROLES, 100), max_tokens=11)
    # 2 x (4 + 40) ms of prompts, then (10 x 2 / 5) iterations of 4 x 1 + 12 ms
    assert sd["limit_with_prompt_tokens_per_second"] == pytest.approx(22 / ((2 * 44 + 4 * 16) / 1000))
    assert "limit_with_prompt_tokens_per_second" not in limit_record(shape, level_forwards(shape, ROLES), ms, 2.5, 120)


@pytest.mark.slow  # times forwards of the embedded models
def test_bare_limits_measure_the_embedded_models():
    paths = {"target": str(embedded_model_path("target")), "draft": str(embedded_model_path("draft"))}
    context = representative_context(paths["target"], ["def main(", "The river"], max_tokens=8)
    assert 4 < context < 20  # a few prompt tokens + 4
    shapes = [LevelShape("ar", 1), LevelShape("ar", 2), LevelShape("sd", 2, gamma=2)]
    records = bare_limits(shapes, [None, None, 1.5], {"target": "target", "draft": "draft"}, paths,
                          context=context, repeats=1)
    for record in records:
        assert record["context"] == context and all(f["ms"] > 0 for f in record["forwards"])
        assert record["limit_tokens_per_second"] == pytest.approx(
            record["tokens_per_iteration"] / (record["iteration_ms"] / 1000.0))
    assert records[1]["forwards"] == [{"model": "target", "rows": 2, "tokens": 1, "count": 1, "cached": None,
                                       "ms": records[1]["forwards"][0]["ms"]}]
    assert [f["model"] for f in records[2]["forwards"]] == ["draft", "target"] and records[2]["tokens_per_iteration"] == 3.0
    with pytest.raises(ValueError, match="model"):
        bare_limits([LevelShape("ar", 1)], [None], {"other": "target"}, paths, context=context, repeats=1)
    (with_prompt,) = bare_limits([LevelShape("sd", 1, gamma=2)], [1.5], {"target": "target", "draft": "draft"}, paths,
                                 context=context, repeats=1, prompt_tokens=6, max_tokens=8)
    assert [(f["model"], f["tokens"], f["cached"]) for f in with_prompt["prompt_forwards"]] == [
        ("draft", 6, 0), ("target", 6, 0)]
    assert all(f["ms"] > 0 for f in with_prompt["prompt_forwards"])
    assert 0 < with_prompt["limit_with_prompt_tokens_per_second"] < with_prompt["limit_tokens_per_second"]


def test_report_puts_the_limit_next_to_the_served_figure():
    bare = limit_record(LevelShape("sd", 2, gamma=4), level_forwards(LevelShape("sd", 2, gamma=4), ROLES),
                        {"draft: 2 x 1": 1.0, "target: 2 x 5": 6.0}, 2.0, context=150)  # 4 tokens / 10 ms
    run = LevelRun(label="sd/block/g4", strategy="sd", concurrency=2, requests=1, wall_s=0.04, warmup_ok=True,
                   warmup_s=0.1, bare=bare)
    record = RequestRecord(label="sd/block/g4", concurrency=2, index=0, prompt_id="p", seed=0, ok=True, error=None,
                           sent_s=0.0, e2e_s=0.04, chunk_times_s=[0.01, 0.04], chunk_tokens=[2, 2], target_calls=2)
    results = _summarized("sd", 2, 4, run, [record])
    summary = results.summaries[0]
    assert summary.tokens_per_second == pytest.approx(100.0)
    assert summary.bare_limit_tokens_per_second == pytest.approx(400.0)
    assert summary.served_over_limit == pytest.approx(0.25)
    markdown = render_markdown(results, {})
    assert "| tok/s | bare limit tok/s | served / limit |" in markdown
    assert "| sd/block/g4 | 2 | 1 / 0 | 100.0 | 400.0 | 25% |" in markdown
    assert "## Bare-model limit" in markdown
    assert "| sd/block/g4 | 2 | 4 x draft: 2 x 1 (1.0), 1 x target: 2 x 5 (6.0) | 10.0 | 4.00 | 400.0 |" in markdown
    assert "limit with prompt" not in markdown  # not measured: neither columns nor their definition
    again = ServeLoadResults.from_json(json.loads(json.dumps(results.to_json())))
    assert again.summaries[0].served_over_limit == pytest.approx(0.25)


def test_bare_limit_flag_and_level_shapes(tmp_path):
    parser = build_bench_parser()
    args = parser.parse_args(["--mode", "serve-load", "--bare-limit", "off", "--out", str(tmp_path)])
    assert serve_load_settings_from_args(args).bare_limit is False
    assert ServeLoadSettings().bare_limit is True
    args = parser.parse_args(["--bare-limit", "on", "--out", str(tmp_path)])
    assert args.handler(args) == 2  # a serve-load flag in suite mode
    settings = ServeLoadSettings(sd_gamma=3, se_gamma=2)
    assert level_shape(settings, "sd", 4) == LevelShape("sd", 4, gamma=3, num_drafts=2)
    assert level_shape(settings, "se", 4).gamma == 2 and level_shape(settings, "ar", 4).gamma == 1
    # gamma auto: the measured mean block, rounded; sd_gamma while the server reported none
    assert level_shape(settings, "sd", 1, "sd/block/gauto", mean_block=5.4).gamma == 5
    assert level_shape(settings, "sd", 1, "sd/block/gauto", mean_block=None).gamma == 3
    assert level_shape(settings, "sd", 1, "sd/block/g6", mean_block=5.4).gamma == 6


def test_a_levels_mean_block_is_drafted_tokens_per_target_call():
    from benchmarks.served.load_client import _drafted_tokens

    assert _drafted_tokens({"draft_lengths": [5, 5, 6, 0]}) == 16
    assert _drafted_tokens({}) is None and _drafted_tokens({"draft_lengths": []}) is None
    run = LevelRun(label="sd/block/gauto", strategy="sd", concurrency=1, requests=2, wall_s=1.0, warmup_ok=True,
                   warmup_s=0.1)
    records = [RequestRecord(label="sd/block/gauto", concurrency=1, index=i, prompt_id="p", seed=i, ok=True,
                             error=None, sent_s=0.0, e2e_s=0.5, chunk_times_s=[0.1], chunk_tokens=[8],
                             target_calls=calls, drafted_tokens=drafted)
               for i, (calls, drafted) in enumerate([(2, 11), (3, 14)])]
    results = _summarized("sd", 1, 8, run, records)
    assert results.summaries[0].mean_block == pytest.approx(25 / 5)
    assert results.summaries[0].block_efficiency == pytest.approx(16 / 5)


def test_report_puts_the_limit_with_the_prompt_next_to_the_served_figure():
    shape = LevelShape("ar", 1)
    ms = {"target: 1 x 1": 10.0, "target: 1 x 50 after 0": 30.0}
    bare = limit_record(shape, level_forwards(shape, ROLES), ms, None, context=52,
                        prompt=prefill_forwards(shape, ROLES, 50), max_tokens=4)  # 4 tokens in 30 + 3 x 10 ms
    run = LevelRun(label="ar", strategy="ar", concurrency=1, requests=1, wall_s=0.08, warmup_ok=True, warmup_s=0.1,
                   bare=bare)
    record = RequestRecord(label="ar", concurrency=1, index=0, prompt_id="p", seed=0, ok=True, error=None,
                           sent_s=0.0, e2e_s=0.08, chunk_times_s=[0.04, 0.08], chunk_tokens=[2, 2], target_calls=4)
    results = _summarized("ar", 1, 4, run, [record])
    summary = results.summaries[0]
    assert summary.tokens_per_second == pytest.approx(50.0)
    assert summary.limit_with_prompt_tokens_per_second == pytest.approx(4 / 0.060)
    assert summary.served_over_limit_with_prompt == pytest.approx(50.0 / (4 / 0.060))
    markdown = render_markdown(results, {})
    assert "| bare limit tok/s | served / limit | limit with prompt tok/s | served / that |" in markdown
    assert "| ar | 1 | 1 / 0 | 50.0 | 100.0 | 50% | 66.7 | 75% |" in markdown
    assert "| ar | 1 | 1 x target: 1 x 1 (10.0) | 10.0 | 1.00 | 100.0 | target: 1 x 50 (30.0) | 66.7 |" in markdown
