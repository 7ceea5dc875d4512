"""The results store and docs/results.md: the page is generated from the store (and stale when not),
records are checked, and every benchmark writer gives a record the page can render (fake data; no
Ray, no model)."""

import json

import pytest

from benchmarks.cli import build_bench_parser
from benchmarks.peers.vllm_peer import parse_args as vllm_peer_args
from benchmarks.reports.publish import publish
from benchmarks.reports.store import RESULTS_DIR, check_record, load_records, make_record, rounds, write_record
from benchmarks.reports.tables import PAGE, REGENERATE, main, render, update
from benchmarks.reports.writers import engine_load_record, gamma_of, serve_load_record, suite_record
from benchmarks.served.serve_load_records import LevelRun, RequestRecord, ServeLoadResults

FIXED = {"commit": "abc1234", "date": "2026-01-01", "machine": "test machine"}


def test_docs_results_page_is_generated_from_the_store():
    assert PAGE.read_text(encoding="utf-8") == render(load_records(RESULTS_DIR)), \
        f"docs/results.md is stale: run `{REGENERATE}`"


def test_every_stored_record_names_its_command_commit_date_and_machine():
    records = load_records(RESULTS_DIR)
    assert records, "the store is empty"
    for record in records:
        assert record["command"].startswith(("specserve ", "python ")), record["case"]
        assert len(record["date"]) == 10 and record["date"][4] == "-", record["case"]


