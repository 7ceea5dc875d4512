"""The real-size benchmark runs end to end on a tiny shape (no Ray): it builds the checkpoint, counts
the weights a forward reads, measures the bandwidth and prints every dtype and level with its
fraction of the limit and the bfloat16 / float32 ratios; its served config validates, and vLLM
without a venv is skipped with a message."""

from __future__ import annotations

import argparse
import re

import pytest

from benchmarks.peers import real_size
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
    config = real_size.serve_config(tmp_path / "model", "bfloat16", 2, 16, 1024)
    group = parse_app_args(config["applications"][0]["args"])
    assert group.models["target"].dtype == "bfloat16" and group.resources.torch_threads == 2
    args = argparse.Namespace(vllm_venv=tmp_path / "no-venv", max_tokens=4, serve_requests=1, threads=1,
                              max_model_len=256)
    assert real_size.serve_vllm(tmp_path / "model", "bfloat16", [1], args, tmp_path / "out") == []
    assert "vLLM skipped" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--dtypes", "float16"], ["--rounds", "0"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        real_size.parse_args(bad)
