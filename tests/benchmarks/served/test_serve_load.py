"""``specserve bench --mode serve-load``: level statistics, strategies, and one tiny
run end to end against the real HTTP server (``specserve serve`` in a subprocess with its own
Ray) on the embedded target and draft. Nothing about speed is asserted, only that every level
ran its requests and that the bookkeeping holds together."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import yaml

from actors.worker.cpu_binding import torch_thread_count
from benchmarks.cli import build_bench_parser, overlap_list, serve_load_settings_from_args
from benchmarks.served.run import rerender
from benchmarks.served.load_cases import ServeLoadSettings, serve_load_cases
from benchmarks.served.load_client import LoadClient
from benchmarks.served.serve_load import _api_key
from benchmarks.served.server_process import ServerProcess, busy_fractions, engine_config, worker_seconds, write_engine_config
from benchmarks.served.serve_load_records import LevelRun, RequestRecord, ServeLoadResults, percentile, summarize_level
from benchmarks.served.serve_load_report import busy_text, render_markdown
from cluster.config import load_app_args

REPO = pathlib.Path(__file__).resolve().parents[3]
ROLES = {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}


def _parser() -> argparse.ArgumentParser:
    return build_bench_parser()


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
    assert cases["se"].speculation["proposer"] == "alternate"
    (auto,) = serve_load_cases(ServeLoadSettings(strategies=("se",), se_gamma="auto"), ROLES)
    assert auto.speculation["gamma"] == "auto" and "gammas" not in auto.speculation and auto.label.endswith("/gauto")
    assert settings.requests_for(1) == 32 and settings.requests_for(32) == 128
    with pytest.raises(ValueError, match="peer"):
        ServeLoadSettings(strategies=("peer",))
    with pytest.raises(ValueError, match="draft"):
        serve_load_cases(ServeLoadSettings(strategies=("sd",)), {"target": "target"})


def test_sd_cases_per_block_length_with_auto():
    from benchmarks.served.serve_load import level_shape

    settings = ServeLoadSettings(strategies=("ar", "sd"), sd_gammas=(4, "auto"), gamma_max=6)
    sd = [case for case in serve_load_cases(settings, ROLES) if case.strategy == "sd"]
    assert [case.label for case in sd] == ["sd/block/g4", "sd/block/gauto"]
    assert sd[1].speculation == {"strategy": "sd", "method": "block", "gamma": "auto", "gamma_max": 6}
    assert level_shape(settings, "sd", 1, "sd/block/g4").gamma == 4
    assert level_shape(settings.model_copy(update={"sd_gammas": (2,)}), "sd", 1, "sd/block/g2").gamma == 2
    assert level_shape(settings, "sd", 1, "sd/block/gauto").gamma == settings.sd_gamma


def test_the_client_sends_the_api_key_of_the_application(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert _api_key({"args": {}}) is None
    assert _api_key({"args": {"security": {"api_key": "k" * 32}}}) == "k" * 32
    monkeypatch.setenv("SPECSERVE_API_KEY", "e" * 32)
    assert _api_key({"args": {}}) == "e" * 32
    client = LoadClient("http://127.0.0.1:1", "specserve", ServeLoadSettings(), [], api_key="e" * 32)
    assert client.headers == {"Authorization": "Bearer " + "e" * 32}


def test_flags_of_the_other_mode_are_refused(tmp_path):
    args = _parser().parse_args(["--mode", "serve-load", "--quick", "--out", str(tmp_path)])
    assert args.handler(args) == 2
    args = _parser().parse_args(["--concurrency", "1,2", "--out", str(tmp_path)])
    assert args.handler(args) == 2


@pytest.mark.ray  # starts a server (and its own local Ray)
@pytest.mark.timeout(300)
def test_serve_load_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plots need the `bench` extra: pip install -e '.[bench]'")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the server starts its own local Ray
    document = yaml.safe_load((REPO / "deploy" / "default.yaml").read_text())
    args = document["applications"][0]["args"]
    args["models"] = {name: args["models"][name] for name in ("target", "draft")}  # embedded; fewer workers to start
    args["defaults"] = {key: value for key, value in args["defaults"].items() if key not in ("members", "ensemble", "mu")}
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    cli = _parser().parse_args([
        "--mode", "serve-load", "--config", str(config), "--concurrency", "1,2", "--strategies", "ar,sd",
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
        # placement auto on CPU: the target and its draft share one worker process
        assert s["workers"] == 1 and s["worker_peak_rss_mib_max"] > 0
        assert s["worker_peak_rss_mib_total"] >= s["worker_peak_rss_mib_max"]
        assert s["block_efficiency"] >= 1.0
        # busy fractions from the server's /metrics: both workers, fractions of the level's wall time
        assert set(s["busy"]) == {"target", "draft"}, key
        for worker, busy in s["busy"].items():
            assert 0 <= busy["forward_fraction"] <= busy["step_fraction"] <= 1.05, (key, worker)
        assert s["busy"]["target"]["forward_fraction"] > 0  # the draft is idle under ar
        assert (s["busy"]["draft"]["forward_fraction"] > 0) == (key[0] != "ar"), key
        # the bare-model limit (on by default), measured after the server stopped
        assert s["bare_limit_tokens_per_second"] > 0, key
        assert s["served_over_limit"] == pytest.approx(s["tokens_per_second"] / s["bare_limit_tokens_per_second"])
    # torch_threads auto: the cores of this process (the benchmark's), bound or not by earlier tests
    assert results["environment"]["bare_limit"]["torch_threads"] == torch_thread_count("auto")
    sd_bare = next(level["bare"] for level in results["levels"] if level["label"] == "sd/block/g4")
    assert [(f["model"], f["tokens"], f["count"]) for f in sd_bare["forwards"]] == [("draft", 1, 4), ("target", 5, 1)]
    records = results["records"]
    assert len(records) == 8 and sorted({r["seed"] for r in records}) == [0, 1]
    for record in records:
        assert record["ok"] and sum(record["chunk_tokens"]) == 4 and record["usage_completion_tokens"] == 4
        assert record["chunk_times_s"] == sorted(record["chunk_times_s"])
    assert all(level["warmup_ok"] and level["memory"]["peak"] == "during the level" for level in results["levels"])
    markdown = (out / "results.md").read_text()
    assert markdown.startswith("# Serving under load") and "Command: `specserve bench --mode serve-load" in markdown
    assert "| sd/block/g4 | 2 | 2 / 0 |" in markdown and "Peak resident memory of the model workers at concurrency 2" in markdown
    assert "## Busy fraction of the model workers" in markdown and "| strategy | concurrency | draft | target |" in markdown
    assert "| bare limit tok/s | served / limit |" in markdown and "## Bare-model limit" in markdown
    assert (out / "serve_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "specserve is serving" in (out / "server.log").read_text()  # the server's own output is kept
    # Re-rendering from results.json gives the same summaries.
    rerendered = rerender(out)
    assert [s.label for s in rerendered.summaries] == [s["label"] for s in results["summaries"]]
    assert json.loads((out / "results.json").read_text())["summaries"] == results["summaries"]


# ----------------------------------------------------------------------------- busy fractions

def _metrics_text(forward: float, step: float, replica: str = "r1") -> str:
    """A ``/metrics`` text as the server renders it (cluster.serving.metrics), one group with two workers."""
    from actors.coordination.metrics import GroupIdentity, SchedulerMetrics, group_snapshot
    from cluster.serving.metrics import ScrapeResult, render

    workers = {"target": {"forward_seconds_total": forward, "step_seconds_total": step, "steps": 3,
                          "forward_passes_total": 3, "sessions": 1},
               "draft": {"forward_seconds_total": forward / 4, "step_seconds_total": step / 2, "steps": 3,
                         "forward_passes_total": 3, "sessions": 1}}
    snapshot = group_snapshot(GroupIdentity("specserve", replica), SchedulerMetrics().recorder, running=0, waiting=0,
                              worker_totals=workers, workers_failed=0)
    return render("specserve", ScrapeResult([snapshot])).decode()


def test_busy_fractions_from_two_metrics_scrapes():
    before = worker_seconds(_metrics_text(10.0, 12.0))
    assert before == {"draft": {"forward_s": 2.5, "step_s": 6.0}, "target": {"forward_s": 10.0, "step_s": 12.0}}
    after = worker_seconds(_metrics_text(13.0, 16.0))
    busy = busy_fractions(before, after, wall_s=4.0)
    assert busy["target"] == {"forward_fraction": pytest.approx(0.75), "step_fraction": pytest.approx(1.0)}
    assert busy["draft"] == {"forward_fraction": pytest.approx(0.1875), "step_fraction": pytest.approx(0.5)}
    # a counter that went down (the worker restarted) gives no fraction; a missing scrape, none at all
    assert busy_fractions(after, before, wall_s=4.0)["target"] == {"forward_fraction": None, "step_fraction": None}
    assert busy_fractions(None, after, wall_s=4.0) is None
    assert busy_text(busy) == "draft 19% / 50%, target 75% / 100%"
    assert busy_text(None) == "n/a"


def test_worker_seconds_names_replicas_only_when_there_are_several():
    text = (
        "# HELP specserve_worker_forward_seconds_total f\n# TYPE specserve_worker_forward_seconds_total counter\n"
        'specserve_worker_forward_seconds_total{model_group="specserve",replica="a",worker="target"} 1.5\n'
        'specserve_worker_forward_seconds_total{model_group="specserve",replica="b",worker="target"} 2.5\n'
        'specserve_worker_forward_seconds_total{model_group="other",replica="c",worker="target"} 9.0\n'
        "# HELP specserve_worker_step_seconds_total s\n# TYPE specserve_worker_step_seconds_total counter\n"
        'specserve_worker_step_seconds_total{model_group="specserve",replica="a",worker="target"} 2.0\n'
    )
    assert worker_seconds(text, "specserve") == {"target@a": {"forward_s": 1.5, "step_s": 2.0},
                                                 "target@b": {"forward_s": 2.5}}
    assert len(worker_seconds(text)) == 3
    assert busy_fractions({"target@b": {"forward_s": 2.5}}, {"target@b": {"forward_s": 3.5}}, 2.0) == {
        "target@b": {"forward_fraction": 0.5, "step_fraction": None}}


# ----------------------------------------------------------------------------- overlap passes

def test_overlap_option_and_config_rewrite(tmp_path):
    assert overlap_list("on,off") == (False, True) and overlap_list("ON") == (True,)
    with pytest.raises(argparse.ArgumentTypeError):
        overlap_list("maybe")
    args = _parser().parse_args(["--mode", "serve-load", "--overlap", "on,off", "--out", str(tmp_path)])
    settings = serve_load_settings_from_args(args)
    assert settings.overlap == (False, True) and settings.overlap_passes() == [False, True]
    assert ServeLoadSettings().overlap_passes() == [None]
    args = _parser().parse_args(["--overlap", "on", "--out", str(tmp_path)])
    assert args.handler(args) == 2  # a serve-load flag in suite mode

    source = REPO / "deploy" / "default.yaml"
    original = yaml.safe_load(source.read_text())
    for overlap in (False, True):
        path = write_engine_config(source, None, "overlap", overlap, tmp_path)
        assert path.parent == tmp_path and path.name == f"default.overlap-{'on' if overlap else 'off'}.yaml"
        written = yaml.safe_load(path.read_text())
        assert written["applications"][0]["args"]["engine"] == {"overlap": overlap}
        written["applications"][0]["args"].pop("engine")
        assert written == original  # nothing else changes
        assert load_app_args(path).engine.overlap is overlap  # the server accepts the copy
    document = {"applications": [{"name": "a", "args": {"engine": {"overlap": True}}}, {"name": "b"}]}
    changed = engine_config(document, "b", {"overlap": False}, "test")
    assert changed["applications"][1]["args"] == {"engine": {"overlap": False}}
    assert document["applications"][1] == {"name": "b"}  # the original is untouched
    assert engine_config(document, "a", {"overlap": False}, "test")["applications"][0]["args"]["engine"] == {"overlap": False}


def test_prefix_caching_flag_writes_a_config_copy(tmp_path):
    """--prefix-caching on|off: settings, and a copy of the YAML that differs only in
    args.engine.prefix_caching and that the server accepts."""
    args = _parser().parse_args(["--mode", "serve-load", "--prefix-caching", "off", "--out", str(tmp_path)])
    assert serve_load_settings_from_args(args).prefix_caching is False
    source = REPO / "deploy" / "default.yaml"
    original = yaml.safe_load(source.read_text())
    for enabled in (False, True):
        path = write_engine_config(source, None, "prefix_caching", enabled, tmp_path)
        assert path.name == f"default.prefix-caching-{'on' if enabled else 'off'}.yaml"
        written = yaml.safe_load(path.read_text())
        assert written["applications"][0]["args"]["engine"] == {"prefix_caching": enabled}
        written["applications"][0]["args"].pop("engine")
        assert written == original
        assert load_app_args(path).engine.prefix_caching is enabled


def test_direct_http_flag_starts_the_server_with_a_replica_port_and_the_clients_call_it(tmp_path):
    """--direct-http on: the server gets --direct-http-port (a free port of its own) and the load
    goes there; off (the default): the clients call Serve's proxy."""
    args = _parser().parse_args(["--mode", "serve-load", "--direct-http", "on", "--out", str(tmp_path)])
    assert serve_load_settings_from_args(args).direct_http is True
    server = ServerProcess(REPO / "deploy" / "default.yaml", tmp_path / "server.log", 10.0, direct_http=True)
    command = server.command()
    assert command[command.index("--direct-http-port") + 1] == str(server.direct_http_port)
    assert len({server.http_port, server.grpc_port, server.direct_http_port}) == 3
    assert server.client_url == f"http://127.0.0.1:{server.direct_http_port}" != server.url
    proxied = ServerProcess(REPO / "deploy" / "default.yaml", tmp_path / "server.log", 10.0)
    assert "--direct-http-port" not in proxied.command() and proxied.client_url == proxied.url


