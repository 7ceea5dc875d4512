"""Serving-load results as people read them: ``results.md`` (the level, bare-limit, busy and
overlap tables) and ``serve_load.png``, written with ``results.json`` by :func:`write_results`.
The figures are defined in :mod:`benchmarks.served.serve_load_records`."""

from __future__ import annotations

import json
import logging
import pathlib
from collections import defaultdict
from typing import Any

from benchmarks.served.serve_load_records import MIB, LevelRun, LevelSummary, ServeLoadResults, write_json

logger = logging.getLogger(__name__)

PLOT_FILES = ("serve_load.png",)


def write_results(results: ServeLoadResults, out_dir: pathlib.Path, *, plot_prefix: str = "") -> dict[str, pathlib.Path]:
    """results.json, results.md and serve_load.png under ``out_dir``."""
    written = {"json": write_json(results, out_dir), "markdown": out_dir / "results.md"}
    plot = write_plot(results, out_dir)
    plots = {}
    if plot is not None:
        written["plot"] = plot
        plots["serve_load"] = plot_prefix + plot.name
    written["markdown"].write_text(render_markdown(results, plots), encoding="utf-8")
    logger.info("wrote %s", ", ".join(str(p) for p in written.values()))
    return written


def rerender(run_dir: pathlib.Path, *, plot_prefix: str = "") -> ServeLoadResults:
    """Rebuild the summaries, results.md and the plot of a finished run from its results.json."""
    data = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    results = ServeLoadResults.from_json(data)
    write_results(results, run_dir, plot_prefix=plot_prefix)
    return results


# ----------------------------------------------------------------------------- markdown

def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def on_off(overlap: bool | None) -> str:
    return "–" if overlap is None else ("on" if overlap else "off")


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def busy_text(busy: dict[str, dict[str, float | None]] | None) -> str:
    """``target 62% / 75%, draft 20% / 31%`` (forward / step), or n/a without a scrape."""
    if not busy:
        return "n/a"
    return ", ".join(f"{worker} {_percent(row.get('forward_fraction'))} / {_percent(row.get('step_fraction'))}"
                     for worker, row in busy.items())


def has_overlap_passes(summaries: list[LevelSummary]) -> bool:
    """Whether the run holds levels under both overlap settings (``--overlap on,off``)."""
    return len({s.overlap for s in summaries if s.overlap is not None}) > 1


def has_bare_limits(summaries: list[LevelSummary]) -> bool:
    return any(s.bare_limit_tokens_per_second is not None for s in summaries)


