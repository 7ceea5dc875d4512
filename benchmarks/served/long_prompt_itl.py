"""Running streams while long prompts arrive (not a test): inter-token latency with and without
chunked prefill (``engine.max_tokens_per_step``).

The engine alone (the production Coordinator and ModelWorkers in this process, no Ray, no
HTTP), on the Qwen2.5-shaped random target of :mod:`benchmarks.peers.real_shape` (32,768-token
context): ``--streams`` ar requests decode ``--decode-tokens`` tokens each; once every stream has
its first tokens, ``--long-prompts`` requests with ``--long-tokens``-token prompts arrive one
after another (one token each). For each budget in ``--budgets`` (``off``: larger than any
prompt, so every prompt is prefilled in one forward), the gaps between the chunks a running
stream receives (each chunk carries the tokens of one step) while the long prompts are in the
engine, median and p99, and each long prompt's time to its first token.

    python -m benchmarks.served.long_prompt_itl
    python -m benchmarks.served.long_prompt_itl --streams 8 --long-tokens 4000 --budgets off,512
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import statistics
import tempfile
import time

import torch

from actors.request_schema import GenerationRequest, SamplingParams
from benchmarks.peers.real_shape import CONTEXT, build_checkpoints
from benchmarks.served.runners import LocalRunner
from cluster.config import parse_app_args

COMMAND = "python -m benchmarks.served.long_prompt_itl"
NO_CHUNKING = CONTEXT  # a budget no prompt exceeds: every prefill in one forward


def _budget(text: str) -> int:
    return NO_CHUNKING if text == "off" else int(text)


def _runner(target: pathlib.Path, budget: int, streams: int) -> LocalRunner:
    return LocalRunner(parse_app_args({
        "models": {"target": {"path": str(target), "role": "target", "dtype": "float32"}},
        "defaults": {"strategy": "ar"},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": streams + 4},
        "engine": {"max_model_len": CONTEXT, "max_tokens_per_step": budget, "kv_cache_memory": 2 * 2**30},
    }), temperature=1.0)


def _request(name: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_ids=prompt, speculation={"strategy": "ar"},
                             sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0, ignore_eos=True))


async def _measure(runner: LocalRunner, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """(gaps in seconds between consecutive chunks of a running stream that overlap the time the
    long prompts are in the engine, each long prompt's seconds to its first token)."""
    generator = torch.Generator().manual_seed(5)
    times: list[list[float]] = [[] for _ in range(args.streams)]  # chunk arrival times per stream
    started = asyncio.Event()

    async def stream(index: int) -> None:
        prompt = torch.randint(1, 4000, (64,), generator=generator).tolist()
        async for chunk in runner.coordinator.generate(_request(f"stream-{index}", prompt, args.decode_tokens)):
            if chunk.error:
                raise RuntimeError(chunk.error)
            if chunk.token_ids:
                times[index].append(time.perf_counter())
            if all(times):
                started.set()

    async def long_prompts() -> tuple[float, float, list[float]]:
        await started.wait()
        begin, firsts = time.perf_counter(), []
        for index in range(args.long_prompts):
            prompt = torch.randint(1, 4000, (args.long_tokens,), generator=generator).tolist()
            sent = time.perf_counter()
            async for chunk in runner.coordinator.generate(_request(f"long-{index}", prompt, 1)):
                if chunk.error:
                    raise RuntimeError(chunk.error)
                if chunk.token_ids:
                    firsts.append(time.perf_counter() - sent)
        return begin, time.perf_counter(), firsts

    (begin, end, firsts), *_ = await asyncio.gather(long_prompts(), *(stream(i) for i in range(args.streams)))
    gaps = [later - earlier for arrivals in times for earlier, later in zip(arrivals, arrivals[1:])
            if later >= begin and earlier <= end]
    return gaps, firsts


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="Running ar streams.")
    parser.add_argument("--decode-tokens", type=int, default=400, help="Tokens each running stream asks for.")
    parser.add_argument("--long-prompts", type=int, default=3, help="Long prompts arriving one after another.")
    parser.add_argument("--long-tokens", type=int, default=4000, help="Tokens of each long prompt.")
    parser.add_argument("--budgets", default="off,512", help="engine.max_tokens_per_step values (off: no chunking).")
    parser.add_argument("--out", default=None, help="Also write the table here (markdown).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    lines = [f"Command: `{COMMAND} --streams {args.streams} --long-tokens {args.long_tokens} "
             f"--long-prompts {args.long_prompts} --budgets {args.budgets}`", "",
             "| max_tokens_per_step | stream chunk gaps measured | gap p50 (ms) | gap p99 (ms) | gap max (ms) "
             "| long prompt first token, median (s) |", "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="long-prompt-itl-") as root:
        target = build_checkpoints(pathlib.Path(root))["target"]
        for text in args.budgets.split(","):
            runner = _runner(target, _budget(text), args.streams)
            try:
                gaps, firsts = runner.loop.run_until_complete(_measure(runner, args))
            finally:
                runner.close()
            if not gaps:
                raise RuntimeError("the streams ended before the long prompts arrived: raise --decode-tokens")
            lines.append(f"| {text} | {len(gaps)} | {1e3 * statistics.median(gaps):.0f} | {1e3 * _p99(gaps):.0f} | "
                         f"{1e3 * max(gaps):.0f} | {statistics.median(firsts):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
