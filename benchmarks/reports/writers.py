"""Records of the results store (:mod:`benchmarks.reports.store`) from the benchmarks' own results.

* :func:`serve_load_record`: a serve-load run (``specserve bench --mode serve-load --record CASE``)
  or vLLM's peer run (``python -m benchmarks.peers.vllm_peer --record CASE``), one row per level;
* :func:`suite_record`: a suite run's results.json (``python -m benchmarks.reports.publish OUT --record CASE``);
* :func:`engine_load_record`: the engine alone (``python -m benchmarks.served.engine_load --record CASE``).
"""

from __future__ import annotations

import re
from typing import Any

from benchmarks.reports.store import make_record

GAMMA = re.compile(r"/g(\d+|auto)$")


def gamma_of(label: str) -> int | str | None:
    """The draft length a level's label names (``sd/block/g4`` -> 4, ``.../gauto`` -> ``auto``), or None."""
    match = GAMMA.search(label)
    if match is None:
        return None
    return match.group(1) if match.group(1) == "auto" else int(match.group(1))


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def serve_load_rows(summaries: list[Any]) -> list[dict[str, Any]]:
    """One row per level (a ``LevelSummary``): tokens/s, its ratio to ``ar`` at the same client
    count (and overlap), block efficiency, TTFT p50."""
    ar = {(s.concurrency, s.overlap): s.tokens_per_second for s in summaries if s.strategy == "ar"}
    rows = []
    for s in summaries:
        base = ar.get((s.concurrency, s.overlap))
        row = {"case": s.label, "strategy": s.strategy, "gamma": gamma_of(s.label), "clients": s.concurrency,
               "tokens_per_second": _round(s.tokens_per_second, 1),
               "ratio_to_ar": round(s.tokens_per_second / base, 2) if base else None,
               "block_efficiency": _round(s.block_efficiency, 2),
               "ttft_p50_ms": None if s.ttft_median_s is None else round(1000 * s.ttft_median_s)}
        if s.overlap is not None:
            row["overlap"] = "on" if s.overlap else "off"
        rows.append(row)
    return rows


def serve_load_record(results: Any, case: str, title: str | None = None) -> dict[str, Any]:
    """The record of a serve-load (or vLLM peer) run: ``results`` is a summarized ``ServeLoadResults``."""
    env = results.environment
    where = env.get("config") or env.get("server") or "the server"
    commit = env.get("git_commit")
    return make_record(case, title or f"Served load, {where}", results.command, serve_load_rows(results.summaries),
                       commit=None if commit in (None, "n/a") else commit)


def suite_record(data: dict[str, Any], case: str, title: str | None = None) -> dict[str, Any]:
    """The record of a suite run from its results.json: one row per case and mode."""
    rows = [{"case": s["label"], "mode": s["mode"], "tokens_per_second": _round(s["tokens_per_second"], 1),
             "speedup": _round(s.get("speedup"), 2), "block_efficiency": _round(s["block_efficiency"], 2)}
            for s in data["summaries"]]
    commit = (data.get("environment") or {}).get("git_commit")
    return make_record(case, title or "Every strategy, one request at a time", data.get("command") or "specserve bench",
                       rows, commit=None if commit in (None, "n/a") else commit)


def engine_load_record(case: str, command: str, *, strategy: str, gamma: int | str | None, clients: int,
                       tokens_per_second: float, ttft_p50_ms: float) -> dict[str, Any]:
    """The record of one engine-alone run (one strategy at one client count)."""
    row = {"case": strategy if gamma is None else f"{strategy} gamma {gamma}", "strategy": strategy, "gamma": gamma,
           "clients": clients, "tokens_per_second": round(tokens_per_second, 1), "ttft_p50_ms": round(ttft_p50_ms, 1)}
    return make_record(case, f"The engine alone, {strategy} at {clients} client{'s' if clients > 1 else ''}", command, [row])
