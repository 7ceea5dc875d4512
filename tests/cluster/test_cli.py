"""The ``specserve`` CLI: ``generate`` end to end on tiny checkpoints, argument errors."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
import yaml

from cluster.cli import build_parser, main
from tests.conftest import tiny_args_dict

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = "class Counter(dict):"


@pytest.fixture(scope="module")
def tiny_yaml(tiny_checkpoints, tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("cli") / "tiny.yaml"
    app = {"name": "specserve", "route_prefix": "/", "import_path": "cluster.app:build_app",
           "args": tiny_args_dict(tiny_checkpoints)}
    path.write_text(yaml.safe_dump({"applications": [app]}))
    return path


@torch.inference_mode()
def _target_greedy(checkpoint, prompt: str, steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    context = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    start = len(context)
    for _ in range(steps):
        context.append(int(torch.argmax(model(torch.tensor([context])).logits[0, -1])))
    return context[start:]


def test_generate_json_prints_one_object(ray_session, tiny_yaml, tiny_checkpoints, capsys):
    code = main([
        "generate", "--config", str(tiny_yaml), "--prompt", PROMPT, "--max-tokens", "12",
        "--strategy", "multi_draft", "--method", "spectr", "--gamma", "3", "--num-drafts", "2",
        "--temperature", "0", "--ignore-eos", "--seed", "7", "--json",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
    assert result["token_ids"] == _target_greedy(tiny_checkpoints["target"], PROMPT, 12)
    assert result["finish_reason"] == "length"
    stats = result["stats"]
    assert stats["strategy"] == "multi_draft" and stats["method"] == "spectr"
    assert stats["completion_tokens"] == 12 and stats["target_calls"] == len(stats["accepted_lengths"])


def test_generate_gamma_auto_keeps_the_plan_adaptive_and_equals_target_greedy(ray_session, tiny_yaml, tiny_checkpoints,
                                                                             capsys):
    code = main([
        "generate", "--config", str(tiny_yaml), "--prompt", PROMPT, "--max-tokens", "12", "--strategy", "sd",
        "--method", "greedy_block", "--gamma", "auto", "--gamma-max", "5", "--temperature", "0", "--ignore-eos", "--json",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["token_ids"] == _target_greedy(tiny_checkpoints["target"], PROMPT, 12)
    blocks = [d for d in result["stats"]["draft_lengths"] if d]  # 0: a plain step (engine.goodput_gamma)
    assert len(blocks) == len(result["stats"]["accepted_lengths"]) and all(1 <= d <= 5 for d in blocks)


def test_gamma_argument_takes_an_integer_or_auto(capsys):
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x", "--gamma", "auto"]).gamma == "auto"
    assert parser.parse_args(["generate", "--prompt", "x", "--gamma", "3"]).gamma == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--gamma", "fast"])
    assert '"auto"' in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--strategy", "sd", "--method", "spectr"], "speculation.method"),
        (["--strategy", "se", "--members", "target,ghost"], "speculation.members"),
        (["--temperature", "nan"], "sampling.temperature: must be a finite number"),
    ],
)
def test_generate_rejects_a_bad_request_before_starting_models(tiny_yaml, extra, message, capsys, caplog):
    code = main(["generate", "--config", str(tiny_yaml), "--prompt", "x", "--json", *extra])
    assert code == 2
    assert capsys.readouterr().out == ""
    assert message in caplog.text


def test_generate_rejects_a_bad_config(tmp_path, capsys, caplog):
    path = tmp_path / "bad.yaml"
    app = {"name": "x", "import_path": "cluster.app:build_app",
           "args": {"models": {"t": {"path": "p", "role": "boss"}}}}
    path.write_text(yaml.safe_dump({"applications": [app]}))
    assert main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    assert "models.t.role" in caplog.text and "'boss'" in caplog.text
    assert capsys.readouterr().out == ""


def test_parser_accepts_every_strategy_and_lists_subcommands():
    parser = build_parser()
    for strategy in ("ar", "sd", "multi_draft", "ensemble", "se"):
        args = parser.parse_args(["generate", "--prompt", "p", "--strategy", strategy])
        assert args.strategy == strategy and callable(args.handler)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "p", "--strategy", "beam"])


@pytest.mark.slow  # a fresh interpreter imports the whole CLI
def test_console_module_help_runs():
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "--num-drafts" in result.stdout and "--json" in result.stdout


def test_the_cli_imports_no_benchmark_and_bench_help_still_runs():
    """``cluster.cli`` does not import ``benchmarks``; ``specserve bench --help`` loads it when asked."""
    code = "import sys, cluster.cli; print([m for m in sys.modules if m.startswith('benchmarks')])"
    imported = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported.stderr[-2000:]
    result = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: specserve bench") and "--concurrency" in result.stdout
    args = build_parser().parse_args(["bench", "--mode", "serve-load", "--out", "x"])
    assert args.bench_args == ["--mode", "serve-load", "--out", "x"] and callable(args.handler)
