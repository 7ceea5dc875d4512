"""Write a benchmark run: ``results.json``, ``results.md`` (markdown tables) and PNG plots."""

from __future__ import annotations

import json
import logging
import pathlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from actors.coordination.plan import ENSEMBLE_STRATEGIES
from benchmarks.reports.analysis import (
    AdaptiveComparison,
    CaseSummary,
    Overhead,
    PeerComparison,
    TargetCheck,
    sd_gamma,
    to_jsonable,
)
from benchmarks.reports.records import RunRecord
from benchmarks.served.suite import BenchSettings

logger = logging.getLogger(__name__)

PLOT_FILES = ("block_efficiency.png", "speedup.png", "time_split.png", "distribution_overhead.png")


@dataclass(frozen=True)
class BenchResults:
    """Everything a run produced."""

    settings: BenchSettings
    environment: dict[str, Any]
    command: str
    summaries: list[CaseSummary]
    overhead: list[Overhead]
    peer: list[PeerComparison]
    checks: list[TargetCheck]
    records: list[RunRecord]
    adaptive: list[AdaptiveComparison] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "settings": self.settings.model_dump(mode="json"),
            "environment": self.environment,
            "summaries": to_jsonable(self.summaries),
            "distribution_overhead": to_jsonable(self.overhead),
            "peer_comparison": to_jsonable(self.peer),
            "target_checks": to_jsonable(self.checks),
            "adaptive_gamma": to_jsonable(self.adaptive),
            "records": [r.to_dict() for r in self.records],
        }


