"""The self-draft benchmark's config, cases, table and command (benchmarks/peers/self_draft.py); no server."""

from __future__ import annotations

from benchmarks.peers.self_draft import cases, parse_args, public_command, rows, serve_config
from cluster.config import parse_app_args


def test_the_config_serves_the_model_with_its_quantized_copy_as_the_draft():
    args = parse_args(["--quantization", "int8", "--gamma", "3,5", "--threads", "2"])
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
    assert table[1]["case"] == "sd block g4, int4 copy" and table[1]["block_efficiency"] == 3.6


def test_the_recorded_command_leaves_out_places_of_this_machine():
    args = parse_args(["--rounds", "4", "--out", "/tmp/x", "--record=case"])
    assert public_command(args) == "python -m benchmarks.peers.self_draft --rounds 4"
