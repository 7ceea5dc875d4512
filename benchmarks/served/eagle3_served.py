"""Served sd with the EAGLE-3 head against sd with the embedded draft model (not a test).

The engine alone (:mod:`benchmarks.served.engine_load`: the production Coordinator and workers in
this process, closed-loop clients, request i on prompt i mod 18 with seed i, temperature 1): one
:class:`~benchmarks.served.runners.LocalRunner` per proposer, all loaded first, then ``--rounds``
rounds that run each proposer's ``--requests`` requests in turn, so that every proposer sees the
same host load. Prints per proposer the median tokens/s over the rounds, the median of its
per-round ratio to the draft model's, and the block efficiency (generated tokens per target call);
``--record`` keeps all three.

    python -m benchmarks.served.eagle3_served --rounds 5 --requests 18
    python -m benchmarks.served.eagle3_served --rounds 5 --requests 18 --record eagle3-served
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

from benchmarks.served.engine_load import timed_run
from benchmarks.served.prompts import load_prompts
from benchmarks.served.runners import LocalRunner
from cluster.config import load_app_args

#: (label, deploy file, the draft's quantization) of each proposer; the first is the baseline.
PROPOSERS = (("draft model", "deploy/default.yaml", None), ("head", "deploy/eagle3.yaml", None),
             ("head int8", "deploy/eagle3.yaml", "int8"), ("head int4", "deploy/eagle3.yaml", "int4"))


def group_args(config: str, quantization: str | None, gamma: int) -> Any:
    """The args of ``config`` with its draft quantized (``quantization``) and sd's block ``gamma``."""
    args = load_app_args(config, None)
    if quantization is not None:
        models = {name: model.model_copy(update={"quantization": quantization}) if model.role == "draft" else model
                  for name, model in args.models.items()}
        args = args.model_copy(update={"models": models})
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=18)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--record", default=None, metavar="CASE",
                        help="Also write the figures into the results store (benchmarks/results/CASE.json) and "
                        "regenerate docs/results.md.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runners = {label: LocalRunner(group_args(config, quantization, args.gamma), temperature=1.0)
               for label, config, quantization in PROPOSERS}
    prompts = [prompt.text for prompt in load_prompts()]
    speculation = {"strategy": "sd", "method": "block", "gamma": args.gamma}
    rates: dict[str, list[float]] = {label: [] for label in runners}
    efficiency: dict[str, list[float]] = {label: [] for label in runners}
    try:
        for round_index in range(args.rounds):
            for label, runner in runners.items():
                run = timed_run(runner, prompts, speculation, args)
                rates[label].append(run.tokens / run.wall_s)
                efficiency[label].append(sum(f.completion_tokens for f in run.finals)
                                         / max(1, sum(f.target_calls for f in run.finals)))
                print(f"round {round_index + 1} {label}: {rates[label][-1]:.1f} tok/s, block efficiency "
                      f"{efficiency[label][-1]:.3f}", flush=True)
    finally:
        for runner in runners.values():
            runner.close()
    baseline = PROPOSERS[0][0]
    rows = []
    for label in runners:
        ratio = statistics.median(a / b for a, b in zip(rates[label], rates[baseline]))
        rows.append({"proposer": label, "tok/s": round(statistics.median(rates[label]), 1),
                     "block eff.": round(statistics.median(efficiency[label]), 3), "x draft": round(ratio, 2)})
        print(f"{label}: median {statistics.median(rates[label]):.1f} tok/s, {ratio:.2f}x the draft model (median of "
              f"per-round ratios), block efficiency {rows[-1]['block eff.']}")
    if args.record:
        _record(args, argv, rows)
    return 0


def _record(args: argparse.Namespace, argv: list[str] | None, rows: list[dict[str, Any]]) -> None:
    """Write the rows into the results store (``--record CASE``)."""
    import shlex
    import sys

    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    words = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.served.eagle3_served " + " ".join(shlex.quote(w) for w in words)
    clients = f"{args.concurrency} client{'s' if args.concurrency > 1 else ''}"
    title = f"EAGLE-3 head against the draft model (engine alone, sd block gamma {args.gamma}, {clients})"
    print(f"recorded {update(make_record(args.record, title, command, rows, section='Engine'))}")


if __name__ == "__main__":
    raise SystemExit(main())
