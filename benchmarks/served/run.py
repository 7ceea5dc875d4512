"""``specserve bench``: one benchmark run from a Serve YAML to results.json, results.md and plots.

The models come from the application ``args`` of the YAML (``cluster.config``): the target,
the draft and the ensemble members by role. The same models run in three modes, side by
side: ``ray`` (the production path: a model group of separate Ray actors and its
coordinator), ``local`` (the same coordinator logic with every model in this process), and
``hf`` (transformers assisted generation, the peer).
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import platform
import time
from collections.abc import Callable
from typing import Any

from benchmarks.reports.store import git_commit, load_avg
from benchmarks.reports.analysis import adaptive_comparisons, check_targets, distribution_overhead, peer_comparisons, summarize
from benchmarks.served.harness import WARMUP_PROMPT, Runner, TokenizedPrompt, run_cases
from benchmarks.served.prompts import PROMPTS_PATH, load_prompts
from benchmarks.reports.report import BenchResults, write_results
from benchmarks.served.suite import BenchSettings, build_cases

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[Any, BenchSettings], Runner]


def environment_info() -> dict[str, Any]:
    import torch
    import transformers

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = "n/a"
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray_version,
        "torch_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
    }


def make_runner(mode: str, group_args: Any, settings: BenchSettings) -> Runner:
    """The runner of one mode for the model group described by ``group_args`` (SpecServeArgs)."""
    config = group_args.freeze()
    if mode == "hf":
        from benchmarks.peers.peer import PeerRunner

        target = [m.path for m in config.models if m.role == "target"]
        draft = [m.path for m in config.models if m.role == "draft"]
        return PeerRunner(target[0], draft[0], temperature=settings.temperature)
    if mode == "ray":
        from benchmarks.served.runners import RayRunner

        return RayRunner(group_args, temperature=settings.temperature)
    if mode == "local":
        from benchmarks.served.runners import LocalRunner

        return LocalRunner(group_args, temperature=settings.temperature)
    raise ValueError(f"unknown mode {mode!r}; expected ray, local or hf")


def tokenize_prompts(
    tokenizer_path: str, prompts, max_prompt_tokens: int | None = None
) -> tuple[list[TokenizedPrompt], list[int]]:
    """Token ids of every prompt and of the warm-up prompt (one tokenizer for every mode),
    keeping the last ``max_prompt_tokens`` of each when given."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=os.path.isdir(tokenizer_path))
    keep = max_prompt_tokens or None

    def encode(text: str) -> list[int]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-keep:] if keep else ids

    return [TokenizedPrompt(p, encode(p.text)) for p in prompts], encode(WARMUP_PROMPT)


def analyze(settings: BenchSettings, cases, records, environment: dict[str, Any], command: str) -> BenchResults:
    """Summaries, distribution overhead, peer comparison and target checks of a run's records."""
    summaries = summarize(cases, records)
    overhead = distribution_overhead(summaries, records)
    return BenchResults(
        settings=settings,
        environment=environment,
        command=command,
        summaries=summaries,
        overhead=overhead,
        peer=peer_comparisons(summaries),
        checks=check_targets(settings, summaries, overhead),
        records=records,
        adaptive=adaptive_comparisons(summaries, records),
    )


def rerender(run_dir: pathlib.Path, *, plot_prefix: str = "") -> Any:
    """Rebuild results.json / results.md / plots of a finished run from its recorded runs (after
    a change to the analysis or the report, without measuring again). A serve-load run
    (``specserve bench --mode serve-load``) is re-rendered by :mod:`benchmarks.served.serve_load_report`."""
    from benchmarks.reports.records import RunRecord
    from benchmarks.reports.report import results_from_json

    data = results_from_json(run_dir / "results.json")
    from benchmarks.served import serve_load_records, serve_load_report

    if data.get("kind") == serve_load_records.KIND:
        return serve_load_report.rerender(run_dir, plot_prefix=plot_prefix)
    settings = BenchSettings(**data["settings"])
    roles = {name: model["role"] for name, model in data["environment"]["models"].items()}
    derived = ("tokens_per_second", "block_efficiency", "mean_accepted", "mean_draft_length")
    records = [RunRecord(**{k: v for k, v in r.items() if k not in derived}) for r in data["records"]]
    results = analyze(settings, build_cases(settings, roles), records, data["environment"], data["command"])
    write_results(results, run_dir, plot_prefix=plot_prefix)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Re-render a finished benchmark run (suite or serve-load) from its "
                                     "results.json.")
    parser.add_argument("run_dir", type=pathlib.Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    rerender(args.run_dir)


def run_benchmark(
    group_args: Any,
    settings: BenchSettings,
    out_dir: pathlib.Path,
    *,
    command: str = "specserve bench",
    prompts_path: pathlib.Path = PROMPTS_PATH,
    runner_factory: RunnerFactory | None = None,
    plot_prefix: str = "",
) -> BenchResults:
    """Run every case of ``settings`` over the prompt set and write the results under ``out_dir``."""
    import torch

    from actors.worker.cpu_binding import torch_thread_count

    started = time.perf_counter()
    load_start = load_avg()
    config = group_args.freeze()
    # The in-process modes use the workers' thread budget, so the modes compare like for like.
    torch.set_num_threads(torch_thread_count(config.models[0].torch_threads))
    prompts = load_prompts(prompts_path, settings.num_prompts)
    tokenized, warmup_ids = tokenize_prompts(config.tokenizer_path, prompts, settings.max_prompt_tokens)
    cases = build_cases(settings, config.roles)
    logger.info("%d cases x %d prompts x %d repeats (+ %d warm-up runs)",
                len(cases), len(prompts), settings.repeats, len(cases))
    factory = runner_factory or (lambda mode, s: make_runner(mode, group_args, s))
    modes = list(dict.fromkeys(case.mode for case in cases))
    runners: dict[str, Runner] = {}
    try:
        for mode in modes:
            mode_started = time.perf_counter()
            runners[mode] = factory(mode, settings)
            logger.info("%s runner ready in %.1f s", mode, time.perf_counter() - mode_started)
        setup_s = time.perf_counter() - started
        records = run_cases(cases, tokenized, runners, settings, warmup_ids=warmup_ids)
    finally:
        for runner in runners.values():
            runner.close()
    environment = environment_info() | {
        "num_prompts": len(prompts),
        "prompt_kinds": ", ".join(f"{sum(p.kind == k for p in prompts)} {k}" for k in ("code", "prose")),
        "load_average_start": load_start,
        "load_average_end": load_avg(),
        "wall_time_s": time.perf_counter() - started,
        "setup_time_s": setup_s,
        "models": {m.name: {"path": m.path, "role": m.role} for m in config.models},
    }
    results = analyze(settings, cases, records, environment, command)
    write_results(results, out_dir, plot_prefix=plot_prefix)
    return results


if __name__ == "__main__":
    main()