def write_results(results: BenchResults, out_dir: pathlib.Path, *, plot_prefix: str = "") -> dict[str, pathlib.Path]:
    """Write results.json, results.md and the plots under ``out_dir``; return what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    written["json"].write_text(json.dumps(results.to_json(), indent=1) + "\n", encoding="utf-8")
    plots = write_plots(results, out_dir)
    written.update(plots)
    written["markdown"].write_text(render_markdown(results, {k: plot_prefix + p.name for k, p in plots.items()}),
                                   encoding="utf-8")
    logger.info("wrote %s", ", ".join(str(p) for p in written.values()))
    return written


# ----------------------------------------------------------------------------- markdown

def _f(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _case_table(summaries: list[CaseSummary], *, member_calls: bool = False) -> list[str]:
    extra_head, extra_rule = (" member calls/token |", " ---: |") if member_calls else ("", "")
    lines = [
        "| case | mode | block eff. | mean accepted | tok/s | speedup | vs | ms/iter draft / target / verify / coord. / total "
        f"| bytes/token |{extra_head}",
        f"| --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: |{extra_rule}",
    ]
    for s in summaries:
        split = s.ms_per_iteration
        split_text = " / ".join(_f(split[k], 1) for k in ("draft", "target", "verify", "coordination", "total"))
        baseline = (s.baseline or "").split(":", 1)[-1]
        extra = ""
        if member_calls:
            calls = " + ".join(f"{_f(value)}" for _, value in sorted(s.model_calls_per_token.items()))
            extra = f" {calls} |"
        lines.append(
            f"| {s.label} | {s.mode} | {_f(s.block_efficiency)} | {_f(s.mean_accepted)} | {_f(s.tokens_per_second, 0)} "
            f"| {_f(s.speedup, 2, 'x')} | {baseline} | {split_text} | {_f(s.bytes_per_token, 0)} |{extra}"
        )
    return lines


def _kind_table(summaries: list[CaseSummary]) -> list[str]:
    kinds = sorted({k for s in summaries for k in s.block_efficiency_by_kind})
    if len(kinds) < 2:
        return []
    header = " | ".join(f"block eff. {k} | tok/s {k}" for k in kinds)
    lines = [f"| case | mode | {header} |", "| --- | --- |" + " ---: | ---: |" * len(kinds)]
    for s in summaries:
        cells = " | ".join(
            f"{_f(s.block_efficiency_by_kind.get(k))} | {_f(s.tokens_per_second_by_kind.get(k), 0)}" for k in kinds
        )
        lines.append(f"| {s.label} | {s.mode} | {cells} |")
    return lines


def adaptive_section(results: BenchResults) -> list[str]:
    """sd with gamma "auto" next to the fixed gammas of the same rule and mode, and the
    "best fixed gamma vs auto" lines; empty when the run has no auto case."""
    autos = [s for s in results.summaries if sd_gamma(s) == "auto"]
    if not autos:
        return []
    rows = [s for s in results.summaries if sd_gamma(s) is not None
            and any(a.mode == s.mode and a.label.split("/")[1] == s.label.split("/")[1] for a in autos)]
    modes, methods = list(results.settings.modes), list(results.settings.sd_methods)
    rows.sort(key=lambda s: (modes.index(s.mode) if s.mode in modes else len(modes),
                             methods.index(s.label.split("/")[1]) if s.label.split("/")[1] in methods else len(methods),
                             sd_gamma(s) == "auto", sd_gamma(s) if isinstance(sd_gamma(s), int) else 0))
    limit = results.settings.auto_gamma_max()
    lines = [
        "## Adaptive draft length (gamma auto)",
        "",
        "`gamma: \"auto\"`: each request chooses its block before each draft from its own acceptance so far, "
        f"in [1, gamma_max] (gamma_max = {limit if limit is not None else 'the deployment default'}). "
        "*mean drafted* = draft tokens per iteration, pooled over all prompts.",
        "",
        "| case | mode | block eff. | mean accepted | mean drafted | tok/s | speedup |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in rows:
        lines.append(f"| {s.label} | {s.mode} | {_f(s.block_efficiency)} | {_f(s.mean_accepted)} "
                     f"| {_f(s.mean_draft_length)} | {_f(s.tokens_per_second, 0)} | {_f(s.speedup, 2, 'x')} |")
    lines.append("")
    for row in results.adaptive:
        lines.append(
            f"- best fixed gamma vs auto, {row.method} ({row.mode}): best fixed gamma {row.best_fixed_gamma} "
            f"{row.best_fixed_tokens_per_second:.0f} tok/s, auto {row.auto_tokens_per_second:.0f} tok/s: auto / best "
            f"fixed {_f(row.tokens_per_second_ratio, 2, 'x')} tokens/s (paired median); block efficiency "
            f"{row.best_fixed_block_efficiency:.2f} vs {row.auto_block_efficiency:.2f} (auto drafted "
            f"{_f(row.auto_mean_draft_length)} tokens per iteration)"
        )
    if results.adaptive:
        lines.append("")
    return lines


def render_markdown(results: BenchResults, plots: dict[str, str]) -> str:
    settings, env = results.settings, results.environment
    groups = defaultdict(list)
    for s in results.summaries:
        groups["ensembles" if s.group in ENSEMBLE_STRATEGIES else "decoding"].append(s)
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{results.command}`",
        "",
        f"Prompts: {env.get('num_prompts')} ({env.get('prompt_kinds')}), {settings.max_tokens} tokens each, "
        f"temperature {settings.temperature}, {settings.repeats} pass(es), seeds from {settings.seed}; "
        f"warm-up excluded; cases interleaved per prompt in a seeded random order. "
        f"Code: commit {env.get('git_commit', 'n/a')}. Machine: {env.get('cpu_count')} CPUs, "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"ray {env.get('ray')}; load average at start {env.get('load_average_start')}, at end "
        f"{env.get('load_average_end')}; wall time {_f(env.get('wall_time_s'), 0)} s.",
        "",
        "Timings are medians over prompts. *block eff.* = generated tokens per target call and "
        "*mean accepted* = accepted draft tokens per iteration, both pooled over all prompts (for "
        "ensembles: per call of the busiest member); *speedup* = median over prompts of tokens/s "
        "divided by the baseline's tokens/s on the same prompt; *ms/iter* = time per decoding "
        "iteration (one target call) split into draft / target / verify / coordination (for the "
        "peer, the rest of transformers' loop is in *coord.*; for ensembles *target* sums the "
        "members' forward times); *bytes/token* = probability-row and logit bytes moved between "
        "actors per generated token.",
        "",
    ]
    for title, key in (("Speculative decoding, multi-draft and the peer", "decoding"),
                       ("Ensembles and speculative ensembles", "ensembles")):
        if groups[key]:
            lines += [f"## {title}", "", *_case_table(groups[key], member_calls=key == "ensembles"), ""]
    lines += adaptive_section(results)
    if results.peer:
        lines += [
            "## sd versus transformers assisted generation",
            "",
            "Speedups over each system's own autoregressive sampling (specserve `ar`; transformers "
            "`generate(do_sample=True)`), and the ratio of the two.",
            "",
            "| gamma | mode | method | sd speedup | peer speedup | ratio | sd tok/s | peer tok/s |",
            "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in results.peer:
            lines.append(
                f"| {row.gamma} | {row.mode} | {row.method} | {_f(row.sd_speedup, 2, 'x')} | {_f(row.peer_speedup, 2, 'x')} "
                f"| {_f(row.ratio, 2, 'x')} | {_f(row.sd_tokens_per_second, 0)} | {_f(row.peer_tokens_per_second, 0)} |"
            )
        lines.append("")
    if results.overhead:
        lines += [
            "## Distribution overhead: separate Ray actors versus one process",
            "",
            "| strategy | Ray tok/s | one process tok/s | Ray / one process |",
            "| --- | ---: | ---: | ---: |",
        ]
        for row in results.overhead:
            lines.append(f"| {row.label} | {row.ray_tokens_per_second:.0f} | {row.local_tokens_per_second:.0f} | {_f(row.ratio, 2, 'x')} |")
        lines.append("")
    kind_lines = _kind_table(results.summaries)
    if kind_lines:
        lines += ["## By prompt kind", "", *kind_lines, ""]
    lines += ["## Targets", "", "| target | required | measured | met |", "| --- | --- | --- | --- |"]
    for check in results.checks:
        met = {True: "yes", False: "**no**", None: "not measured"}[check.met]
        lines.append(f"| {check.name} | {check.required} | {check.measured} | {met} |")
    lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for name, path in plots.items():
            lines += [f"![{name}]({path})", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots

def write_plots(results: BenchResults, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """PNG plots (matplotlib, Agg backend); a plot without data is skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = {}
    for name, draw in (
        ("block_efficiency", _plot_block_efficiency),
        ("speedup", _plot_speedup),
        ("time_split", _plot_time_split),
        ("distribution_overhead", _plot_overhead),
    ):
        figure = draw(plt, results)
        if figure is None:
            continue
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written[name] = path
    return written


