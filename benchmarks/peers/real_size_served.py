"""The served part of :mod:`benchmarks.peers.real_size` (``--serve specserve,vllm``): one server at a
time, the same streaming client (serve-load's), in rounds whose order of servers and dtypes is
reversed every other round; the table and the results-store rows of the medians.

specserve runs as ``specserve serve`` with a config holding only the model (``ar``); vLLM's CPU
build from ``--vllm-venv``, started as :mod:`benchmarks.peers.vllm_peer` starts it, with the case's
``--dtype`` (a venv that does not import vllm is reported and skipped).
"""

from __future__ import annotations

import argparse
import collections
import logging
import pathlib
from dataclasses import dataclass, field
from typing import Any

from benchmarks.served.prompts import load_prompts

logger = logging.getLogger("benchmarks.peers.real_size")

COMMAND = "python -m benchmarks.peers.real_size"


def serve_config(path: pathlib.Path | str, dtype: str, threads: int | str, max_concurrency: int, max_model_len: int) -> dict:
    """A Ray Serve config holding only this model (``ar``), for ``specserve serve``."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{
            "name": "specserve", "route_prefix": "/", "import_path": "cluster.app:build_app",
            "args": {
                "models": {"target": {"path": str(path), "role": "target", "dtype": dtype}},
                "defaults": {"strategy": "ar"},
                "resources": {"torch_threads": threads},
                "limits": {"max_concurrent_requests": max(16, max_concurrency)},
                "engine": {"max_model_len": max_model_len},
            },
        }],
    }


def serve_settings(levels: list[int], args: argparse.Namespace) -> Any:
    from benchmarks.served.load_cases import ServeLoadSettings

    return ServeLoadSettings(concurrency=tuple(levels), strategies=("ar",), max_tokens=args.max_tokens,
                             requests_per_level=args.serve_requests, temperature=1.0, bare_limit=False)


def serve_specserve(path: pathlib.Path | str, dtype: str, levels: list[int], args: argparse.Namespace,
                    out: pathlib.Path) -> list[Any]:
    """``specserve serve`` of this model in ``dtype``, serve-load's client -> its level summaries."""
    import yaml

    from benchmarks.served.serve_load import run_serve_load

    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "serve.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(path, dtype, args.threads, max(levels), args.max_model_len)))
    results = run_serve_load(config_path, serve_settings(levels, args), out, command=COMMAND)
    return list(results.summarize().summaries)


def serve_vllm(path: pathlib.Path | str, dtype: str, levels: list[int], args: argparse.Namespace,
               out: pathlib.Path) -> list[Any]:
    """vLLM's CPU build from ``args.vllm_venv`` serving this model in ``dtype`` with the same client
    -> its level summaries; none (a message) where that venv does not import vllm."""
    import asyncio

    from benchmarks.peers import vllm_peer
    from benchmarks.served.load_client import LevelPlan
    from benchmarks.served.serve_load_records import ServeLoadResults

    if args.vllm_venv is None or vllm_peer.probe_venv(args.vllm_venv / "bin" / "python") is None:
        print(f"vLLM skipped: {args.vllm_venv or '--vllm-venv (unset)'} has no python that imports vllm; make one with "
              "`python -m benchmarks.peers.vllm_peer --venv DIR --out DIR --modes plain` (needs the package index once)")
        return []

    class Server(vllm_peer.VllmServer):
        def command(self) -> list[str]:
            command = super().command()
            command[command.index("--dtype") + 1] = dtype
            return command

    out.mkdir(parents=True, exist_ok=True)
    settings = serve_settings(levels, args)
    prompts = load_prompts(vllm_peer.PROMPTS_PATH)
    results = ServeLoadResults(settings=settings.model_dump(mode="json"), environment={}, command=COMMAND,
                               levels=[], records=[])
    server = Server(args.vllm_venv, pathlib.Path(path), None, out / "server.log", settings.start_timeout_s, 4,
                    args.max_model_len)
    try:
        server.start("/")
        client = vllm_peer.VllmClient(server.url, vllm_peer.SERVED_NAME, settings, prompts)
        client.metrics = vllm_peer.SpecCounterProbe(server.url + "/metrics")
        memory = vllm_peer.ProcessTreeMemory(server.process.pid if server.process else None, "vllm")
        for concurrency in levels:
            plan = LevelPlan(vllm_peer.mode_case("plain", 4), concurrency, settings.requests_for(concurrency))
            run, records = asyncio.run(client.run_level(plan, memory))
            results.levels.append(run)
            results.records.extend(records)
    finally:
        server.stop()
    return list(results.summarize().summaries)


SERVERS = {"specserve": serve_specserve, "vllm": serve_vllm}


