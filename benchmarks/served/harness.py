"""The benchmark loop: every case on every prompt, interleaved, seeds fixed, warm-up excluded.

For each prompt (and repeat), the harness runs every case once, in an order shuffled per
prompt with a fixed seed, so slow drifts of a noisy shared machine spread over all cases
instead of favouring the ones that run first; consecutive runs of different cases on the same
prompt make paired ratios (speedups) robust. Every case runs once on a warm-up prompt before
measuring (model warm-up, Ray worker start, first-call costs); warm-up runs are not recorded.
Every case of prompt ``i`` in repeat ``r`` uses seed ``settings.seed + 1000 * r + i``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tqdm import tqdm

from benchmarks.served.prompts import Prompt
from benchmarks.reports.records import RunRecord
from benchmarks.served.suite import BenchCase, BenchSettings

logger = logging.getLogger(__name__)

WARMUP_PROMPT = "def warm_up(values):\n    total = 0\n    for value in values:\n"


class Runner(Protocol):
    """Runs the cases of one mode (ray | local | hf)."""

    mode: str

    def run(self, case: BenchCase, prompt_ids: list[int], *, seed: int, max_tokens: int,
            prompt_id: str, prompt_kind: str, repeat: int) -> RunRecord:
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class TokenizedPrompt:
    prompt: Prompt
    token_ids: list[int]


def prompt_seed(settings: BenchSettings, prompt_index: int, repeat: int) -> int:
    return settings.seed + 1000 * repeat + prompt_index


def run_cases(
    cases: list[BenchCase],
    prompts: list[TokenizedPrompt],
    runners: Mapping[str, Runner],
    settings: BenchSettings,
    *,
    warmup_ids: list[int],
    on_record: Callable[[RunRecord], None] | None = None,
) -> list[RunRecord]:
    """Warm every case up once, then run every case on every prompt (interleaved by prompt)."""
    total = len(cases) * (1 + len(prompts) * settings.repeats)
    records: list[RunRecord] = []
    with tqdm(total=total, desc="bench", unit="run", dynamic_ncols=True) as progress:
        for case in cases:
            progress.set_postfix_str(f"warm-up {case.key}")
            runners[case.mode].run(case, warmup_ids, seed=settings.seed, max_tokens=settings.warmup_tokens,
                                   prompt_id="warmup", prompt_kind="code", repeat=-1)
            progress.update()
        for repeat in range(settings.repeats):
            for index, item in enumerate(prompts):
                seed = prompt_seed(settings, index, repeat)
                order = list(cases)
                random.Random(seed).shuffle(order)
                for case in order:
                    progress.set_postfix_str(f"{item.prompt.id} {case.key}")
                    started = time.perf_counter()
                    record = runners[case.mode].run(
                        case, item.token_ids, seed=seed, max_tokens=settings.max_tokens,
                        prompt_id=item.prompt.id, prompt_kind=item.prompt.kind, repeat=repeat,
                    )
                    _check_record(record, settings, case)
                    logger.debug("%s %s: %.1f tok/s (%.2fs)", item.prompt.id, case.key,
                                 record.tokens_per_second, time.perf_counter() - started)
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
                    progress.update()
    return records


def _check_record(record: RunRecord, settings: BenchSettings, case: BenchCase) -> None:
    """Every case must generate exactly max_tokens tokens (EOS is ignored everywhere)."""
    if record.completion_tokens != settings.max_tokens:
        raise RuntimeError(
            f"{case.key} on {record.prompt_id} generated {record.completion_tokens} tokens, "
            f"expected {settings.max_tokens}"
        )