def _level(label: str, concurrency: int, overlap: bool | None, wall_s: float, busy=None) -> tuple[LevelRun, list]:
    run = LevelRun(label=label, strategy=label.split("/")[0], concurrency=concurrency, requests=1, wall_s=wall_s,
                   warmup_ok=True, warmup_s=0.1, overlap=overlap, busy=busy)
    record = RequestRecord(label=label, concurrency=concurrency, index=0, prompt_id="p", seed=0, ok=True, error=None,
                           sent_s=0.0, e2e_s=0.5, chunk_times_s=[0.1, 0.5], chunk_tokens=[2, 2], overlap=overlap)
    return run, [record]


def _results(levels) -> ServeLoadResults:
    return ServeLoadResults(
        settings=ServeLoadSettings(concurrency=(2,), strategies=("sd",), max_tokens=4).model_dump(mode="json"),
        environment={"config": "x.yaml", "num_prompts": 1}, command="specserve bench --mode serve-load",
        levels=[run for run, _ in levels], records=[r for _, records in levels for r in records]).summarize()


def test_report_puts_overlap_off_and_on_side_by_side_with_busy_fractions():
    busy_off = {"target": {"forward_fraction": 0.5, "step_fraction": 0.6},
                "draft": {"forward_fraction": 0.1, "step_fraction": 0.2}}
    busy_on = {"target": {"forward_fraction": 0.7, "step_fraction": 0.8},
               "draft": {"forward_fraction": 0.2, "step_fraction": None}}
    results = _results([_level("sd/block/g4", 2, False, 2.0, busy_off), _level("sd/block/g4", 2, True, 1.0, busy_on)])
    assert [(s.overlap, s.tokens_per_second) for s in results.summaries] == [(False, 2.0), (True, 4.0)]
    assert results.summaries[1].busy == busy_on
    markdown = render_markdown(results, {})
    assert "| strategy | concurrency | overlap off tok/s | overlap on tok/s | on/off | busy fractions off " \
           "| busy fractions on |" in markdown
    assert ("| sd/block/g4 | 2 | 2.0 | 4.0 | 2.00x | target 50% / 60%, draft 10% / 20% "
            "| target 70% / 80%, draft 20% / – |") in markdown
    assert "| strategy | concurrency | overlap | target | draft |" in markdown  # the busy table
    assert "| sd/block/g4 | 2 | off | 50% / 60% | 10% / 20% |" in markdown
    assert "| sd/block/g4 | 2 | on | 1 / 0 |" in markdown  # the level table carries the setting
    # results.json round trip keeps the passes apart
    again = ServeLoadResults.from_json(json.loads(json.dumps(results.to_json())))
    assert [(s.overlap, s.busy) for s in again.summaries] == [(False, busy_off), (True, busy_on)]


def test_single_pass_report_keeps_its_format():
    # A run recorded before overlap and busy fractions existed renders as it did.
    results = _results([_level("sd/block/g4", 2, None, 1.0)])
    markdown = render_markdown(results, {})
    assert "| strategy | concurrency | ok / failed | tok/s |" in markdown and "overlap" not in markdown
    assert "Busy fraction" not in markdown
    busy = {"target": {"forward_fraction": 0.25, "step_fraction": 0.5}}
    markdown = render_markdown(_results([_level("sd/block/g4", 2, True, 1.0, busy)]), {})
    assert "overlap off tok/s" not in markdown and "Scheduler overlap (`args.engine.overlap`): on." in markdown
    assert "## Busy fraction of the model workers" in markdown and "| sd/block/g4 | 2 | 25% / 50% |" in markdown
