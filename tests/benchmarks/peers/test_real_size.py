"""The real-size benchmark runs end to end on a tiny shape (no Ray): it builds the checkpoint, counts
the weights a forward reads, measures the bandwidth and prints every dtype and level with its
fraction of the limit and the bfloat16 / float32 ratios; its served config validates, and vLLM
without a venv is skipped with a message."""

from __future__ import annotations

import argparse
import re
import types

import pytest

from benchmarks.peers import real_size, real_size_served
from cluster.config import parse_app_args

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=4096)


def test_forward_weight_bytes_counts_every_weight_but_the_input_embedding(tmp_path):
    path = real_size.build_checkpoint(TINY, tmp_path, "tiny")
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q/k/v, o, gate/up/down, two norms
    count = 2 * layer + 64 + 2 * 4096 * 64  # layers, final norm, embedding and head (not tied)
    read = count - 4096 * 64
    assert real_size.forward_weight_bytes(path, "float32") == (count, 4 * read)
    assert real_size.forward_weight_bytes(path, "bfloat16") == (count, 2 * read)
    assert (path / "tokenizer.json").exists()


def test_real_size_prints_each_dtype_level_and_fraction(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(real_size.SHAPES, "tiny", TINY)
    monkeypatch.setattr(real_size, "BANDWIDTH_BYTES", 2**20)
    args = ["--shape", "tiny", "--rounds", "2", "--concurrency", "1,2", "--requests-per-client", "1",
            "--max-tokens", "3", "--threads", "1", "--max-model-len", "256", "--out", str(tmp_path)]
    assert real_size.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"Memory bandwidth \(torch sum over 1 MiB, best pass\): [\d.]+ GB/s \(rounds: [\d.]+, [\d.]+\)", out)
    for dtype in ("float32", "bfloat16"):
        for clients in (1, 2):
            row = rf"\| {dtype} \| {clients} \| [\d.]+ \| \d+ \| [\d.]+ \| [\d.e-]+ GB \| [\d.]+ \| \d+% \| [\d.]+ \|"
            assert re.search(row, out), (dtype, clients)
    assert len(re.findall(r"bfloat16 / float32, clients \d: [\d.]+x tokens/s, decode forward [\d.]+x as fast", out)) == 2
    assert (tmp_path / "real-size.md").read_text().strip() in out


def test_serve_config_is_a_valid_group_and_vllm_without_a_venv_is_skipped(capsys, tmp_path):
    config = real_size_served.serve_config(tmp_path / "model", "bfloat16", 2, 16, 1024)
    group = parse_app_args(config["applications"][0]["args"])
    assert group.models["target"].dtype == "bfloat16" and group.resources.torch_threads == 2
    assert parse_app_args(real_size_served.serve_config(tmp_path, "float32", "auto", 1, 256)["applications"][0]["args"]) \
        .resources.torch_threads == "auto"
    args = argparse.Namespace(vllm_venv=tmp_path / "no-venv", max_tokens=4, serve_requests=1, threads=1,
                              max_model_len=256)
    assert real_size_served.serve_vllm(tmp_path / "model", "bfloat16", [1], args, tmp_path / "out") == []
    assert "vLLM skipped" in capsys.readouterr().out


def _summary(clients: int, tokens_per_second: float, ttft_s: float):
    return types.SimpleNamespace(concurrency=clients, tokens_per_second=tokens_per_second, ttft_median_s=ttft_s)


def test_served_rounds_interleave_the_servers_and_the_table_takes_medians_and_each_rounds_ratio(monkeypatch, tmp_path):
    """Round 1 runs float32 then bfloat16, specserve then vLLM; round 2 the reverse of both. The row of a
    (dtype, clients) holds both servers' medians, the median of each round's ratio, the engine alone's
    tokens/s and its forward's fraction of the bandwidth limit; the store takes it as a record."""
    calls = []
    speeds = {"specserve": [10.0, 14.0], "vllm": [20.0, 20.0]}

    def fake(server):
        def serve(path, dtype, levels, args, out):
            calls.append((server, dtype))
            tok = speeds[server][sum(1 for c in calls if c == (server, dtype)) - 1]
            return [_summary(c, tok * c, 0.1 * c) for c in levels]
        return serve

    monkeypatch.setattr(real_size_served, "SERVERS", {name: fake(name) for name in ("specserve", "vllm")})
    args = real_size.parse_args(["--serve", "specserve,vllm", "--concurrency", "1,4", "--serve-rounds", "2",
                                 "--record", "real-size-test"])
    served = real_size_served.served_rounds(tmp_path / "model", args, tmp_path)
    assert calls == [("specserve", "float32"), ("vllm", "float32"), ("specserve", "bfloat16"), ("vllm", "bfloat16"),
                     ("vllm", "bfloat16"), ("specserve", "bfloat16"), ("vllm", "float32"), ("specserve", "float32")]
    samples = real_size.Samples()
    for dtype, forward in (("float32", 0.04), ("bfloat16", 0.02)):
        for clients in (1, 4):
            samples.by_case[(dtype, clients)] += [real_size.Sample(5.0 * clients, 0.1, forward)] * 2
    rows = real_size_served.served_rows(served, samples, args.dtypes, [1, 4], {"float32": 4e9, "bfloat16": 2e9}, 200e9)
    row = next(r for r in rows if r["dtype"] == "bfloat16" and r["clients"] == 4)
    assert row["specserve_tok/s"] == {"rounds": [40.0, 56.0], "median": 48.0} and row["vLLM_tok/s"]["median"] == 80.0
    assert row["x_vllm"] == {"rounds": [0.5, 0.7], "median": 0.6}
    assert row["specserve_TTFT_p50_ms"] == {"rounds": [400, 400], "median": 400} and row["engine_alone_tok/s"]["median"] == 20.0
    assert row["engine_fraction_of_the_bandwidth_limit"] == 0.5  # 2 GB / 20 ms = 100 GB/s of 200
    assert row["bandwidth_GB/s"] == 200.0
    table = "\n".join(real_size_served.served_table(rows))
    assert "| bfloat16 | 4 | 48.0 | 80.0 | 0.60 | 400 | 400 | 20.0 | 50% |" in table
    written = {}
    monkeypatch.setattr("benchmarks.reports.tables.update", lambda record: written.setdefault("record", record) and "p")
    real_size.record(args, "python -m benchmarks.peers.real_size --serve specserve,vllm", rows)
    assert written["record"]["case"] == "real-size-test" and written["record"]["section"] == "Peers"
    assert len(written["record"]["rows"]) == 4


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--dtypes", "float16"], ["--rounds", "0"], ["--threads", "0"],
                                 ["--threads", "many"], ["--record", "x"], ["--serve-rounds", "0"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        real_size.parse_args(bad)


def test_a_record_shows_the_command_without_this_machines_places():
    args = real_size.parse_args(["--serve", "vllm", "--vllm-venv", "/somewhere/venv", "--out=/somewhere/out",
                                 "--record", "real-size-x", "--concurrency", "1,4"])
    assert real_size.public_command(args) == "python -m benchmarks.peers.real_size --serve vllm --vllm-venv VENV --concurrency 1,4"
