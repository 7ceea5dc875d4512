"""Micro-benchmark of one verification call per rule (not a test).

Times ``spec.verify`` for every rule the registry can load (single-draft rules with
``[B, gamma]`` inputs, multi-draft rules with K drafts) at V = 32000, gamma = 8, B = 1 and 8,
on probability rows shaped like production ones (float64 rows from ``logits_to_probs``, draft
tokens sampled from the draft rows, a draft that resembles the target). Methods are
interleaved within each repeat and the median (and interquartile range) is reported, as the
performance doctrine asks; stateful rules are timed with a state from a previous call.

    python -m benchmarks.micro.verify_micro                # writes bench-out/verify-benchmark.md
    python -m benchmarks.micro.verify_micro --repeats 5 --out /tmp/verify.md
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.reports.store import cpu_model
from verifiers.registry import VerifierSpec, available_verifiers
from verifiers.sampling import logits_to_probs

logger = logging.getLogger("benchmarks.micro.verify_micro")

COMMAND = "python -m benchmarks.micro.verify_micro"


@dataclass(frozen=True)
class Case:
    """Inputs of one timed configuration."""

    spec: VerifierSpec
    batch: int
    num_drafts: int
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    state: object


def make_inputs(
    batch: int, num_drafts: int, gamma: int, vocab: int, multi_draft: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target rows, draft rows (target logits + noise) and draft tokens sampled from them.
    Shapes ``[B, gamma]``... for single-draft rules, ``[B, K, gamma]``... for multi-draft."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, num_drafts) if multi_draft else (batch,)
    target_logits = 3.0 * torch.randn(*shape, gamma + 1, vocab, generator=generator, dtype=torch.float64)
    noise = torch.randn(*shape, gamma, vocab, generator=generator, dtype=torch.float64)
    target_probs = logits_to_probs(target_logits, temperature=1.0)  # [..., gamma+1, V]
    draft_probs = logits_to_probs(target_logits[..., :gamma, :] + noise, temperature=1.0)  # [..., gamma, V]
    flat = draft_probs.reshape(-1, vocab)
    draft_tokens = torch.multinomial(flat, 1, generator=generator).reshape(draft_probs.shape[:-1])
    return draft_tokens, draft_probs, target_probs


def build_cases(specs: list[VerifierSpec], batches: list[int], num_drafts: int, gamma: int, vocab: int) -> list[Case]:
    cases = []
    for batch in batches:
        for spec in specs:
            drafts = num_drafts if spec.multi_draft else 1
            inputs = make_inputs(batch, drafts, gamma, vocab, spec.multi_draft, seed=batch)
            state = None
            if spec.stateful:  # a state as the second iteration of a request would see it
                state = spec.verify(*inputs, generator=torch.Generator().manual_seed(0)).state
            cases.append(Case(spec, batch, drafts, inputs, state))
    return cases


def time_cases(cases: list[Case], repeats: int, warmup: int) -> dict[int, list[float]]:
    """Seconds per call for each case index, methods interleaved within each repeat."""
    timings: dict[int, list[float]] = {index: [] for index in range(len(cases))}
    generator = torch.Generator().manual_seed(1)
    for repeat in range(warmup + repeats):
        for index, case in enumerate(cases):
            start = time.perf_counter()
            case.spec.verify(*case.inputs, generator=generator, state=case.state)
            elapsed = time.perf_counter() - start
            if repeat >= warmup:
                timings[index].append(elapsed)
    return timings


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[0], quartiles[2]


def render_markdown(cases: list[Case], timings: dict[int, list[float]], args: argparse.Namespace) -> str:
    token_median = {
        case.batch: statistics.median(timings[i]) for i, case in enumerate(cases) if case.spec.name == "token"
    }
    lines = [
        "# Verification micro-benchmark",
        "",
        f"Produced by `{COMMAND}`"
        + (f" `--repeats {args.repeats}`" if args.repeats != DEFAULT_REPEATS else "")
        + f" on {time.strftime('%Y-%m-%d')}.",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {cpu_model() or 'unknown CPU'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"{os.cpu_count()} cores, load average {args.load_average} at start (a shared machine)",
        f"- V = {args.vocab}, gamma = {args.gamma}, float64 rows; multi-draft rules with K = {args.num_drafts}",
        f"- median of {args.repeats} calls per row (after {args.warmup} warm-up), methods interleaved "
        "within each repeat; IQR = interquartile range",
        "- stateful rules are timed with the state a previous call returned",
        "",
        "| method | B | K | median (ms) | IQR (ms) | vs token (same B) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for index, case in enumerate(cases):
        median = statistics.median(timings[index])
        low, high = _quartiles(timings[index])
        ratio = median / token_median[case.batch] if case.batch in token_median else float("nan")
        lines.append(
            f"| {case.spec.name} | {case.batch} | {case.num_drafts} | {median * 1e3:.2f} | "
            f"{low * 1e3:.2f}-{high * 1e3:.2f} | {ratio:.2f}x |"
        )
    lines += [
        "",
        "These are CPU timings of the verification math alone (no model calls). The machine is "
        "shared and noisy: compare rows of one run, not runs.",
        "",
    ]
    return "\n".join(lines)


DEFAULT_REPEATS = 15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed calls per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per configuration first")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size V")
    parser.add_argument("--gamma", type=int, default=8, help="draft block length")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes B")
    parser.add_argument("--num-drafts", type=int, default=2, help="K for multi-draft rules")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("bench-out/verify-benchmark.md"), help="markdown output")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    args.load_average = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    torch.set_num_threads(args.threads)
    specs = available_verifiers()
    logger.info("verifiers: %s", ", ".join(spec.name for spec in specs))
    cases = build_cases(specs, args.batches, args.num_drafts, args.gamma, args.vocab)
    timings = time_cases(cases, args.repeats, args.warmup)
    markdown = render_markdown(cases, timings, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown)
    logger.info("%s\nwritten to %s", markdown, args.out)


if __name__ == "__main__":
    main()
