"""``specserve bench --mode serve-load``: the real HTTP server under concurrent streaming clients.

The server is started the way users start it, ``specserve serve --config YAML`` in a
subprocess with its own local Ray (``RAY_ADDRESS`` makes it join a cluster instead; then the
worker memory is not measured), HTTP and gRPC on free ports of 127.0.0.1. Once ``GET /health``
answers 200, every *level* (one strategy at one concurrency c) runs: one warm-up request, then
c closed-loop clients (asyncio tasks over one httpx client) that each send a streaming
``POST /v1/completions`` request, wait for its ``[DONE]`` and send the next, until the level's
requests are used up. Request i of every level uses prompt ``i mod P`` of the committed prompt
set (text, tokenized by the server), seed ``seed + i``, ``max_tokens`` with ``ignore_eos``,
the given temperature with no top-k / top-p, ``return_token_ids`` (to count the tokens of
each chunk) and the ``speculation`` object of the strategy (plus ``Authorization: Bearer`` when
the application has an API key). Everything is timed on the client
side (see :mod:`benchmarks.served.serve_load_records` for the definitions). Before each level the
peak-RSS counters of the server's model-worker processes (the Ray actors whose process title
is ``ray::<worker_class>``, found among the server subprocess's descendants in ``/proc``) are
reset; after it their ``VmHWM`` is read. Right before and right after each level's timed part
the server's ``GET /metrics`` is scraped; the growth of each worker's cumulative
``specserve_worker_forward_seconds_total`` and ``specserve_worker_step_seconds_total`` over
the level's wall time is the worker's *busy fraction* in forward passes and in step calls. Then
the server is stopped (SIGINT, as Ctrl-C).

With ``overlap`` set (``--overlap on,off``), the whole set of levels runs once per setting of
the scheduler's two-cohort overlap, overlap off first: for each, a copy of the YAML with the
application's ``args.engine.overlap`` set is written into the output directory and a server is
started on it (and stopped after its levels). Every level records the setting it ran with.

With ``bare_limit`` on (``--bare-limit on``, the default), once every server has stopped, the
bare-model limit of every level is measured in the benchmark process (transformers' own forward
of the models at the level's shapes; defined in :mod:`benchmarks.served.bare_limit`) and reported next
to the served tokens/s as ``bare limit tok/s`` and ``served / limit``.

Strategies: ``ar``; ``sd`` (block verification, gamma 4); ``multi_draft`` (SpecTr, K = 2,
gamma 4); ``ensemble`` (the standard weighted ensemble of the target and the first member
model) and ``se`` (the speculative ensemble of the same, token verification, every member
proposing 1 token).
"""


from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
import time
from typing import Any

from actors.worker.cpu_binding import torch_thread_count
from benchmarks.served.bare_limit import LevelShape, bare_limits, context_midway, median_prompt_tokens
from benchmarks.served.load_cases import ServeLoadSettings, serve_load_cases
from benchmarks.reports.store import load_avg
from benchmarks.served.load_client import LevelPlan, LoadClient
from benchmarks.served.prompts import PROMPTS_PATH, Prompt, load_prompts
from benchmarks.served.serve_load_records import ServeLoadResults, write_json
from benchmarks.served.serve_load_report import busy_text, write_results
from benchmarks.served.server_process import MemoryProbe, ServerProcess, write_engine_config

logger = logging.getLogger(__name__)


