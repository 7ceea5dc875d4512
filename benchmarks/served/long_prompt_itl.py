"""Running streams while long prompts arrive (not a test): inter-token latency with and without
chunked prefill (``engine.max_tokens_per_step``) and its pacing to measured step costs
(:mod:`actors.worker.prefill_pacer`).

The engine alone (the production Coordinator and ModelWorkers in this process, no Ray, no
HTTP), on the Qwen2.5-shaped random target of :mod:`benchmarks.peers.real_shape` (32,768-token
context) or, with ``--model embedded``, the embedded target: ``--streams`` ar requests decode
``--decode-tokens`` tokens each; ``--quiet-s`` after every stream has its first tokens,
``--long-prompts`` requests with ``--long-tokens``-token prompts arrive one after another (one
token each), or every ``--arrival-s`` seconds. For each budget in ``--budgets`` (``off``: larger
than any prompt, so every prompt is prefilled in one forward; ``N:static``: N without pacing;
``N:STRETCH``: N paced to another stretch than the engine's),
run ``--rounds`` times in turn: the gaps between the chunks a running stream receives (each chunk
carries the tokens of one step) while the long prompts are in the engine, median and p99; the p99
of the same streams' gaps at the same stream positions in a run without long prompts (alone; each
round runs one first), the baseline, since a decode step's cost grows with the streams' context;
the p99 of the quiet time before the prompts arrive in the same runs (shorter contexts), and each
long prompt's time to its first token.

    python -m benchmarks.served.long_prompt_itl
    python -m benchmarks.served.long_prompt_itl --streams 8 --long-tokens 4000 --budgets off,512
    python -m benchmarks.served.long_prompt_itl --model embedded --long-tokens 828 --long-prompts 4 \\
        --arrival-s 1.5 --budgets 512:static,512 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import pathlib
import statistics
import tempfile
import time
from typing import Any

import torch

from actors.request_schema import GenerationRequest, SamplingParams
from actors.worker.prefill_pacer import PrefillPacer
from benchmarks.peers.real_shape import CONTEXT, build_checkpoints
from benchmarks.served.runners import LocalRunner
from cluster.config import parse_app_args

COMMAND = "python -m benchmarks.served.long_prompt_itl"
NO_CHUNKING = CONTEXT  # a budget no prompt exceeds: every prefill in one forward
EMBEDDED_CONTEXT = 1024
UNPACED = 1e9  # a pacing stretch no step reaches: the static budget alone


@dataclasses.dataclass
class Measured:
    """One run's stream gaps, each (seconds, the stream's tokens before the chunk that ended it):
    while the long prompts were in the engine, and in the quiet time before; and each long
    prompt's seconds to its first token."""

    gaps: list[tuple[float, int]]
    quiet: list[tuple[float, int]]
    firsts: list[float]


def _budget(text: str, context: int) -> tuple[int, float | None]:
    """(``engine.max_tokens_per_step``, the pacing stretch: None for the engine's own) of a
    ``--budgets`` entry."""
    if text == "off":
        return max(NO_CHUNKING, context), UNPACED
    value, _, kind = text.partition(":")
    if kind == "static":
        return int(value), UNPACED
    try:
        return int(value), float(kind) if kind else None
    except ValueError:
        raise ValueError(f"--budgets: {text!r} is not N, N:static, N:STRETCH or off") from None


def _runner(target: str, budget: int, stretch: float | None, streams: int, context: int) -> LocalRunner:
    runner = LocalRunner(parse_app_args({
        "models": {"target": {"path": target, "role": "target", "dtype": "float32"}},
        "defaults": {"strategy": "ar"},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": streams + 4},
        "engine": {"max_model_len": context, "max_tokens_per_step": budget, "kv_cache_memory": 2 * 2**30},
    }), temperature=1.0)
    if stretch is not None:
        for handle in runner.workers.values():
            handle._instance.engine.prefill_pacer = PrefillPacer(stretch=stretch)
    return runner


def _request(name: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_ids=prompt, speculation={"strategy": "ar"},
                             sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0, ignore_eos=True))


