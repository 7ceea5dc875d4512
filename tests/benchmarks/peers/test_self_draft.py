"""The self-draft benchmark's config, cases, table and command (benchmarks/peers/self_draft.py); no server."""

from __future__ import annotations

from benchmarks.peers.self_draft import cases, parse_args, public_command, rows, serve_config, split_rows, split_seconds
from benchmarks.served.serve_load_records import RequestRecord
from cluster.config import parse_app_args


def test_the_config_serves_the_model_with_its_quantized_copy_as_the_draft():
    args = parse_args(["--quantization", "int8", "--gamma", "3,5", "--threads", "2"])
    assert parse_args(["--quantization", "w8a8"]).quantization == "w8a8"
    config = serve_config("/models/m", args)
    app_args = config["applications"][0]["args"]
    assert app_args["models"]["draft"] == {"path": "/models/m", "role": "draft", "dtype": "bfloat16", "quantization": "int8"}
    assert app_args["models"]["target"]["path"] == "/models/m" and app_args["resources"]["torch_threads"] == 2
    frozen = parse_app_args(app_args).freeze()  # a valid deployment
    assert frozen.roles == {"target": "target", "draft": "draft"}
    assert [case.label for case in cases(args.gamma)] == ["ar", "sd/block/g3", "sd/block/g5"]


def test_the_table_gives_each_case_its_median_ratio_to_ar():
    args = parse_args(["--gamma", "4"])
    measured = {"ar": {"tokens_per_s": [10.0, 8.0, 9.0], "block_efficiency": [1.0, 1.0, 1.0]},
                "sd/block/g4": {"tokens_per_s": [15.0, 16.0, 9.0], "block_efficiency": [3.5, 3.7, 3.6]}}
    table = rows(measured, args)
    assert table[0]["x ar"] == "1.00x" and table[1]["x ar"] == "1.50x"  # ratios 1.5, 2.0, 1.0
    assert table[1]["case"] == "sd g4, int4" and table[1]["block_efficiency"] == 3.6


def test_the_recorded_command_leaves_out_places_of_this_machine():
    args = parse_args(["--rounds", "4", "--out", "/tmp/x", "--record=case"])
    assert public_command(args) == "python -m benchmarks.peers.self_draft --rounds 4"


def _record(ok: bool, tokens: int, times: dict[str, float] | None) -> RequestRecord:
    return RequestRecord(label="sd", concurrency=1, index=0, prompt_id="p", seed=0, ok=ok, error=None, sent_s=0.0,
                         e2e_s=1.0, chunk_times_s=[0.1] * tokens, chunk_tokens=[1] * tokens, times_s=times)


def test_the_split_gives_each_part_its_ms_per_token_over_completed_requests():
    times = {"draft_s": 0.2, "target_s": 0.4, "verify_s": 0.05, "coordination_s": 0.15}
    records = [_record(True, 10, times), _record(True, 30, times), _record(False, 5, times), _record(True, 7, None)]
    seconds = split_seconds(records)  # the failed request and the one without stats are left out
    assert seconds["tokens"] == 40 and abs(seconds["draft_s"] - 0.4) < 1e-12
    measured = {"sd/block/g4": {part: [value, value] for part, value in seconds.items()}}
    (row,) = split_rows(measured)
    assert row == {"case": "sd/block/g4", "draft ms": 10.0, "target ms": 20.0, "verify ms": 2.5, "rest ms": 7.5}
