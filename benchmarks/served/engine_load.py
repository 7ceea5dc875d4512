"""The engine alone under load (not a test): the Coordinator and every ModelWorker in this process.

No Ray and no HTTP: ``--concurrency`` closed-loop clients send ``--requests`` requests straight
to the Coordinator (``benchmarks.served.runners.LocalRunner``: the production classes, each worker a
plain object), ``--max-tokens`` tokens each, with the speculation settings of the serve-load
benchmark's cases (``benchmarks.served.serve_load.serve_load_cases``; EOS ignored, temperature 1,
request i on prompt i mod 18 of the committed set as text, seed i). Prints the aggregate tokens/s,
the median time to a request's first token and, per model, the forwards it ran: what the
engine's own step costs, apart from Ray's hops and the HTTP path (``specserve bench --mode
serve-load`` measures the whole server).

    python -m benchmarks.served.engine_load --strategy ar --concurrency 16 --requests 128
    python -m benchmarks.served.engine_load --strategy sd --concurrency 1 --requests 32 --prefix-caching off
    python -m benchmarks.served.engine_load --strategy sd --gamma auto --goodput on --concurrency 16 --requests 128
    python -m benchmarks.served.engine_load --strategy sd --pre-drafting 2 --concurrency 1 --requests 32
    python -m benchmarks.served.engine_load --strategy ar --concurrency 16 --requests 64 --lean-forward off
    python -m benchmarks.served.engine_load --config deploy/self_draft.yaml --strategy sd --quantization int4 --concurrency 1

Speculative strategies also print the block efficiency (generated tokens per target call).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.model import backends
from actors.model.eagle3_serving import Eagle3Backend
from actors.request_schema import GenerationRequest, SamplingParams
from benchmarks.served.prompts import load_prompts
from benchmarks.served.runners import LocalRunner
from benchmarks.served.load_cases import SERVE_LOAD_STRATEGIES, ServeLoadSettings, serve_load_cases
from cluster.config import load_app_args


def count_forwards(stats: dict[tuple[str, str], list[tuple[int, int, float]]]) -> Callable[[], None]:
    """Wrap ``SlotBackend.forward`` (and an EAGLE-3 head's, :mod:`actors.model.eagle3_serving`) to
    record (rows, tokens, seconds) per model and row kind; returns what puts the originals back."""

    def model_key(backend: Any, rows: Any) -> tuple[str, str]:
        kind = "prefill" if max(len(row) for row in rows) > 16 else "short"
        return backend.model.config.name_or_path.rstrip("/").rsplit("/", 1)[-1], kind

    restores = [_counted(backends.SlotBackend, model_key, stats),
                _counted(Eagle3Backend, lambda head, rows: (head.name, "head"), stats)]

    def restore_all() -> None:
        for restore in restores:
            restore()

    return restore_all


def _counted(cls: type, key: Callable[[Any, Any], tuple[str, str]],
             stats: dict[tuple[str, str], list[tuple[int, int, float]]]) -> Callable[[], None]:
    """``cls.forward`` wrapped to append (rows, tokens, seconds) under ``key(backend, rows)``;
    returns what puts it back."""
    forward = cls.forward

    def counted(self: Any, rows: Any) -> Any:
        started = time.perf_counter()
        out = forward(self, rows)
        stats[key(self, rows)].append((len(rows), sum(len(row) for row in rows), time.perf_counter() - started))
        return out

    cls.forward = counted
    return lambda: setattr(cls, "forward", forward)


async def run_clients(runner: LocalRunner, prompts: list[str], speculation: dict[str, Any],
                      args: argparse.Namespace, first_token_s: list[float], finals: list[Any]) -> int:
    """Run the closed-loop clients -> the tokens generated; appends each request's time to its
    first token (seconds) to ``first_token_s`` and its final stats to ``finals``."""
    counter = iter(range(args.requests))

    async def client() -> int:
        tokens = 0
        for i in counter:
            request = GenerationRequest(
                request_id=f"engine-load-{i}", prompt=prompts[i % len(prompts)],
                sampling=SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i, ignore_eos=True),
                speculation=speculation)
            sent, first = time.perf_counter(), True
            async for chunk in runner.coordinator.generate(request):
                if chunk.token_ids and first:
                    first_token_s.append(time.perf_counter() - sent)
                    first = False
                tokens += len(chunk.token_ids)
                if chunk.stats is not None:
                    finals.append(chunk.stats)
        return tokens

    return sum(await asyncio.gather(*(client() for _ in range(args.concurrency))))


@dataclass
class TimedRun:
    """One closed-loop run on the engine alone: tokens generated, wall seconds, each request's time
    to its first token, its final stats, and the forwards (model, row kind) -> (rows, tokens, seconds)."""

    tokens: int
    wall_s: float
    first_token_s: list[float]
    finals: list[Any]
    forwards: dict[tuple[str, str], list[tuple[int, int, float]]]


def timed_run(runner: LocalRunner, prompts: list[str], speculation: dict[str, Any], args: Any) -> TimedRun:
    """``args.requests`` requests of ``args.max_tokens`` tokens from ``args.concurrency`` closed-loop
    clients (:func:`run_clients`), timed, with every forward counted (:func:`count_forwards`)."""
    forwards: dict[tuple[str, str], list[tuple[int, int, float]]] = collections.defaultdict(list)
    first_token_s: list[float] = []
    finals: list[Any] = []
    restore = count_forwards(forwards)
    try:
        started = time.perf_counter()
        tokens = runner.loop.run_until_complete(run_clients(runner, prompts, speculation, args, first_token_s, finals))
        wall_s = time.perf_counter() - started
    finally:
        restore()
    return TimedRun(tokens, wall_s, first_token_s, finals, forwards)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="deploy/default.yaml", help="Ray Serve YAML naming the models.")
    parser.add_argument("--strategy", choices=SERVE_LOAD_STRATEGIES, default="ar")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefix-caching", choices=("on", "off"), default=None,
                        help="Force args.engine.prefix_caching (default: the YAML's).")
    parser.add_argument("--gamma", default=None,
                        help="sd / multi_draft block: an int or auto (default: the serve-load case's, 4).")
    parser.add_argument("--pre-drafting", type=int, default=None,
                        help="Force args.engine.pre_drafting (candidate bonus tokens; 0 off; default: the YAML's).")
    parser.add_argument("--burst-ms", type=float, default=None,
                        help="Force args.engine.burst_ms (solo bursts; 0 off; default: the YAML's).")
    parser.add_argument("--goodput", choices=("on", "off"), default=None,
                        help="Force args.engine.goodput_gamma (gamma auto weighs measured step costs; default: the YAML's).")
    parser.add_argument("--sampling-precision", choices=("auto", "float32", "float64"), default=None,
                        help="Force args.engine.sampling_precision (the rows' precision; default: the YAML's).")
    parser.add_argument("--lean-forward", choices=("on", "off"), default=None,
                        help="Force args.engine.lean_forward (the lean decoder forward; default: the YAML's).")
    parser.add_argument("--record", default=None, metavar="CASE",
                        help="Also write the figure into the results store (benchmarks/results/CASE.json) and "
                        "regenerate docs/results.md.")
    parser.add_argument("--quantization", choices=("int8", "int4"), default=None,
                        help="Force the draft model's quantization (args.models.<draft>.quantization; default: the YAML's).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    group_args = load_app_args(args.config, None)
    if args.quantization is not None:
        models = {name: model.model_copy(update={"quantization": args.quantization}) if model.role == "draft" else model
                  for name, model in group_args.models.items()}
        group_args = group_args.model_copy(update={"models": models})
    engine_updates = {}
    if args.prefix_caching is not None:
        engine_updates["prefix_caching"] = args.prefix_caching == "on"
    if args.goodput is not None:
        engine_updates["goodput_gamma"] = args.goodput == "on"
    if args.pre_drafting is not None:
        engine_updates["pre_drafting"] = args.pre_drafting
    if args.burst_ms is not None:
        engine_updates["burst_ms"] = args.burst_ms
    if args.sampling_precision is not None:
        engine_updates["sampling_precision"] = args.sampling_precision
    if args.lean_forward is not None:
        engine_updates["lean_forward"] = args.lean_forward == "on"
    if engine_updates:
        group_args = group_args.model_copy(update={"engine": group_args.engine.model_copy(update=engine_updates)})
    (case,) = serve_load_cases(ServeLoadSettings(strategies=(args.strategy,)), group_args.freeze().roles)
    if args.gamma is not None and "gamma" in case.speculation:
        case.speculation["gamma"] = args.gamma if args.gamma == "auto" else int(args.gamma)
    runner = LocalRunner(group_args, temperature=1.0)
    prompts = [prompt.text for prompt in load_prompts()]
    run = timed_run(runner, prompts, case.speculation, args)
    tokens, wall, first_token_s, finals, stats = run.tokens, run.wall_s, run.first_token_s, run.finals, run.forwards
    print(f"{args.strategy} at concurrency {args.concurrency}: {tokens} tokens in {wall:.2f} s = "
          f"{tokens / wall:.1f} tok/s, TTFT p50 {1e3 * statistics.median(first_token_s):.1f} ms")
    if args.record:
        _record(args, case.speculation, argv, tokens / wall, 1e3 * statistics.median(first_token_s))
    target_calls = sum(final.target_calls for final in finals)
    if target_calls and args.strategy != "ar":
        print(f"  block efficiency {sum(final.completion_tokens for final in finals) / target_calls:.3f} "
              f"(generated tokens per target call, pooled over {len(finals)} requests; per-request median "
              f"{statistics.median(final.block_efficiency for final in finals):.3f})")
    for (model, kind), runs in sorted(stats.items()):
        seconds = sum(run[2] for run in runs)
        print(f"  {model} {kind}: {len(runs)} forwards, {seconds:.2f} s ({100 * seconds / wall:.0f}% of wall), "
              f"rows/forward {statistics.mean(r[0] for r in runs):.1f}, "
              f"tokens/forward {statistics.mean(r[1] for r in runs):.1f}, "
              f"median {1e3 * statistics.median(r[2] for r in runs):.1f} ms")
    runner.close()
    return 0


def _record(args: argparse.Namespace, speculation: dict[str, Any], argv: list[str] | None, tokens_per_second: float,
            ttft_p50_ms: float) -> None:
    """Write this run's figure into the results store (``--record CASE``)."""
    import shlex
    import sys

    from benchmarks.reports.tables import update
    from benchmarks.reports.writers import engine_load_record

    words = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.served.engine_load " + " ".join(shlex.quote(w) for w in words)
    path = update(engine_load_record(args.record, command, strategy=args.strategy, gamma=speculation.get("gamma"),
                                     clients=args.concurrency, tokens_per_second=tokens_per_second, ttft_p50_ms=ttft_p50_ms))
    print(f"recorded {path}")


if __name__ == "__main__":
    raise SystemExit(main())
