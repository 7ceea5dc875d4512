"""``make gpu-check`` cannot rot: its dry run (CPU, tiny shapes) runs the whole pipeline here. It
serves ``ar`` and ``sd`` at each client count with a time split that adds up, profiles a decode
forward, and (the slow variant) runs the device tests on ``cpu`` and prints their summary."""

from __future__ import annotations

import pytest

from benchmarks import gpu_check


def test_the_dry_run_serves_every_level_splits_its_time_and_profiles_a_forward(capsys):
    report = gpu_check.check(gpu_check.parse_args(["--dry-run", "--no-tests", "--clients", "1,3", "--max-tokens", "4"]))
    assert report["status"] == 0
    assert [(level.strategy, level.clients, level.graphs) for level in report["levels"]] == [
        ("ar", 1, False), ("ar", 3, False), ("sd", 1, False), ("sd", 3, False)]
    for level in report["levels"]:
        assert level.tokens_per_s > 0 and 0 < level.forward_s <= level.step_s <= level.wall_s
        assert sum(level.split().values()) == pytest.approx(1.0)
    assert all(level.verify_s > 0 for level in report["levels"] if level.strategy == "sd")
    (profile,) = report["profiles"]
    assert profile.kernels > 0 and profile.forward_s > 0 and not profile.graphs
    printed = capsys.readouterr().out
    assert "| off | sd | 3 |" in printed and "top-level aten ops" in printed and "the lean decoder (llama)" in printed


def test_gpu_check_without_a_gpu_points_to_the_dry_run():
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="--dry-run"):
        gpu_check.check(gpu_check.parse_args([]))


@pytest.mark.slow
def test_the_dry_run_with_its_device_tests_passes(capsys):
    assert gpu_check.main(["--dry-run", "--clients", "1", "--max-tokens", "4"]) == 0
    assert "passed" in capsys.readouterr().out
