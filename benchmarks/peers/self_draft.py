"""A real-size model drafting for itself (not a test): ``sd`` with a weight-only quantized copy of the
target as its draft against ``ar``, served by specserve, in interleaved rounds.

One server (``specserve serve``) holding the model of ``--shape`` (a random-weight Llama built as
:mod:`benchmarks.peers.real_size` builds it; ``--model PATH`` for a checkpoint of yours) as the target and
``{path: the same, role: draft, quantization: --quantization}`` as its draft (``placement: auto``: on
CPU the copy shares its target's worker and is built from its loaded weights,
:mod:`actors.model.quantized`), in ``--dtype``; then ``--rounds`` rounds, each running ``ar`` and
``sd`` (block verification) at every ``--gamma`` with ``--concurrency`` closed-loop clients,
``--requests`` completions of ``--max-tokens`` tokens each (temperature 1, EOS ignored, serve-load's
prompts and client), in the same order. Prints each case's median tokens/s, the median over rounds
of its ratio to ``ar`` of the same round and its block efficiency (tokens per target forward, from
the responses' ``speculation`` stats), then where a generated token's time goes (ms per token,
summed over the rounds from the same stats: the draft's forwards, the target's forwards, the
verification, and the rest: rows, scheduling, calls and output). Random weights give near-uniform
rows, which a quantized copy matches closely: its acceptance there is optimistic; the costs are real.

    python -m benchmarks.peers.self_draft --shape 279m --dtype bfloat16 --quantization int4 --gamma 4 --rounds 5
    python -m benchmarks.peers.self_draft --quantization w8a8 --gamma 3,4 --rounds 4 --requests 2
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import statistics
import tempfile
from typing import Any

from actors.model.quantized import QUANTIZATIONS
from benchmarks.peers import real_size_served
from benchmarks.peers.real_size import SHAPES, build_checkpoint
from benchmarks.served.load_cases import LoadCase, ServeLoadSettings
from benchmarks.served.load_client import LevelPlan, LoadClient
from benchmarks.served.prompts import PROMPTS_PATH, load_prompts
from benchmarks.served.serve_load_records import RequestRecord, summarize_level
from benchmarks.served.server_process import MemoryProbe, ServerProcess

logger = logging.getLogger("benchmarks.peers.self_draft")

COMMAND = "python -m benchmarks.peers.self_draft"


def _gammas(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def _quantizations(text: str) -> tuple[str, ...]:
    names = tuple(part for part in text.split(",") if part)
    unknown = [name for name in names if name not in QUANTIZATIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--quantization: {unknown or text!r}; expected some of {list(QUANTIZATIONS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", choices=sorted(SHAPES), default="279m", help="Build this random Llama (default 279m).")
    source.add_argument("--model", default=None, help="A checkpoint directory of yours instead of --shape.")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", type=_quantizations, default=("int4",),
                        help=f"The draft copy's weights, one of {list(QUANTIZATIONS)}; comma-separated: one server run each.")
    parser.add_argument("--gamma", type=_gammas, default=(4,), help="sd's block; comma-separated: one case each.")
    parser.add_argument("--concurrency", type=int, default=1, help="Closed-loop clients.")
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds (ratios are their median).")
    parser.add_argument("--requests", type=int, default=3, help="Completions per case per round.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", default="auto", help="resources.torch_threads (default auto).")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="Directory of the config and the server log.")
    parser.add_argument("--record", default=None, metavar="CASE", help="Write the table into the results store.")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    args.quantizations, args.quantization = args.quantization, args.quantization[0]
    return args


def serve_config(path: pathlib.Path | str, args: argparse.Namespace) -> dict[str, Any]:
    """A Ray Serve config: the model as target (:func:`benchmarks.peers.real_size_served.serve_config`),
    its quantized copy as the draft (sharing its worker)."""
    threads = int(args.threads) if str(args.threads).isdigit() else args.threads
    config = real_size_served.serve_config(path, args.dtype, threads, args.concurrency, args.max_model_len)
    app_args = config["applications"][0]["args"]
    app_args["models"]["draft"] = {"path": str(path), "role": "draft", "dtype": args.dtype,
                                   "quantization": args.quantization}
    app_args["defaults"] = {"strategy": "sd", "method": "block", "gamma": args.gamma[0]}
    app_args["resources"]["placement"] = "auto"
    return config


def cases(gammas: tuple[int, ...]) -> list[LoadCase]:
    """``ar``, then ``sd`` with block verification at each block length."""
    return [LoadCase("ar", "ar", {"strategy": "ar"})] + [
        LoadCase("sd", f"sd/block/g{gamma}", {"strategy": "sd", "method": "block", "gamma": gamma}) for gamma in gammas]


def run_rounds(path: pathlib.Path | str, args: argparse.Namespace, out: pathlib.Path) -> dict[str, dict[str, list[float]]]:
    """One server, ``args.rounds`` interleaved rounds -> per case label its tokens/s and block
    efficiency per round."""
    import yaml

    settings = ServeLoadSettings(concurrency=(args.concurrency,), strategies=("ar", "sd"), max_tokens=args.max_tokens,
                                 requests_per_level=args.requests, temperature=1.0, bare_limit=False)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "serve.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(path, args)))
    server = ServerProcess(config_path, out / "server.log", settings.start_timeout_s)
    measured = {case.label: {"tokens_per_s": [], "block_efficiency": [], **{part: [] for part in SPLIT_PARTS}}
                for case in cases(args.gamma)}
    try:
        server.start("/")
        client = LoadClient(server.url, "specserve", settings, load_prompts(PROMPTS_PATH, None), None)
        memory = MemoryProbe(server.process.pid if server.process else None, settings.worker_class)
        for round_index in range(args.rounds):
            for case in cases(args.gamma):
                run, records = asyncio.run(client.run_level(LevelPlan(case, args.concurrency, args.requests), memory))
                summary = summarize_level(run, records, args.max_tokens)
                for part, seconds in split_seconds(records).items():
                    measured[case.label][part].append(seconds)
                measured[case.label]["tokens_per_s"].append(summary.tokens_per_second)
                measured[case.label]["block_efficiency"].append(summary.block_efficiency or 1.0)
                logger.info("round %d %s: %.2f tok/s (%d ok, %d failed), block efficiency %.2f", round_index, case.label,
                            summary.tokens_per_second, summary.completed, summary.failed, summary.block_efficiency or 1.0)
    finally:
        server.stop()
    return measured


#: The parts of a token's time (:func:`split_seconds`): the responses' stats, and their tokens.
SPLIT_PARTS = ("draft_s", "target_s", "verify_s", "coordination_s", "tokens")
#: The table's column of each part (ms per generated token).
SPLIT_COLUMNS = {"draft_s": "draft ms", "target_s": "target ms", "verify_s": "verify ms", "coordination_s": "rest ms"}


def split_seconds(records: list[RequestRecord]) -> dict[str, float]:
    """Seconds the completed requests spent in each part of :data:`SPLIT_PARTS` (their stats'
    ``time_*_s``; the coordination part is the rest of each request's time), and their tokens."""
    done = [record for record in records if record.ok and record.times_s]
    totals = {part: sum(record.times_s.get(part, 0.0) for record in done) for part in SPLIT_PARTS[:-1]}
    return totals | {"tokens": float(sum(record.completion_tokens for record in done))}


def split_rows(measured: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Per case: ms per generated token in each part, over every round."""
    table = []
    for label, values in measured.items():
        tokens = sum(values["tokens"])
        if tokens:
            table.append({"case": label, **{SPLIT_COLUMNS[part]: round(1e3 * sum(values[part]) / tokens, 1)
                                            for part in SPLIT_PARTS[:-1]}})
    return table


def rows(measured: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per case: its median tokens/s, the median of its per-round ratio to ``ar``, its block efficiency."""
    baseline = measured["ar"]["tokens_per_s"]
    table = []
    for label, values in measured.items():
        ratios = [rate / base for rate, base in zip(values["tokens_per_s"], baseline) if base > 0]
        case = label if label == "ar" else f"{label.replace('sd/block/', 'sd ')}, {args.quantization}"
        table.append({"case": case,
                      "tok/s": round(statistics.median(values["tokens_per_s"]), 2),
                      "x ar": f"{statistics.median(ratios):.2f}x",
                      "block_efficiency": round(statistics.median(values["block_efficiency"]), 2)})
    return table


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="self-draft-"))
    out.mkdir(parents=True, exist_ok=True)
    table = []
    with tempfile.TemporaryDirectory(prefix="self-draft-model-") as root:
        path = args.model or build_checkpoint(SHAPES[args.shape], pathlib.Path(root), f"llama-{args.shape}")
        for quantization in args.quantizations:  # one server each, its own ar
            run_args = argparse.Namespace(**(vars(args) | {"quantization": quantization}))
            run = run_rounds(path, run_args, out / quantization)
            run_table = rows(run, run_args)
            split = {row.pop("case"): row for row in split_rows(run)}
            for label, row in zip(run, run_table):  # the same order
                row.update(split.get(label, {}))
                if label == "ar" and len(args.quantizations) > 1:
                    row["case"] = f"ar ({quantization})"
            table += run_table
    print(f"\n{args.shape if args.model is None else args.model}, {args.dtype}, {args.concurrency} client(s), "
          f"{args.rounds} rounds x {args.requests} requests of {args.max_tokens} tokens")
    print("| case | tok/s (median) | x ar (median of rounds) | block efficiency |")
    print("|---|---|---|---|")
    for row in table:
        print(f"| {row['case']} | {row['tok/s']:.2f} | {row['x ar']} | {row['block_efficiency']:.2f} |")
    print("\n| case | draft ms/token | target ms/token | verify ms/token | rest ms/token |")
    print("|---|---|---|---|---|")
    for row in table:
        print(f"| {row['case']} | " + " | ".join(str(row.get(column, "-")) for column in SPLIT_COLUMNS.values()) + " |")
    if args.record:
        for row in table:  # verification (under a millisecond a token here) goes into the rest
            row["rest ms"] = round(row.get("rest ms", 0.0) + row.pop("verify ms", 0.0), 1)
        print(f"recorded {record(args, table)}")
    return 0


def public_command(args: argparse.Namespace) -> str:
    """The command as a record shows it, without ``--out`` and ``--record``."""
    words, skip = [], False
    for word in args.argv or []:
        if skip:
            skip = False
            continue
        if word.split("=", 1)[0] in ("--out", "--record"):
            skip = "=" not in word
            continue
        words.append(word)
    return " ".join([COMMAND, *words])


def record(args: argparse.Namespace, table: list[dict[str, Any]]) -> pathlib.Path:
    """Write the table into the results store (``--record CASE``) and regenerate the page."""
    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    label = args.shape if args.model is None else pathlib.Path(args.model).name
    clients = "one client" if args.concurrency == 1 else f"{args.concurrency} clients"
    copies = " / ".join(args.quantizations)
    notes = (f"One worker; {args.max_tokens} tokens, T = 1, {args.requests} requests a case, {args.rounds} interleaved rounds; "
             "x ar: over its run's ar; ms: per token. Random weights: acceptance is optimistic.")
    title = f"{label} random Llama: sd (block) with its {copies} copy, served, {clients}"
    return update(make_record(args.record, title, public_command(args), table, notes=notes, section="Peers"))


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