def _primary_mode(summaries: list[CaseSummary]) -> str:
    modes = {s.mode for s in summaries}
    return "ray" if "ray" in modes else ("local" if "local" in modes else "hf")


def _plot_block_efficiency(plt, results: BenchResults):
    mode = _primary_mode(results.summaries)
    series: dict[str, dict[int, float]] = defaultdict(dict)
    adaptive: dict[str, tuple[float, float]] = {}  # sd rule -> (mean drafted, block efficiency) of gamma auto
    multi: list[tuple[str, float]] = []
    for s in results.summaries:
        if s.group == "sd" and s.mode == mode:
            _, method, _ = s.label.split("/")
            gamma = sd_gamma(s)
            if isinstance(gamma, int):
                series[f"sd {method}"][gamma] = s.block_efficiency
            elif s.mean_draft_length is not None:
                adaptive[f"sd {method}"] = (s.mean_draft_length, s.block_efficiency)
        elif s.label.startswith("peer/assisted/"):
            series["transformers assisted"][int(s.label.rsplit("/g", 1)[1])] = s.block_efficiency
        elif s.group == "multi_draft" and s.mode == mode:
            _, method, k, gamma = s.label.split("/")
            multi.append((f"{method} {k.upper()} γ={gamma[1:]}", s.block_efficiency))
    if not series and not multi:
        return None
    figure, axes = plt.subplots(1, 2 if multi else 1, figsize=(11 if multi else 6, 4), squeeze=False)
    left = axes[0][0]
    colors = {}
    for name, points in sorted(series.items()):
        gammas = sorted(points)
        (line,) = left.plot(gammas, [points[g] for g in gammas], marker="o", label=name)
        colors[name] = line.get_color()
    for name, (drafted, efficiency) in sorted(adaptive.items()):
        left.plot([drafted], [efficiency], marker="*", markersize=12, linestyle="none", color=colors.get(name),
                  label=f"{name} auto (at its mean drafted length)")
    left.set_xlabel("gamma (draft tokens per iteration)")
    left.set_ylabel("block efficiency (tokens per target call)")
    left.set_title(f"Single draft ({mode})")
    left.grid(alpha=0.3)
    left.legend()
    if multi:
        right = axes[0][1]
        right.barh([name for name, _ in multi], [value for _, value in multi], color="tab:purple")
        right.set_xlabel("block efficiency (tokens per target call)")
        right.set_title(f"Multi-draft ({mode})")
        right.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    return figure