async def _measure(runner: LocalRunner, args: argparse.Namespace, alone: bool = False) -> Measured:
    """The gaps in seconds between consecutive chunks of a running stream that overlap the time
    the long prompts are in the engine, the gaps of the quiet time before, each long prompt's
    seconds to its first token; ``alone``: no long prompt arrives, every gap counts as quiet."""
    generator = torch.Generator().manual_seed(5)
    times: list[list[tuple[float, int]]] = [[] for _ in range(args.streams)]  # per stream: (arrival, tokens before)
    started = asyncio.Event()

    async def stream(index: int) -> None:
        prompt = torch.randint(1, 4000, (64,), generator=generator).tolist()
        received = 0
        async for chunk in runner.coordinator.generate(_request(f"stream-{index}", prompt, args.decode_tokens)):
            if chunk.error:
                raise RuntimeError(chunk.error)
            if chunk.token_ids:
                times[index].append((time.perf_counter(), received))
                received += len(chunk.token_ids)
            if all(times):
                started.set()

    firsts: list[float] = []

    async def long_prompt(index: int, prompt: list[int]) -> None:
        await asyncio.sleep(index * args.arrival_s)  # 0: sent at once (one after another)
        sent = time.perf_counter()
        async for chunk in runner.coordinator.generate(_request(f"long-{index}", prompt, 1)):
            if chunk.error:
                raise RuntimeError(chunk.error)
            if chunk.token_ids:
                firsts.append(time.perf_counter() - sent)

    async def long_prompts() -> tuple[float, float]:
        await started.wait()
        await asyncio.sleep(args.quiet_s)
        prompts = [torch.randint(1, 4000, (args.long_tokens,), generator=generator).tolist()
                   for _ in range(0 if alone else args.long_prompts)]
        begin = time.perf_counter() if prompts else float("inf")
        if args.arrival_s > 0:
            await asyncio.gather(*(long_prompt(index, prompt) for index, prompt in enumerate(prompts)))
        else:
            for index, prompt in enumerate(prompts):
                await long_prompt(index, prompt)
        return begin, time.perf_counter()

    (begin, end), *_ = await asyncio.gather(long_prompts(), *(stream(i) for i in range(args.streams)))
    pairs = [(earlier, later, position) for arrivals in times for (earlier, _), (later, position) in zip(arrivals, arrivals[1:])]
    gaps = [(later - earlier, position) for earlier, later, position in pairs if later >= begin and earlier <= end]
    quiet = [(later - earlier, position) for earlier, later, position in pairs if later < begin]
    return Measured(gaps, quiet, firsts)


def alone_gaps(gaps: list[tuple[float, int]], alone: list[tuple[float, int]]) -> list[float]:
    """The gaps of the streams running alone (``alone``: (gap, the stream's tokens before the
    chunk that ended it)) at the stream positions that ``gaps`` span: what the same streams'
    gaps are without the long prompts, at the same context lengths (a decode step's cost grows
    with its context, so the quiet time before the prompts, at shorter contexts, is no baseline)."""
    if not gaps:
        return []
    low, high = min(position for _, position in gaps), max(position for _, position in gaps)
    return [gap for gap, position in alone if low <= position <= high]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="Running ar streams.")
    parser.add_argument("--decode-tokens", type=int, default=400, help="Tokens each running stream asks for.")
    parser.add_argument("--long-prompts", type=int, default=3, help="Long prompts arriving one after another.")
    parser.add_argument("--long-tokens", type=int, default=4000, help="Tokens of each long prompt.")
    parser.add_argument("--arrival-s", type=float, default=0.0,
                        help="Seconds between the long prompts' arrivals (0: each after the previous one's first token).")
    parser.add_argument("--quiet-s", type=float, default=1.0, help="Seconds the streams run alone before the long prompts.")
    parser.add_argument("--model", choices=("real_shape", "embedded"), default="real_shape")
    parser.add_argument("--budgets", default="off,512",
                        help="engine.max_tokens_per_step values (off: no chunking; N:static: N without pacing; "
                        "N:STRETCH: N paced to STRETCH).")
    parser.add_argument("--rounds", type=int, default=1, help="Runs of each budget, interleaved (gaps pooled).")
    parser.add_argument("--out", default=None, help="Also write the table here (markdown).")
    parser.add_argument("--record", default=None, metavar="CASE",
                        help="Also write the rows into the results store (benchmarks/results/CASE.json) and regenerate "
                        "docs/results.md.")
    return parser.parse_args(argv)


