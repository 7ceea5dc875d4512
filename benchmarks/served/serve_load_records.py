"""Serving-load results: per-request records, per-level summaries and results.json.

A *level* is one strategy at one concurrency (``concurrency`` closed-loop clients). Every figure
is measured on the client side, from the streamed ``/v1/completions`` responses:

* **TTFT**: from sending the request to the first streamed chunk that carries a token.
* **ITL** (inter-token latency): per token, amortised over its chunk. A chunk of ``n`` tokens
  that arrives ``g`` seconds after the previous one gives ``n`` samples of ``g / n`` (a
  speculative strategy streams a whole accepted block as one chunk); the tokens of the first
  chunk count in TTFT, not here. Samples are pooled over every request of the level.
* **chunk gap**: the time between two consecutive chunks, one sample per gap (what a reader of
  the stream sees as stalls).
* **TPOT**: per request, (end-to-end - TTFT) / (tokens - 1).
* **tokens/s**: every token of the level's completed requests over the level's wall time (first
  request sent to last response finished; the warm-up request is not in it).
* **worker peak RSS**: ``VmHWM`` of each model-worker process, reset (``/proc/PID/clear_refs``)
  just before the level starts, so it is the peak resident set during the level.
* **busy fraction** (per model worker): the growth of the server's cumulative
  ``specserve_worker_forward_seconds_total`` (``..._step_seconds_total``) between a ``/metrics``
  scrape right before and one right after the level's timed part, over the level's wall time:
  the fraction of the level the worker spent in forward passes (in step calls, which include
  the forwards). The only server-side figure.
* **bare limit** (with ``--bare-limit on``): the tokens/s the level's own forward passes would
  allow with nothing else running, from transformers' forward of the models at the level's
  shapes in the benchmark process (defined in :mod:`benchmarks.served.bare_limit`); **served / limit**
  = tokens/s over it.

A run with ``--overlap on,off`` holds every level twice, once per setting of the scheduler's
overlap (``overlap`` of each level and record); levels are told apart by (label, concurrency,
overlap).

Medians and 99th percentiles use linear interpolation between order statistics (numpy's
default); with few samples the p99 is close to the maximum.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

KIND = "serve-load"
MIB = 1024 * 1024


# ----------------------------------------------------------------------------- records

@dataclass(frozen=True)
class RequestRecord:
    """One measured request. Times are seconds; ``chunk_times_s`` are from the request's send."""

    label: str
    concurrency: int
    index: int
    prompt_id: str
    seed: int
    ok: bool
    error: str | None
    sent_s: float  # from the level's start
    e2e_s: float
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk
    usage_completion_tokens: int | None = None  # the server's count (final chunk's usage)
    target_calls: int | None = None  # the server's speculation stats, when streamed
    drafted_tokens: int | None = None  # the server's stats: tokens drafted over the request's iterations
    times_s: dict[str, float] | None = None  # the server's stats: seconds in draft, target, verify, coordination
    overlap: bool | None = None  # the server's args.engine.overlap (None: not recorded)

    @property
    def completion_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    def chunk_gaps(self) -> list[tuple[float, int]]:
        """(gap to the previous chunk, tokens of this chunk) for every chunk after the first."""
        times, tokens = self.chunk_times_s, self.chunk_tokens
        return [(times[i] - times[i - 1], tokens[i]) for i in range(1, len(times))]

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class LevelRun:
    """What was measured about a level beyond its requests."""

    label: str
    strategy: str
    concurrency: int
    requests: int  # planned
    wall_s: float
    warmup_ok: bool
    warmup_s: float
    memory: dict[str, Any] | None = None  # see benchmarks.served.server_process.MemoryProbe.read
    load_average: str = "n/a"
    overlap: bool | None = None  # the server's args.engine.overlap (None: not recorded)
    busy: dict[str, dict[str, float | None]] | None = None  # worker -> forward_fraction, step_fraction
    bare: dict[str, Any] | None = None  # benchmarks.served.bare_limit.limit_record (None: not measured)