def test_check_names_the_missing_or_wrong_field():
    good = make_record("x-1", "X", "python -m x", [{"a": 1}], **FIXED)
    for broken, field in [({k: v for k, v in good.items() if k != "commit"}, "'commit'"),
                          (dict(good, rows=[]), "'rows'"), (dict(good, case="X 1"), "record.case"),
                          (dict(good, rows=[{"a": {"median": 1}}]), "rows[0].a")]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[")):
            check_record(broken)


def test_rounds_keep_every_round_and_the_median():
    assert rounds([265.24, 287.0, 277.4]) == {"rounds": [265.2, 287.0, 277.4], "median": 277.4}


def _level(label: str, clients: int, tokens_per_chunk: int) -> tuple[LevelRun, RequestRecord]:
    run = LevelRun(label=label, strategy=label.split("/")[0], concurrency=clients, requests=1, wall_s=1.0,
                   warmup_ok=True, warmup_s=0.1)
    record = RequestRecord(label=label, concurrency=clients, index=0, prompt_id="p", seed=0, ok=True, error=None,
                           sent_s=0.0, e2e_s=0.5, chunk_times_s=[0.02, 0.5], chunk_tokens=[tokens_per_chunk] * 2,
                           target_calls=2)
    return run, record


def _serve_load_results() -> ServeLoadResults:
    levels = [_level("ar", 1, 1), _level("sd/block/g4", 1, 3), _level("sd/block/gauto", 1, 2)]
    return ServeLoadResults(settings={"max_tokens": 6}, environment={"config": "deploy/x.yaml", "git_commit": "abc1234"},
                            command="specserve bench --mode serve-load --record x", levels=[r for r, _ in levels],
                            records=[q for _, q in levels]).summarize()


def test_serve_load_record_rows_and_the_strategy_table(tmp_path):
    record = serve_load_record(_serve_load_results(), "served-x")
    assert record["commit"] == "abc1234" and record["command"].startswith("specserve bench")
    rows = {row["case"]: row for row in record["rows"]}
    assert rows["ar"]["tokens_per_second"] == 2.0 and rows["ar"]["ratio_to_ar"] == 1.0
    assert rows["sd/block/g4"]["gamma"] == 4 and rows["sd/block/g4"]["ratio_to_ar"] == 3.0
    assert rows["sd/block/gauto"]["gamma"] == "auto" and rows["sd/block/g4"]["block_efficiency"] == 3.0
    page = tmp_path / "results.md"
    update(record, tmp_path / "store", page)
    text = page.read_text()
    assert "## Which strategy and gamma" in text and "|sd|4|6.0|3.00x|3.0|" in text
    assert text.count("### Served load") == 1 and text.count("\n_abc1234, ") == 1
    assert main(["--check", "--results", str(tmp_path / "store"), "--page", str(page)]) == 0
    page.write_text(text + "edited\n")
    assert main(["--check", "--results", str(tmp_path / "store"), "--page", str(page)]) == 1


def test_rounds_render_with_their_median_and_ratio_from_medians_when_not_recorded():
    rows = [{"strategy": "ar", "clients": 1, "tokens_per_second": rounds([100, 110, 90])},
            {"strategy": "sd", "gamma": 4, "clients": 1, "tokens_per_second": rounds([150, 140, 160])}]
    text = render([make_record("r", "R", "python -m x", rows, **FIXED)])
    assert "|strategy|gamma|tok/s @1|x ar @1|\n" in text and "|sd|4|150.0|1.50x|\n" in text
    rows[1]["ratio_to_ar"] = rounds([1.5, 1.4, 1.6], 2)
    assert "|sd|4|150.0|1.50x (1.40-1.60)|\n" in render([make_record("r", "R", "python -m x", rows, **FIXED)])


def test_records_go_to_their_sections_once_and_empty_columns_are_dropped():
    served = make_record("serve-load-x", "Served X", "python -m x", [
        {"strategy": "ar", "clients": 1, "tokens_per_second": 10.0},
        {"case": "ensemble / se", "clients": 1, "tokens_per_second": "9 / 8"},
        {"case": "no clients", "note": "kept"}], **FIXED)
    peer = make_record("vllm-peer-x", "Peer X", "python -m x", [{"case": "vLLM", "x_vllm": rounds([1.0, 1.2, 0.9], 2),
                                                                  "unused": None}], **FIXED)
    other = make_record("new-case", "New", "python -m x", [{"a": 1}], **FIXED)
    placed = make_record("new-case-2", "Placed", "python -m x", [{"a": 2}], section="Engine", **FIXED)
    text = render([peer, other, served, placed])
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings == ["# Results", "## Which strategy and gamma", "### Served X", "## Engine", "### Placed",
                        "## Peers", "### Peer X", "## Other results", "### New"]
    assert text.count("_abc1234, 2026-01-01:_") == 4 and "|ensemble / se|–|9 / 8|–|" in text and "|no clients|kept|" in text
    assert "|case|x vLLM|\n|---|---|\n|vLLM|1.0 (0.9-1.2)|" in text


def test_publish_writes_a_serve_load_run_and_a_suite_run_into_the_store(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(_serve_load_results().to_json()))
    store, page = tmp_path / "store", tmp_path / "results.md"
    assert publish(run, "served-x", results_dir=store, page=page) == store / "served-x.json"
    suite = {"command": "specserve bench --out x", "environment": {"git_commit": "def5678"},
             "summaries": [{"label": "sd block g4", "mode": "ray", "tokens_per_second": 101.04, "speedup": 1.104,
                            "block_efficiency": 3.42}]}
    (run / "results.json").write_text(json.dumps(suite))
    publish(run, "suite-x", results_dir=store, page=page)
    assert [r["case"] for r in load_records(store)] == ["served-x", "suite-x"]
    assert json.loads((store / "suite-x.json").read_text())["rows"][0]["speedup"] == 1.1
    assert "|sd block g4|ray|101.0|1.1|3.42|" in page.read_text()
    assert suite_record(suite, "s")["commit"] == "def5678"


def test_engine_load_record_and_the_writers_record_option(tmp_path):
    record = engine_load_record("engine-x", "python -m benchmarks.served.engine_load --strategy sd", strategy="sd",
                                gamma=4, clients=16, tokens_per_second=1387.04, ttft_p50_ms=12.34)
    assert record["rows"] == [{"case": "sd gamma 4", "strategy": "sd", "gamma": 4, "clients": 16,
                               "tokens_per_second": 1387.0, "ttft_p50_ms": 12.3}]
    assert write_record(record, tmp_path) == tmp_path / "engine-x.json"
    assert gamma_of("se/draft/weighted/n2/g5") == 5 and gamma_of("ar") is None
    assert build_bench_parser().parse_args(["--mode", "serve-load", "--out", "o", "--record", "c"]).record == "c"
    assert vllm_peer_args(["--venv", "v", "--out", "o", "--record", "c"]).record == "c"


def test_the_common_machine_is_named_once_and_repeated_notes_once():
    # The header names the machine most records share; a line shows what its machine adds, or another machine whole.
    same = make_record("serve-load-a", "A", "python -m a", [{"a": 1}], notes="Three rounds.", **FIXED)
    more = make_record("serve-load-b", "B", "python -m b", [{"a": 2}], notes="Three rounds.",
                       **dict(FIXED, machine="test machine, quiet"))
    other = make_record("serve-load-c", "C", "python -m c", [{"a": 3}], notes="Two passes.",
                        **dict(FIXED, machine="1 x H200"))
    text = render([same, more, dict(same, case="serve-load-d", title="D")])
    assert "machine (a\ntest machine unless" in text
    lines = [line for line in text.splitlines() if line.startswith("_abc1234")]
    assert lines == ["_abc1234, 2026-01-01:_ `python -m a`", "_abc1234, 2026-01-01, quiet:_ `python -m b`",
                     "_abc1234, 2026-01-01:_ `python -m a`"]
    assert text.count("Three rounds.") == 1 and text.count("As above.") == 2
    assert "_abc1234, 2026-01-01, 1 x H200:_ `python -m c`" in render([same, same, other])
    assert "Two passes." in render([same, same, other])