def level_table(summaries: list[LevelSummary], *, overlap_column: bool = False) -> list[str]:
    head, rule = (" overlap |", " :---: |") if overlap_column else ("", "")
    bare = has_bare_limits(summaries)
    prompt = any(s.limit_with_prompt_tokens_per_second is not None for s in summaries)
    bare_head, bare_rule = (" bare limit tok/s | served / limit |", " ---: | ---: |") if bare else ("", "")
    if prompt:
        bare_head += " limit with prompt tok/s | served / that |"
        bare_rule += " ---: | ---: |"
    lines = [
        f"| strategy | concurrency |{head} ok / failed | tok/s |{bare_head} TTFT p50 / p99 ms | ITL p50 / p99 ms | chunk gap p99 ms "
        "| TPOT p50 ms | e2e p50 / p99 s | tokens / chunk | worker peak RSS MiB (sum / max) |",
        f"| --- | ---: |{rule} ---: | ---: |{bare_rule} ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        failed = f"**{s.failed}**" if s.failed else "0"
        memory = (f"{_f(s.worker_peak_rss_mib_total, 0)} / {_f(s.worker_peak_rss_mib_max, 0)}"
                  if s.worker_peak_rss_mib_total is not None else "–")
        overlap = f" {on_off(s.overlap)} |" if overlap_column else ""
        limit = f" {_f(s.bare_limit_tokens_per_second)} | {_percent(s.served_over_limit)} |" if bare else ""
        if prompt:
            limit += f" {_f(s.limit_with_prompt_tokens_per_second)} | {_percent(s.served_over_limit_with_prompt)} |"
        lines.append(
            f"| {s.label} | {s.concurrency} |{overlap} {s.completed} / {failed} | {_f(s.tokens_per_second)} |{limit}"
            f" {_ms(s.ttft_median_s)} / {_ms(s.ttft_p99_s)} | {_ms(s.itl_median_s)} / {_ms(s.itl_p99_s)} "
            f"| {_ms(s.chunk_gap_p99_s)} | {_ms(s.tpot_median_s)} | {_f(s.e2e_median_s, 2)} / {_f(s.e2e_p99_s, 2)} "
            f"| {_f(s.tokens_per_chunk, 2)} | {memory} |"
        )
    return lines


def bare_table(results: ServeLoadResults) -> list[str]:
    """The bare-model limit of every level: its forwards per iteration and their median times."""
    runs = [run for run in results.levels if run.bare]
    if not runs:
        return []
    prompt = any((run.bare or {}).get("prompt_forwards") for run in runs)
    head, rule = (" a request's prompt forwards (ms each) | limit with prompt tok/s |", " --- | ---: |") if prompt else ("", "")
    lines = ["| strategy | concurrency | forwards per iteration (median ms each) | iteration ms | tokens / iteration "
             f"| bare limit tok/s |{head}", f"| --- | ---: | --- | ---: | ---: | ---: |{rule}"]
    for run in runs:
        bare = run.bare or {}
        forwards = ", ".join(f"{f['count']} x {f['model']}: {f['rows']} x {f['tokens']} ({f['ms']:.1f})"
                             for f in bare.get("forwards", []))
        extra = ""
        if prompt:
            prompts = ", ".join(f"{f['model']}: 1 x {f['tokens']} ({f['ms']:.1f})" for f in bare.get("prompt_forwards", []))
            extra = f" {prompts or '–'} | {_f(bare.get('limit_with_prompt_tokens_per_second'))} |"
        lines.append(f"| {run.label} | {run.concurrency} | {forwards} | {_f(bare.get('iteration_ms'))} "
                     f"| {_f(bare.get('tokens_per_iteration'), 2)} | {_f(bare.get('limit_tokens_per_second'))} |{extra}")
    return lines


def bare_section(results: ServeLoadResults) -> list[str]:
    table = bare_table(results)
    if not table:
        return []
    contexts = sorted({(run.bare or {}).get("context") for run in results.levels if run.bare} - {None})
    prompt = ""
    if any((run.bare or {}).get("prompt_forwards") for run in results.levels):
        prompt = (" The limit with prompt adds each request's prompt forward on every model the level uses (from an "
                  "empty cache, the median prompt): a served request pays it too, and it is model time.")
    return ["## Bare-model limit", "",
            "What the level's forward passes alone allow: transformers' own forward (DynamicCache) of each model at "
            "the level's shapes, in the benchmark process with the workers' torch threads, at "
            f"{', '.join(map(str, contexts))} cached tokens per row (median prompt + half the completion); "
            "`model: r x n` is one forward of r rows of n new tokens. Tokens per iteration: c for ar and ensemble, "
            "c x the level's block efficiency for sd, multi_draft and se (definitions: `benchmarks/served/bare_limit.py`)."
            + prompt, "", *table, ""]


def busy_workers(summaries: list[LevelSummary]) -> list[str]:
    """Every worker with a busy fraction in some level, in first-seen order."""
    return list(dict.fromkeys(worker for s in summaries for worker in (s.busy or {})))


def busy_table(summaries: list[LevelSummary], *, overlap_column: bool = False) -> list[str]:
    """Busy fractions: one row per level, one column per worker (forward / step)."""
    workers = busy_workers(summaries)
    if not workers:
        return []
    head, rule = (" overlap |", " :---: |") if overlap_column else ("", "")
    lines = [f"| strategy | concurrency |{head} " + " | ".join(workers) + " |",
             f"| --- | ---: |{rule}" + " ---: |" * len(workers)]
    for s in summaries:
        busy = s.busy or {}
        cells = " | ".join(f"{_percent((busy.get(w) or {}).get('forward_fraction'))} / "
                           f"{_percent((busy.get(w) or {}).get('step_fraction'))}" if w in busy else "–"
                           for w in workers)
        overlap = f" {on_off(s.overlap)} |" if overlap_column else ""
        lines.append(f"| {s.label} | {s.concurrency} |{overlap} {cells} |")
    return lines


def overlap_table(summaries: list[LevelSummary]) -> list[str]:
    """Overlap off and on side by side, one row per (strategy, concurrency) that ran under both."""
    by_key = {(s.label, s.concurrency, s.overlap): s for s in summaries}
    rows = list(dict.fromkeys((s.label, s.concurrency) for s in summaries))
    lines = ["| strategy | concurrency | overlap off tok/s | overlap on tok/s | on/off | busy fractions off "
             "| busy fractions on |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for label, concurrency in sorted(rows, key=lambda row: row[1]):
        off, on = by_key.get((label, concurrency, False)), by_key.get((label, concurrency, True))
        if off is None or on is None:
            continue
        ratio = (f"{on.tokens_per_second / off.tokens_per_second:.2f}x" if off.tokens_per_second > 0 else "–")
        lines.append(f"| {label} | {concurrency} | {_f(off.tokens_per_second)} | {_f(on.tokens_per_second)} | {ratio} "
                     f"| {_busy_cell(off.busy)} | {_busy_cell(on.busy)} |")
    return lines if len(lines) > 2 else []


def _busy_cell(busy: dict[str, dict[str, float | None]] | None) -> str:
    return "–" if not busy else busy_text(busy)


def _level_name(s: LevelSummary, with_overlap: bool) -> str:
    return f"{s.label} (overlap {on_off(s.overlap)})" if with_overlap else s.label


def render_markdown(results: ServeLoadResults, plots: dict[str, str]) -> str:
    settings, env = results.settings, results.environment
    passes = has_overlap_passes(results.summaries)
    # strategies in the order they ran; with overlap passes, pass by pass (off first)
    summaries = sorted(results.summaries, key=lambda s: (bool(s.overlap) if passes else False, s.concurrency))
    top = max(settings["concurrency"])
    lines = [
        "# Serving under load",
        "",
        f"Command: `{results.command}`",
        "",
        f"Server: `specserve serve --config {env.get('config')}` in a subprocess (Ray Serve app, HTTP on "
        f"127.0.0.1; the clients call {env.get('clients_call', 'its HTTP proxy')}), clients in the benchmark process "
        f"(httpx, asyncio). Per level (a strategy at a concurrency "
        f"c): one warm-up request, then c closed-loop clients send {_requests_text(results.levels)} streaming "
        f"`/v1/completions` requests between them ({settings['max_tokens']} tokens each, EOS ignored, "
        f"temperature {settings['temperature']}, request i: prompt i mod {env.get('num_prompts')} of the "
        f"committed set, seed {settings['seed']} + i). Levels ran concurrency by concurrency, the strategies "
        f"in turn at each{_passes_text() if passes else ''}. Code: commit {env.get('git_commit', 'n/a')}. "
        f"Machine: {env.get('cpu_count')} CPUs, torch {env.get('torch')}, ray {env.get('ray')}; "
        f"server start-up {_start_text(env)}; "
        f"load average at start {env.get('load_average_start')}, at end {env.get('load_average_end')}; "
        f"wall time {_f(env.get('wall_time_s'), 0)} s.",
        *_admission_note(settings, env),
        "",
        "*tok/s* = generated tokens of the level's completed requests / the level's wall time; "
        "*TTFT* = send to first chunk with a token; *ITL* = per token, a chunk's gap to the previous "
        "chunk divided by its tokens (pooled over the level's requests); *chunk gap* = per chunk; "
        "*TPOT* = per request (end-to-end - TTFT) / (tokens - 1); *worker peak RSS* = VmHWM of the "
        "model-worker processes during the level (reset before it), summed over the workers and the "
        "largest one (resident pages include shared libraries, so the sum overstates the machine's total).",
        *_overlap_note(summaries, passes),
        "",
        *level_table(summaries, overlap_column=passes),
        "",
    ]
    lines += bare_section(results)
    busy = busy_table(summaries, overlap_column=passes)
    if busy:
        lines += ["## Busy fraction of the model workers", "",
                  "Per level and model worker: seconds in forward passes / seconds in step calls (forwards, "
                  "sampling, verification, sessions), as a fraction of the level's wall time; from the server's "
                  "`specserve_worker_forward_seconds_total` and `specserve_worker_step_seconds_total`, scraped at "
                  "`/metrics` right before and right after the level's timed part.", "", *busy, ""]
    if passes:
        compared = overlap_table(summaries)
        if compared:
            lines += ["## Overlap off and on", "",
                      "The same levels under `args.engine.overlap` false and true (a server started per setting, "
                      "overlap off first); busy fractions per worker as forward / step.", "", *compared, ""]
    at_top = [s for s in summaries if s.concurrency == top]
    if at_top:
        lines += [f"## Peak resident memory of the model workers at concurrency {top}", "",
                  "| strategy | workers | peak RSS per worker MiB | sum MiB |", "| --- | ---: | --- | ---: |"]
        for s in at_top:
            run = next(r for r in results.levels
                       if r.label == s.label and r.concurrency == s.concurrency and r.overlap == s.overlap)
            workers = (run.memory or {}).get("workers") or {}
            per = ", ".join(f"{w['peak_rss_bytes'] / MIB:.0f}" for _, w in sorted(workers.items()))
            lines.append(f"| {_level_name(s, passes)} | {s.workers} | {per or '–'} | "
                         f"{_f(s.worker_peak_rss_mib_total, 0)} |")
        lines.append("")
        since_start = [r for r in results.levels if r.memory and r.memory.get("peak") != "during the level"]
        if since_start:
            lines += ["The peak counters could not be reset here: these peaks are since the workers started.", ""]
    errors = [(s, e) for s in summaries for e in s.errors]
    if errors:
        lines += ["## Errors", ""] + [f"- {_level_name(s, passes)} at {s.concurrency}: `{e}`" for s, e in errors] + [""]
    for name, path in plots.items():
        lines += [f"![{name}]({path})", ""]
    return "\n".join(lines)


def _passes_text() -> str:
    return ("; every level ran twice, once per setting of the scheduler's overlap (`args.engine.overlap`), "
            "overlap off first, each pass with its own server start")


def _start_text(env: dict[str, Any]) -> str:
    passes = env.get("server_passes") or []
    if len(passes) > 1:
        return ", ".join(f"{_f(p.get('server_start_s'), 0)} s (overlap {on_off(p.get('overlap'))})" for p in passes)
    return f"{_f(env.get('server_start_s'), 0)} s"


def _overlap_note(summaries: list[LevelSummary], passes: bool) -> list[str]:
    """The overlap setting of a single-pass run, when recorded."""
    settings = {s.overlap for s in summaries if s.overlap is not None}
    if passes or len(settings) != 1:
        return []
    return ["", f"Scheduler overlap (`args.engine.overlap`): {on_off(settings.pop())}."]


def _admission_note(settings: dict[str, Any], env: dict[str, Any]) -> list[str]:
    limit = env.get("max_concurrent_requests")
    if not limit or max(settings["concurrency"]) <= limit:
        return []
    queued = env.get("max_queued_requests")
    where = (f"the scheduler's waiting line (`limits.max_queued_requests` = {queued})" if queued
             else "the scheduler's waiting line")
    return ["", f"The deployment runs at most `limits.max_concurrent_requests` = {limit} requests at once; "
            f"above {limit} clients the rest wait in {where}, and that wait is part of their TTFT."]


def _requests_text(levels: list[LevelRun]) -> str:
    """The measured requests per level: one number, or one per concurrency."""
    counts = dict(sorted({level.concurrency: level.requests for level in levels}.items()))
    if len(set(counts.values())) <= 1:
        return str(next(iter(counts.values()), 0))
    return ", ".join(f"{n} (c = {c})" for c, n in counts.items())


# ----------------------------------------------------------------------------- plot

def write_plot(results: ServeLoadResults, out_dir: pathlib.Path) -> pathlib.Path | None:
    """Four panels against concurrency, one line per strategy: tokens/s, TTFT, ITL, worker memory."""
    if not results.summaries:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = has_overlap_passes(results.summaries)
    series: dict[str, list[LevelSummary]] = defaultdict(list)
    for s in sorted(results.summaries, key=lambda s: s.concurrency):
        series[_level_name(s, passes)].append(s)
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        (axes[0][0], "aggregate tokens/s", lambda s: s.tokens_per_second, None),
        (axes[0][1], "TTFT (ms): median, p99 dashed", lambda s: _scaled(s.ttft_median_s), lambda s: _scaled(s.ttft_p99_s)),
        (axes[1][0], "ITL per token (ms): median, p99 dashed", lambda s: _scaled(s.itl_median_s),
         lambda s: _scaled(s.itl_p99_s)),
        (axes[1][1], "worker peak RSS, sum over workers (MiB)", lambda s: s.worker_peak_rss_mib_total, None),
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, title, main, extra in panels:
        for index, (label, rows) in enumerate(series.items()):
            color = colors[index % len(colors)]
            xs = [s.concurrency for s in rows]
            axis.plot(xs, [_nan(main(s)) for s in rows], marker="o", color=color, label=label)
            if extra is not None:
                axis.plot(xs, [_nan(extra(s)) for s in rows], marker="x", linestyle="--", color=color)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({s.concurrency for s in results.summaries}))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_xlabel("concurrent clients")
        axis.set_title(title)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0][0].legend()
    figure.tight_layout()
    path = out_dir / PLOT_FILES[0]
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def _scaled(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