def run_serve_load(
    config_path: pathlib.Path | str,
    settings: ServeLoadSettings,
    out_dir: pathlib.Path,
    *,
    app_name: str | None = None,
    command: str = "specserve bench --mode serve-load",
    prompts_path: pathlib.Path = PROMPTS_PATH,
    plot_prefix: str = "",
) -> ServeLoadResults:
    """Start the server, run every level, stop the server (once per overlap pass), write the
    results under ``out_dir``."""
    from benchmarks.served.run import environment_info
    from cluster.config import load_app_args, read_serve_config, select_application

    started = time.perf_counter()
    load_start = load_avg()
    config_path = pathlib.Path(config_path)
    if settings.prefix_caching is not None:
        config_path = write_engine_config(config_path, app_name, "prefix_caching", settings.prefix_caching, out_dir)
    application = select_application(read_serve_config(config_path), app_name, str(config_path))
    group = load_app_args(config_path, app_name).freeze()
    cases = serve_load_cases(settings, group.roles)
    prompts = load_prompts(prompts_path, settings.num_prompts)
    passes = settings.overlap_passes()
    per_pass = [(case, c, settings.requests_for(c)) for c in settings.concurrency for case in cases]
    logger.info("%d levels (%s at concurrency %s)%s, %d requests of %d tokens",
                len(per_pass) * len(passes), ", ".join(c.label for c in cases), ",".join(map(str, settings.concurrency)),
                "" if passes == [None] else " with overlap " + ", then ".join(_on_off(o) for o in passes),
                sum(n for _, _, n in per_pass) * len(passes), settings.max_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    route_prefix = application.get("route_prefix") or "/"
    model = application.get("name") or "specserve"
    environment: dict[str, Any] = environment_info() | {
        "config": str(config_path), "app": model, "num_prompts": len(prompts),
        "models": {m.name: {"path": m.path, "role": m.role} for m in group.models},
        "max_concurrent_requests": group.max_concurrent_requests, "max_queued_requests": group.max_queued_requests,
        "load_average_start": load_start,
    }
    results = ServeLoadResults(settings=settings.model_dump(mode="json"), environment=environment, command=command,
                               levels=[], records=[])
    for overlap in passes:
        if overlap is None:
            # "auto" is settled by the server against its cluster's GPUs: not known here.
            configured = getattr(group, "overlap", None)
            pass_config, effective = config_path, configured if isinstance(configured, bool) else None
        else:
            pass_config, effective = write_engine_config(config_path, app_name, "overlap", overlap, out_dir), overlap
        server = ServerProcess(pass_config, out_dir / "server.log", settings.start_timeout_s, settings.direct_http)
        plans = [LevelPlan(case, c, n, effective) for case, c, n in per_pass]
        try:
            server.start(route_prefix)
            environment.setdefault("server_start_s", server.start_s)
            environment.setdefault("clients_call", "the replica's own HTTP server (direct HTTP)"
                                   if server.direct_http_port is not None else "Serve's HTTP proxy")
            if overlap is not None:
                environment.setdefault("server_passes", []).append(
                    {"overlap": overlap, "config": str(pass_config), "server_start_s": server.start_s})
            client = LoadClient(server.client_url + route_prefix.rstrip("/"), model, settings, prompts, _api_key(application))
            memory = MemoryProbe(server.process.pid if server.process else None, settings.worker_class)
            for plan in plans:
                if server.process is not None and server.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {server.process.returncode}:\n{server.log_tail()}")
                run, records = asyncio.run(client.run_level(plan, memory))
                results.levels.append(run)
                results.records.extend(records)
                summary = results.summarize().summaries[-1]
                logger.info("%s at %d%s: %d ok, %d failed, %.1f tok/s, TTFT p50 %s ms, ITL p50 %s ms, "
                            "workers peak %s MiB, busy (forward / step) %s",
                            plan.case.label, plan.concurrency, "" if overlap is None else f", overlap {_on_off(overlap)}",
                            summary.completed, summary.failed, summary.tokens_per_second, _ms(summary.ttft_median_s),
                            _ms(summary.itl_median_s),
                            "n/a" if summary.worker_peak_rss_mib_total is None else f"{summary.worker_peak_rss_mib_total:.0f}",
                            busy_text(summary.busy))
                write_json(results, out_dir)  # what is measured so far survives an interruption
        finally:
            server.stop()
    if settings.bare_limit and results.levels:
        add_bare_limits(results, settings, group, prompts)
    environment.update(load_average_end=load_avg(), wall_time_s=time.perf_counter() - started)
    results.summarize()
    write_results(results, out_dir, plot_prefix=plot_prefix)
    return results


def level_shape(settings: ServeLoadSettings, strategy: str, concurrency: int, label: str = "",
                mean_block: float | None = None) -> LevelShape:
    """The shapes of a level's iteration (its strategy's gamma as this run sends it; an sd case
    of gamma auto, whose blocks vary, gets the shapes of its measured mean block, rounded, when
    the server reported it, else those of ``sd_gamma``)."""
    se_gamma = 1 if settings.se_gamma == "auto" else settings.se_gamma
    gamma = {"sd": settings.sd_gamma, "multi_draft": settings.multi_draft_gamma, "se": se_gamma}.get(strategy, 1)
    block = label.rsplit("/g", 1)[-1]
    if strategy == "sd" and block.isdigit():
        gamma = int(block)
    elif strategy == "sd" and block == "auto" and mean_block:
        gamma = max(1, round(mean_block))
    return LevelShape(strategy, concurrency, gamma=gamma, num_drafts=settings.num_drafts)


def add_bare_limits(results: ServeLoadResults, settings: ServeLoadSettings, group: Any, prompts: list[Prompt]) -> None:
    """Measure the bare-model limit of every level of ``results`` (benchmarks.served.bare_limit) and
    store it with the level (results.json keeps it; the summaries report it)."""
    results.summarize()
    roles = dict(group.roles)
    paths = {m.name: m.path for m in group.models}
    tokenizer = group.tokenizer_path or paths[_first_role(roles, "target")]
    prompt_tokens = median_prompt_tokens(tokenizer, [p.text for p in prompts])
    context = context_midway(prompt_tokens, settings.max_tokens)
    threads = max(torch_thread_count(m.torch_threads) for m in group.models)  # "auto": this process's cores
    logger.info("bare-model limit: %d levels at context %d, %d torch thread(s)", len(results.levels), context, threads)
    shapes = [level_shape(settings, run.strategy, run.concurrency, run.label, summary.mean_block)
              for run, summary in zip(results.levels, results.summaries)]
    efficiencies = [s.block_efficiency for s in results.summaries]
    records = bare_limits(shapes, efficiencies, roles, paths, context=context, repeats=settings.bare_repeats,
                          threads=threads, prompt_tokens=prompt_tokens, max_tokens=settings.max_tokens)
    results.levels = [dataclasses.replace(run, bare=record) for run, record in zip(results.levels, records)]
    results.environment["bare_limit"] = {"context": context, "prompt_tokens": prompt_tokens, "torch_threads": threads,
                                         "repeats": settings.bare_repeats}


def _first_role(roles: dict[str, str], role: str) -> str:
    return next(name for name, r in roles.items() if r == role)


def _on_off(overlap: bool | None) -> str:
    return "n/a" if overlap is None else ("on" if overlap else "off")


def _api_key(application: dict[str, Any]) -> str | None:
    """The key the server will ask for, if any: the application's ``args.security.api_key``, else
    ``SPECSERVE_API_KEY`` (the server subprocess inherits this environment). Never recorded."""
    security = (application.get("args") or {}).get("security") or {}
    return security.get("api_key") or os.environ.get("SPECSERVE_API_KEY") or None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f}"