def _row(text: str, runs: list[Measured], alone: list[tuple[float, int]]) -> dict[str, Any]:
    """One budget's figures (its ``runs``, gaps pooled over its rounds; ``alone``: the gaps of the
    streams' runs without long prompts), keyed by column."""
    spans = [run.gaps for run in runs]
    gaps = [gap for span in spans for gap, _ in span]
    quiet = [gap for run in runs for gap, _ in run.quiet]
    baseline = [gap for span in spans for gap in alone_gaps(span, alone)]
    firsts = [first for run in runs for first in run.firsts]
    if not gaps:
        raise RuntimeError("the streams ended before the long prompts arrived: raise --decode-tokens")
    return {
        "engine.max_tokens_per_step": text, "stream chunk gaps measured": len(gaps),
        "gap p50 ms": round(1e3 * statistics.median(gaps)), "gap p99 ms": round(1e3 * _p99(gaps)),
        "gap max ms": round(1e3 * max(gaps)), "quiet gap p99 ms": round(1e3 * _p99(quiet)) if quiet else None,
        "p99 / quiet p99": round(_p99(gaps) / _p99(quiet), 2) if quiet else None,
        "alone gap p99 ms": round(1e3 * _p99(baseline)) if baseline else None,
        "p99 / alone p99": round(_p99(gaps) / _p99(baseline), 2) if baseline else None,
        "long prompt first token, median s": round(statistics.median(firsts), 2),
    }


def _table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as a markdown table."""
    head = list(rows[0])
    return (["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
            + ["| " + " | ".join("-" if row[key] is None else str(row[key]) for key in head) + " |" for row in rows])


#: The columns the results page shows.
RECORD_COLUMNS = ["engine.max_tokens_per_step", "gap p50 ms", "gap p99 ms", "alone gap p99 ms", "p99 / alone p99",
                  "p99 / quiet p99", "long prompt first token, median s"]


def _record(case: str, command: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Write the rows into the results store (``--record CASE``) and regenerate docs/results.md."""
    from benchmarks.reports.store import load_avg, make_record
    from benchmarks.reports.tables import update

    title = (f"Long prompts: {args.streams} streams, {args.long_prompts} prompts of {args.long_tokens:,} tokens "
             f"({args.model.replace('_', '-')} target, engine alone)")
    notes = (f"Alone: the same streams without the long prompts, at the same stream positions; quiet: gaps before "
             f"the long prompts (shorter contexts); rounds interleaved. Host load {load_avg()}.")
    print(f"recorded {update(make_record(case, title, command, rows, notes=notes, columns=RECORD_COLUMNS))}")


def _run(target: str, budget: str, context: int, args: argparse.Namespace, alone: bool = False) -> Measured:
    """One run of the streams (and, unless ``alone``, the long prompts) under ``budget``."""
    runner = _runner(target, *_budget(budget, context), args.streams, context)
    try:
        return runner.loop.run_until_complete(_measure(runner, args, alone))
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    command = (f"{COMMAND} --model {args.model} --streams {args.streams} --long-tokens {args.long_tokens} "
               f"--long-prompts {args.long_prompts} --arrival-s {args.arrival_s:g} --decode-tokens {args.decode_tokens} "
               f"--budgets {args.budgets} --rounds {args.rounds}")
    budgets = args.budgets.split(",")
    runs: dict[str, list[Measured]] = {text: [] for text in budgets}
    alone: list[tuple[float, int]] = []  # the streams' gaps without long prompts, pooled over the rounds
    with tempfile.TemporaryDirectory(prefix="long-prompt-itl-") as root:
        if args.model == "embedded":
            target, context = "embedded:target", EMBEDDED_CONTEXT
        else:
            target, context = str(build_checkpoints(pathlib.Path(root))["target"]), CONTEXT
        for _ in range(args.rounds):  # interleaved: each round runs the streams alone, then every budget in turn
            alone.extend(_run(target, budgets[0], context, args, alone=True).quiet)
            for text in budgets:
                runs[text].append(_run(target, text, context, args))
    rows = [_row(text, runs[text], alone) for text in budgets]
    text = "\n".join([f"Command: `{command}`", "", *_table(rows)]) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    if args.record:
        _record(args.record, command, rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