MODE_COLORS = {"ray": "tab:blue", "local": "tab:orange", "hf": "tab:green"}


def _plot_speedup(plt, results: BenchResults):
    """Two panels: sd / multi_draft / peer against their ar, se against the standard ensemble;
    one bar per (case, mode) that ran."""
    panels = {"decoding": [], "ensembles": []}
    for s in results.summaries:
        if s.speedup is None or s.key == s.baseline:
            continue
        panels["ensembles" if s.group == "se" else "decoding"].append(s)
    panels = {name: rows for name, rows in panels.items() if rows}
    if not panels:
        return None
    tallest = max(len(rows) for rows in panels.values())
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 0.22 * tallest + 1.6), squeeze=False)
    titles = {"decoding": "vs ar (transformers: vs its own sampling loop)", "ensembles": "se vs the standard ensemble"}
    for axis, (name, rows) in zip(axes[0], panels.items()):
        labels = list(dict.fromkeys(s.label for s in rows))
        positions, colors, values, ticks = [], [], [], []
        y = 0.0
        for label in labels:
            group = [s for s in rows if s.label == label]
            ticks.append((y + (len(group) - 1) * 0.4 / 2, label))
            for s in group:
                positions.append(y)
                colors.append(MODE_COLORS.get(s.mode, "tab:gray"))
                values.append(s.speedup)
                y += 0.4
            y += 0.35
        axis.barh(positions, values, height=0.38, color=colors)
        axis.set_yticks([t for t, _ in ticks])
        axis.set_yticklabels([label for _, label in ticks], fontsize=8)
        axis.invert_yaxis()
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_xlabel("speedup (paired tokens/s ratio, median over prompts)")
        axis.set_title(titles[name])
        axis.grid(alpha=0.3, axis="x")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for m, c in MODE_COLORS.items()
               if any(s.mode == m for rows in panels.values() for s in rows)]
    names = [m for m in MODE_COLORS if any(s.mode == m for rows in panels.values() for s in rows)]
    axes[0][-1].legend(handles, names, title="mode", loc="lower right")
    figure.tight_layout()
    return figure


def _plot_time_split(plt, results: BenchResults):
    """Per-iteration time split, one panel per mode (the peer next to the in-process mode)."""
    panels = [[s for s in results.summaries if s.mode == "ray"],
              [s for s in results.summaries if s.mode in ("local", "hf")]]
    panels = [rows for rows in panels if rows]
    if not panels:
        return None
    parts = ("draft", "target", "verify", "coordination")
    tallest = max(len(rows) for rows in panels)
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 0.26 * tallest + 1.6),
                                squeeze=False, sharex=True)
    for axis, rows in zip(axes[0], panels):
        left = [0.0] * len(rows)
        for part in parts:
            widths = [s.ms_per_iteration.get(part, 0.0) for s in rows]
            axis.barh(range(len(rows)), widths, left=left, label=part)
            left = [a + b for a, b in zip(left, widths)]
        axis.set_yticks(range(len(rows)))
        axis.set_yticklabels([s.key for s in rows], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("ms per iteration (one target call), medians")
        axis.grid(alpha=0.3, axis="x")
    axes[0][0].legend(loc="lower right")
    figure.tight_layout()
    return figure


def _plot_overhead(plt, results: BenchResults):
    if not results.overhead:
        return None
    figure, axis = plt.subplots(figsize=(8, 0.3 * len(results.overhead) + 1.5))
    axis.barh([r.label for r in results.overhead], [r.ratio or 0.0 for r in results.overhead], color="tab:green")
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.axvline(0.85, color="tab:red", linewidth=0.8, linestyle="--", label="target 0.85")
    axis.invert_yaxis()
    axis.set_xlabel("tokens/s on separate Ray actors / tokens/s in one process")
    axis.legend()
    axis.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    return figure


def results_from_json(path: pathlib.Path) -> dict[str, Any]:
    """Read a results.json back (for re-rendering)."""
    return json.loads(path.read_text(encoding="utf-8"))


