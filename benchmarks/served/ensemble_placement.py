"""The plain ensemble against the speculative ensemble's proposers on one served placement, in
interleaved rounds (not a test).

One server (``--config``: a Ray Serve YAML, e.g. ``deploy/simulated-gpu.yaml`` for members on
devices of their own, ``deploy/simulated-gpu-shared.yaml`` for the two members on one shared
device, ``deploy/default.yaml`` for this machine's CPU), then ``--rounds`` rounds; each round runs
every case at ``--concurrency`` closed-loop clients, ``--requests`` completions of ``--max-tokens``
tokens each (temperature 1, EOS ignored, the serve-load benchmark's prompts and request bodies:
``benchmarks.served.serve_load``), in the same order. Prints each case's tokens/s per round and the
median over rounds of its ratio to the plain ensemble of the same round, with its block
efficiency from the responses' ``speculation`` stats.

    python -m benchmarks.served.ensemble_placement --config deploy/simulated-gpu.yaml --concurrency 1 \\
        --se-proposers draft --rounds 3 --requests 6

``--se-draft-gamma 4,5,auto`` compares a model proposer's blocks in the same rounds.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import sys
import tempfile
from typing import Any

from benchmarks.served.prompts import PROMPTS_PATH, load_prompts

from benchmarks.served.load_cases import LoadCase, ServeLoadSettings, serve_load_cases
from benchmarks.served.load_client import LevelPlan, LoadClient
from benchmarks.served.serve_load import _api_key
from benchmarks.served.server_process import MemoryProbe, ServerProcess

logger = logging.getLogger(__name__)


def _gamma(text: str) -> int | str:
    return text if text == "auto" else int(text)


def _gammas(text: str) -> tuple[int | str, ...]:
    return tuple(_gamma(part) for part in text.split(",") if part)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="deploy/simulated-gpu.yaml", help="Ray Serve YAML of the placement.")
    parser.add_argument("--concurrency", type=int, default=1, help="Closed-loop clients.")
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds (the ratio is their median).")
    parser.add_argument("--requests", type=int, default=6, help="Completions per case per round.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--se-proposers", default="draft",
                        help="Comma-separated se proposers: alternate and/or model names.")
    parser.add_argument("--se-gamma", type=_gammas, default=(1,),
                        help="The alternate proposer's second member's gamma, or auto (gamma auto); comma-separated: "
                        "one case per value, interleaved.")
    parser.add_argument("--se-draft-gamma", type=_gammas, default=(4,),
                        help="A model proposer's block, or auto; comma-separated: one case per block, interleaved.")
    parser.add_argument("--gamma-max", type=int, default=8, help="Largest block of gamma auto.")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="Directory of the server log (a temp dir).")
    parser.add_argument("--record", default=None, metavar="CASE", help="Write the table into the results store.")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def placement_cases(settings: ServeLoadSettings, roles: dict[str, str], draft_gammas: tuple[int | str, ...],
                    alternate_gammas: tuple[int | str, ...] | None = None) -> list[LoadCase]:
    """The plain ensemble, then the se cases (``benchmarks.served.serve_load.serve_load_cases``) once per
    block of a model proposer in ``draft_gammas`` and once per gamma of the alternate proposer in
    ``alternate_gammas`` (default: ``settings.se_gamma``)."""
    cases: list[LoadCase] = []
    for alternate in alternate_gammas or (settings.se_gamma,):
        for gamma in draft_gammas:
            update = {"se_draft_gamma": gamma, "se_gamma": alternate}
            for case in serve_load_cases(settings.model_copy(update=update), roles):
                if case.label not in {known.label for known in cases}:
                    cases.append(case)
    return cases


def main(argv: list[str] | None = None) -> int:
    from cluster.config import load_app_args, read_serve_config, select_application

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    settings = ServeLoadSettings(
        concurrency=(args.concurrency,), strategies=("ensemble", "se"), max_tokens=args.max_tokens,
        requests_per_level=args.requests, bare_limit=False, se_gamma=args.se_gamma[0], gamma_max=args.gamma_max,
        se_proposers=tuple(p for p in args.se_proposers.split(",") if p), se_draft_gamma=args.se_draft_gamma[0],
    )
    config = pathlib.Path(args.config)
    application = select_application(read_serve_config(config), None, str(config))
    cases = placement_cases(settings, load_app_args(config).freeze().roles, args.se_draft_gamma, args.se_gamma)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="ensemble-placement-"))
    out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(config, out / "server.log", settings.start_timeout_s)
    route = (application.get("route_prefix") or "/").rstrip("/")
    rates: dict[str, list[float]] = {case.label: [] for case in cases}
    efficiency: dict[str, list[float]] = {case.label: [] for case in cases}
    try:
        server.start(application.get("route_prefix") or "/")
        client = LoadClient(server.url + route, application.get("name") or "specserve", settings,
                            load_prompts(PROMPTS_PATH, None), _api_key(application))
        memory = MemoryProbe(server.process.pid if server.process else None, settings.worker_class)
        for round_index in range(args.rounds):
            for case in cases:
                summary = client.measure_level(LevelPlan(case, args.concurrency, args.requests), memory)
                rates[case.label].append(summary.tokens_per_second)
                efficiency[case.label].append(summary.block_efficiency or 0.0)
                logger.info("round %d %s: %.2f tok/s (%d ok, %d failed), block efficiency %.2f", round_index,
                            case.label, summary.tokens_per_second, summary.completed, summary.failed,
                            summary.block_efficiency or 0.0)
    finally:
        server.stop()
    baseline = cases[0].label
    print(f"\n{args.config}, {args.concurrency} client(s), {args.rounds} rounds x {args.requests} requests of "
          f"{args.max_tokens} tokens")
    print("| case | tok/s (median) | ratio to the ensemble (median of rounds) | block efficiency |")
    print("|---|---|---|---|")
    rows = []
    for case in cases:
        ratios = [rate / base for rate, base in zip(rates[case.label], rates[baseline]) if base > 0]
        rows.append({"case": case.label, "tok/s": round(statistics.median(rates[case.label]), 2),
                     "x the plain ensemble": f"{statistics.median(ratios):.2f}x",
                     "block_efficiency": round(statistics.median(efficiency[case.label]), 2)})
        print(f"| {case.label} | {statistics.median(rates[case.label]):.2f} | {statistics.median(ratios):.2f}x | "
              f"{statistics.median(efficiency[case.label]):.2f} |")
    if args.record:
        print(f"recorded {record(args, rows)}")
    return 0


def record(args: argparse.Namespace, rows: list[dict[str, Any]]) -> pathlib.Path:
    """Write the table into the results store (``--record CASE``) and regenerate the page."""
    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    words, skip = [], False
    for word in args.argv:  # the command without --out / --record (places of this machine)
        if skip or word.split("=", 1)[0] in ("--out", "--record"):
            skip = not skip and "=" not in word
            continue
        words.append(word)
    notes = (f"Medians of {args.rounds} interleaved rounds, {args.requests} requests of {args.max_tokens} tokens a case a "
             "round, T = 1, members [target, partner] 0.5 / 0.5; g1: gammas [1, 1]; gauto: gamma auto.")
    clients = "one client" if args.concurrency == 1 else f"{args.concurrency} clients"
    return update(make_record(args.record, f"Ensembles served on {args.config}: the plain ensemble against se, {clients}",
                              " ".join(["python -m benchmarks.served.ensemble_placement", *words]), rows, notes=notes))


if __name__ == "__main__":
    raise SystemExit(main())