@dataclass(frozen=True)
class LevelSummary:
    label: str
    strategy: str
    concurrency: int
    requests: int
    completed: int
    failed: int
    short: int  # completed with fewer tokens than max_tokens
    tokens: int
    wall_s: float
    tokens_per_second: float
    ttft_median_s: float | None
    ttft_p99_s: float | None
    itl_median_s: float | None
    itl_p99_s: float | None
    chunk_gap_median_s: float | None
    chunk_gap_p99_s: float | None
    tpot_median_s: float | None
    e2e_median_s: float | None
    e2e_p99_s: float | None
    tokens_per_chunk: float | None
    block_efficiency: float | None  # server stats: tokens per target call, pooled
    worker_peak_rss_mib_total: float | None
    worker_peak_rss_mib_max: float | None
    workers: int
    errors: list[str] = field(default_factory=list)
    overlap: bool | None = None
    busy: dict[str, dict[str, float | None]] | None = None  # worker -> forward_fraction, step_fraction
    bare_limit_tokens_per_second: float | None = None  # benchmarks.served.bare_limit (None: not measured)
    served_over_limit: float | None = None  # tokens_per_second / bare_limit_tokens_per_second
    limit_with_prompt_tokens_per_second: float | None = None  # the limit with each request's prompt forwards
    served_over_limit_with_prompt: float | None = None  # tokens_per_second / limit_with_prompt_tokens_per_second
    mean_block: float | None = None  # server stats: drafted tokens per target call, pooled (sd, multi_draft)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_level(run: LevelRun, records: list[RequestRecord], max_tokens: int) -> LevelSummary:
    done = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    itls: list[float] = []
    gaps: list[float] = []
    for record in done:
        for gap, tokens in record.chunk_gaps():
            gaps.append(gap)
            if tokens:
                itls.extend([gap / tokens] * tokens)
    tokens = sum(r.completion_tokens for r in done)
    chunks = sum(len(r.chunk_tokens) for r in done)
    calls = [r.target_calls for r in done if r.target_calls]
    efficiency = None
    if calls and len(calls) == len(done):
        efficiency = tokens / sum(calls)
    drafted = [r.drafted_tokens for r in done if r.drafted_tokens is not None and r.target_calls]
    mean_block = sum(drafted) / sum(calls) if calls and drafted and len(drafted) == len(calls) == len(done) else None
    peaks = (run.memory or {}).get("workers") or {}
    peak_values = [p["peak_rss_bytes"] / MIB for p in peaks.values() if p.get("peak_rss_bytes")]
    errors = sorted({r.error for r in records if r.error})[:5]
    served = tokens / run.wall_s if run.wall_s > 0 else 0.0
    limit = (run.bare or {}).get("limit_tokens_per_second")
    limit_with_prompt = (run.bare or {}).get("limit_with_prompt_tokens_per_second")
    return LevelSummary(
        label=run.label,
        strategy=run.strategy,
        concurrency=run.concurrency,
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        short=sum(r.completion_tokens < max_tokens for r in done),
        tokens=tokens,
        wall_s=run.wall_s,
        tokens_per_second=served,
        ttft_median_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_median_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        chunk_gap_median_s=percentile(gaps, 50),
        chunk_gap_p99_s=percentile(gaps, 99),
        tpot_median_s=percentile([r.tpot_s for r in done if r.tpot_s is not None], 50),
        e2e_median_s=percentile([r.e2e_s for r in done], 50),
        e2e_p99_s=percentile([r.e2e_s for r in done], 99),
        tokens_per_chunk=tokens / chunks if chunks else None,
        block_efficiency=efficiency,
        worker_peak_rss_mib_total=sum(peak_values) if peak_values else None,
        worker_peak_rss_mib_max=max(peak_values) if peak_values else None,
        workers=len(peaks),
        errors=errors,
        overlap=run.overlap,
        busy=run.busy,
        bare_limit_tokens_per_second=limit,
        served_over_limit=served / limit if limit else None,
        limit_with_prompt_tokens_per_second=limit_with_prompt,
        served_over_limit_with_prompt=served / limit_with_prompt if limit_with_prompt else None,
        mean_block=mean_block,
    )


# ----------------------------------------------------------------------------- results

@dataclass
class ServeLoadResults:
    settings: dict[str, Any]
    environment: dict[str, Any]
    command: str
    levels: list[LevelRun]
    records: list[RequestRecord]
    summaries: list[LevelSummary] = field(default_factory=list)

    def summarize(self) -> ServeLoadResults:
        by_level: dict[tuple[str, int, bool | None], list[RequestRecord]] = defaultdict(list)
        for record in self.records:
            by_level[(record.label, record.concurrency, record.overlap)].append(record)
        max_tokens = int(self.settings["max_tokens"])
        self.summaries = [summarize_level(run, by_level[(run.label, run.concurrency, run.overlap)], max_tokens)
                          for run in self.levels]
        return self

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "command": self.command,
            "settings": self.settings,
            "environment": self.environment,
            "summaries": [asdict(s) for s in self.summaries],
            "levels": [asdict(level) for level in self.levels],
            "records": [asdict(r) for r in self.records],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServeLoadResults:
        if data.get("kind") != KIND:
            raise ValueError(f"not a {KIND} run (kind {data.get('kind')!r})")
        return cls(
            settings=data["settings"],
            environment=data["environment"],
            command=data["command"],
            levels=[LevelRun(**level) for level in data["levels"]],
            records=[RequestRecord(**record) for record in data["records"]],
        ).summarize()


def is_serve_load_run(run_dir: pathlib.Path) -> bool:
    path = run_dir / "results.json"
    return path.exists() and json.loads(path.read_text(encoding="utf-8")).get("kind") == KIND


def write_json(results: ServeLoadResults, out_dir: pathlib.Path) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results.to_json(), indent=1) + "\n", encoding="utf-8")
    return path