@dataclass
class Served:
    """Every served round's (tokens/s, TTFT p50 s) per (server, dtype, clients)."""

    by_case: dict[tuple[str, str, int], list[tuple[float, float | None]]] = field(
        default_factory=lambda: collections.defaultdict(list))

    def add(self, server: str, dtype: str, summaries: list[Any]) -> None:
        for summary in summaries:
            self.by_case[(server, dtype, summary.concurrency)].append((summary.tokens_per_second, summary.ttft_median_s))

    def values(self, server: str, dtype: str, clients: int, what: int) -> list[float]:
        """Each round's tokens/s (``what`` 0) or TTFT p50 in seconds (1)."""
        return [v[what] for v in self.by_case.get((server, dtype, clients), []) if v[what] is not None]

    def ratios(self, dtype: str, clients: int) -> list[float]:
        """specserve's tokens/s over vLLM's, round by round (rounds where both ran)."""
        pairs = zip(self.values("specserve", dtype, clients, 0), self.values("vllm", dtype, clients, 0))
        return [ours / theirs for ours, theirs in pairs if theirs]


def served_rounds(path: pathlib.Path | str, args: argparse.Namespace, out: pathlib.Path) -> Served:
    """``args.serve_rounds`` rounds of every (dtype, server), one server at a time, the order of the
    servers and of the dtypes reversed every other round."""
    served = Served()
    for round_index in range(args.serve_rounds):
        flip = round_index % 2 == 1
        for dtype in (args.dtypes[::-1] if flip else args.dtypes):
            for server in (args.serve[::-1] if flip else args.serve):
                summaries = SERVERS[server](path, dtype, args.concurrency, args, out / f"round{round_index + 1}-{server}-{dtype}")
                served.add(server, dtype, summaries)
                for summary in summaries:
                    logger.info("served round %d, %s %s at %d clients: %.1f tok/s, TTFT p50 %s ms", round_index + 1,
                                server, dtype, summary.concurrency, summary.tokens_per_second,
                                "n/a" if summary.ttft_median_s is None else f"{1e3 * summary.ttft_median_s:.0f}")
    return served


#: The served table's row keys (as the results page shows them: underscores read as spaces).
SERVED_KEYS = {"specserve": "specserve_tok/s", "vllm": "vLLM_tok/s", "specserve_ttft": "specserve_TTFT_p50_ms",
               "vllm_ttft": "vLLM_TTFT_p50_ms", "engine": "engine_alone_tok/s",
               "fraction": "engine_fraction_of_the_bandwidth_limit", "bandwidth": "bandwidth_GB/s"}


def served_rows(served: Served, samples: Any, dtypes: list[str], levels: list[int], weight_bytes: dict[str, int],
                bandwidth: float) -> list[dict[str, Any]]:
    """One row per (dtype, clients): both servers' medians over rounds, the ratio (median of each
    round's), the engine alone's tokens/s and its forward's fraction of the bandwidth limit."""
    from benchmarks.reports.store import rounds

    def figure(values: list[float], scale: float = 1.0, digits: int = 1) -> Any:
        if not values:
            return None
        figures = rounds([scale * v for v in values], digits)
        return figures if digits else {k: [int(x) for x in v] if k == "rounds" else int(v) for k, v in figures.items()}

    rows = []
    for dtype in dtypes:
        for clients in levels:
            forward = samples.median(dtype, clients, "forward_s")
            rows.append({
                "dtype": dtype, "clients": clients,
                SERVED_KEYS["specserve"]: figure(served.values("specserve", dtype, clients, 0)),
                SERVED_KEYS["vllm"]: figure(served.values("vllm", dtype, clients, 0)),
                "x_vllm": figure(served.ratios(dtype, clients), digits=2),
                SERVED_KEYS["specserve_ttft"]: figure(served.values("specserve", dtype, clients, 1), 1e3, 0),
                SERVED_KEYS["vllm_ttft"]: figure(served.values("vllm", dtype, clients, 1), 1e3, 0),
                SERVED_KEYS["engine"]: figure([s.tokens_per_s for s in samples.by_case[(dtype, clients)]]),
                SERVED_KEYS["fraction"]: None if forward is None else round(weight_bytes[dtype] / forward / bandwidth, 2),
                SERVED_KEYS["bandwidth"]: round(bandwidth / 1e9, 1),
            })
    return rows


def served_table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown lines of the served section (medians over rounds)."""
    def text(value: Any, digits: int = 1) -> str:
        from benchmarks.reports.store import figure
        number = figure(value)
        return "n/a" if number is None else f"{number:.{digits}f}"

    lines = ["| dtype | clients | specserve tok/s | vLLM tok/s | specserve / vLLM | TTFT p50 specserve (ms) | "
             "TTFT p50 vLLM (ms) | engine alone tok/s | engine: fraction of the bandwidth limit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        key = {name: row[column] for name, column in SERVED_KEYS.items()}
        fraction = key["fraction"]
        lines.append(f"| {row['dtype']} | {row['clients']} | {text(key['specserve'])} | {text(key['vllm'])} | "
                     f"{text(row['x_vllm'], 2)} | {text(key['specserve_ttft'], 0)} | {text(key['vllm_ttft'], 0)} | "
                     f"{text(key['engine'])} | {'n/a' if fraction is None else f'{100 * fraction:.0f}%'} |")
    return lines
