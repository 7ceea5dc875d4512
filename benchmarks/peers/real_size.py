"""A real-size model (not a test): the engine alone in float32 and bfloat16 against this machine's
memory-bandwidth limit, and optionally served by specserve and by vLLM's CPU build.

A decode forward at a few rows reads every weight once; its floor is ``weight bytes / memory
bandwidth``. This measures both in one run, because a shared host's bandwidth moves with its
neighbours (compare dtypes within a run, never across runs):

1. **The checkpoint.** ``--shape`` builds a random-weight Llama locally from a named shape
   (:data:`SHAPES`; weights drawn from N(0, 0.02) by transformers' own initialization, seeded,
   saved with ``save_pretrained`` next to the embedded tokenizer; nothing is downloaded) in a
   temporary directory; ``--model PATH`` takes a checkpoint of yours instead (any model the
   engine serves; its tokenizer should be next to it). Random weights make acceptance rates
   meaningless; costs are what this measures.
2. **The bandwidth:** a torch sum over a 1 GiB float32 tensor with the engine's threads, the
   fastest of a few passes, measured again each round; the run's best is the limit.
3. **The engine alone** (no Ray, no HTTP: the production Coordinator and ModelWorker in this
   process, :class:`benchmarks.served.runners.LocalRunner`): ``ar``, ``--max-tokens`` streamed tokens
   at temperature 1 (EOS ignored), ``--requests-per-client`` requests per client at each of
   ``--concurrency`` levels, one engine per dtype loaded side by side, the cases interleaved in
   ``--rounds`` rounds (:func:`benchmarks.served.engine_load.timed_run`, which also times the
   forwards). Per dtype and level it prints tokens/s, the
   time to the first token, the decode forward's median, and that forward's fraction of the
   bandwidth limit: (weight bytes read per forward / forward time) / bandwidth. Medians over
   rounds; the bfloat16 / float32 speed ratio is the median of each round's own ratio.
4. **Served** (``--serve specserve,vllm``, optional): ``specserve bench --mode serve-load``'s
   client against ``specserve serve`` with a config holding only this model (``ar``), then the
   same client against vLLM's CPU build from ``--vllm-venv`` (started as
   :mod:`benchmarks.peers.vllm_peer` starts it, with ``--dtype`` of the case); a venv that does not
   import vllm is reported and skipped (make one with ``python -m benchmarks.peers.vllm_peer --venv``;
   :mod:`benchmarks.peers.real_size_served`).
   One server at a time, in ``--serve-rounds`` rounds whose order of servers and dtypes is reversed
   every other round; per dtype and level: each server's median tokens/s and TTFT p50, the median
   of each round's specserve / vLLM ratio, and the engine alone's tokens/s and fraction of the
   limit. ``--record CASE`` writes that table into the results store and regenerates docs/results.md.

    python -m benchmarks.peers.real_size --shape 279m
    python -m benchmarks.peers.real_size --shape 1b --dtypes bfloat16 --concurrency 1,4
    python -m benchmarks.peers.real_size --model /models/my-llama --threads 8 --rounds 5
    python -m benchmarks.peers.real_size --shape 279m --serve specserve,vllm --vllm-venv /tmp/vllm-peer-venv --out /tmp/rs \
        --concurrency 1,4 --record real-size-279m
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.served.engine_load import timed_run
from benchmarks.peers.real_size_served import served_rounds, served_rows, served_table
from benchmarks.served.prompts import load_prompts
from actors.worker.cpu_binding import torch_thread_count
from cluster.config import parse_app_args

logger = logging.getLogger("benchmarks.peers.real_size")

COMMAND = "python -m benchmarks.peers.real_size"
#: Named Llama shapes (transformers ``LlamaConfig`` fields). ``279m``: 279.0M parameters;
#: ``1b``: TinyLlama-1.1B's shape (1.10B parameters; vocabulary 32,000 rows over the embedded
#: tokenizer's 4,096 ids, as a real model pads past its tokenizer).
SHAPES: dict[str, dict[str, int]] = {
    "279m": dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=4096),
    "1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
}
DTYPES = ("float32", "bfloat16")
BANDWIDTH_BYTES = 2**30  # the summed tensor: 1 GiB, far past the caches


def build_checkpoint(shape: dict[str, int], root: pathlib.Path, name: str, seed: int = 0) -> pathlib.Path:
    """A random-weight Llama of ``shape`` saved under ``root / name`` (bfloat16 on disk: the
    engine loads it in the dtype asked), with the embedded tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("target"))
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError(f"shape vocab_size {shape['vocab_size']} is below the tokenizer's {len(tokenizer)} ids")
    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    path = root / name
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def forward_weight_bytes(path: pathlib.Path | str, dtype: str) -> tuple[int, int]:
    """(parameters, bytes a decode forward reads in ``dtype``) of the checkpoint at ``path``: every
    weight once, except the input embedding table, of which a forward reads a row a token (a head
    tied to it is read whole). Counted on the meta device: nothing is loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=os.path.isdir(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    parameters = list({id(p): p for p in model.parameters()}.values())
    count = sum(p.numel() for p in parameters)
    read = sum(p.numel() * p.element_size() for p in parameters)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:
        read -= embedding.weight.numel() * embedding.weight.element_size()
    return count, read


def measure_bandwidth(threads: int, passes: int = 5, nbytes: int | None = None) -> float:
    """Bytes per second a torch sum over ``nbytes`` (:data:`BANDWIDTH_BYTES`) of float32 streams
    with ``threads`` threads: the fastest of ``passes`` (a shared host's neighbours only ever slow it)."""
    nbytes = nbytes or BANDWIDTH_BYTES
    torch.set_num_threads(threads)
    values = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        values.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def group_args(path: pathlib.Path | str, dtype: str, threads: int | str, max_concurrency: int, max_model_len: int) -> Any:
    """The config of one target serving ``ar`` in ``dtype`` with ``threads`` torch threads."""
    return parse_app_args({
        "models": {"target": {"path": str(path), "role": "target", "dtype": dtype}},
        "defaults": {"strategy": "ar"},
        "resources": {"torch_threads": threads},
        "limits": {"max_concurrent_requests": max(max_concurrency, 1)},
        "engine": {"max_model_len": max_model_len},
    })


@dataclass
class Sample:
    """One measured level: tokens/s, the median time to a first token, the decode forwards' median."""

    tokens_per_s: float
    ttft_s: float
    forward_s: float | None


@dataclass
class Samples:
    """Every round's :class:`Sample` per (dtype, concurrency)."""

    by_case: dict[tuple[str, int], list[Sample]] = field(default_factory=lambda: collections.defaultdict(list))

    def median(self, dtype: str, concurrency: int, what: str) -> float | None:
        values = [getattr(s, what) for s in self.by_case[(dtype, concurrency)] if getattr(s, what) is not None]
        return statistics.median(values) if values else None

    def ratio(self, concurrency: int, what: str = "tokens_per_s") -> float | None:
        """The median over rounds of bfloat16's ``what`` over float32's in the same round."""
        pairs = zip(self.by_case[("bfloat16", concurrency)], self.by_case[("float32", concurrency)])
        ratios = [getattr(b, what) / getattr(f, what) for b, f in pairs if getattr(b, what) and getattr(f, what)]
        return statistics.median(ratios) if ratios else None


def run_level(runner: Any, prompts: list[str], concurrency: int, requests: int, max_tokens: int) -> Sample:
    """One closed-loop level on ``runner`` (``ar``) -> its :class:`Sample`."""
    args = types.SimpleNamespace(requests=requests, concurrency=concurrency, max_tokens=max_tokens)
    run = timed_run(runner, prompts, {"strategy": "ar"}, args)
    decode = [forward[2] for (_, kind), forwards in run.forwards.items() if kind == "short" for forward in forwards]
    return Sample(run.tokens / run.wall_s, statistics.median(run.first_token_s), statistics.median(decode) if decode else None)


def engine_rounds(path: pathlib.Path | str, dtypes: list[str], levels: list[int], args: argparse.Namespace,
                  bandwidths: list[float]) -> Samples:
    """Load one engine per dtype, then ``args.rounds`` rounds of every (dtype, level), interleaved;
    the bandwidth measured before each round is appended to ``bandwidths``."""
    from benchmarks.served.runners import LocalRunner

    prompts = [prompt.text for prompt in load_prompts()]
    runners = {}
    try:
        for dtype in dtypes:
            runners[dtype] = LocalRunner(group_args(path, dtype, args.threads, max(levels), args.max_model_len),
                                         temperature=1.0)
            run_level(runners[dtype], prompts, 1, 1, 4)  # warm-up: first forwards, allocator
        samples = Samples()
        for round_index in range(args.rounds):
            bandwidths.append(measure_bandwidth(torch_thread_count(args.threads)))
            for concurrency in levels:
                for dtype in (dtypes if round_index % 2 == 0 else dtypes[::-1]):
                    sample = run_level(runners[dtype], prompts, concurrency, concurrency * args.requests_per_client,
                                       args.max_tokens)
                    samples.by_case[(dtype, concurrency)].append(sample)
                    logger.info("round %d, %s at %d clients: %.1f tok/s, forward %s ms", round_index + 1, dtype,
                                concurrency, sample.tokens_per_s,
                                "n/a" if sample.forward_s is None else f"{1e3 * sample.forward_s:.1f}")
        return samples
    finally:
        for runner in runners.values():
            runner.close()


def engine_table(samples: Samples, dtypes: list[str], levels: list[int], weight_bytes: dict[str, int],
                 bandwidth: float) -> list[str]:
    """The markdown lines of the engine section."""
    lines = ["| dtype | clients | tok/s | TTFT p50 (ms) | decode forward (ms) | weights read / forward | "
             "GB/s read | fraction of the bandwidth limit | limit at 1 client (tok/s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype in dtypes:
        for concurrency in levels:
            forward = samples.median(dtype, concurrency, "forward_s")
            read = weight_bytes[dtype]
            rate = None if forward is None else read / forward
            lines.append(
                f"| {dtype} | {concurrency} | {samples.median(dtype, concurrency, 'tokens_per_s'):.1f} | "
                f"{1e3 * samples.median(dtype, concurrency, 'ttft_s'):.0f} | "
                f"{'n/a' if forward is None else f'{1e3 * forward:.1f}'} | {read / 1e9:.3g} GB | "
                f"{'n/a' if rate is None else f'{rate / 1e9:.1f}'} | "
                f"{'n/a' if rate is None else f'{100 * rate / bandwidth:.0f}%'} | {bandwidth / read:.1f} |")
    if set(DTYPES) <= set(dtypes):
        lines.append("")
        for concurrency in levels:
            speed, forward = samples.ratio(concurrency), samples.ratio(concurrency, "forward_s")
            lines.append(f"bfloat16 / float32, clients {concurrency}: {speed:.2f}x tokens/s, decode forward "
                         f"{'n/a' if forward is None else f'{1 / forward:.2f}x as fast'} (medians of each round's ratio)")
    return lines


# ----------------------------------------------------------------------------- the command

def _int_list(text: str) -> list[int]:
    values = [int(value) for value in text.split(",") if value.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _threads(text: str) -> int | str:
    """``--threads``: a positive number or ``auto``."""
    if text == "auto":
        return text
    value = _int_list(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}")
    return value[0]


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [value.strip() for value in text.split(",") if value.strip()]
        unknown = [value for value in values if value not in allowed]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"expected a subset of {','.join(allowed)}, got {text!r}")
        return values
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", choices=sorted(SHAPES), default="279m", help="Build this random Llama (default 279m).")
    source.add_argument("--model", default=None, help="A checkpoint directory of yours instead of --shape.")
    parser.add_argument("--dtypes", type=_names(DTYPES), default=list(DTYPES), help="Default float32,bfloat16.")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="Clients per level (default 1,4,16).")
    parser.add_argument("--threads", type=_threads, default="auto",
                        help="torch threads of the engine and of specserve's worker (resources.torch_threads): a number "
                        "or auto, the cores the process may use (default auto).")
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved rounds (medians over them; default 3).")
    parser.add_argument("--requests-per-client", type=int, default=2, help="Requests per client per level (default 2).")
    parser.add_argument("--max-tokens", type=int, default=32, help="Tokens per request (default 32).")
    parser.add_argument("--max-model-len", type=int, default=1024, help="engine.max_model_len (default 1024).")
    parser.add_argument("--serve", type=_names(("specserve", "vllm")), default=[],
                        help="Also serve it: specserve, vllm or both (default: the engine alone only).")
    parser.add_argument("--serve-requests", type=int, default=8, help="Served requests per level (default 8).")
    parser.add_argument("--serve-rounds", type=int, default=2,
                        help="Served rounds, the servers' order reversed every other round (medians; default 2).")
    parser.add_argument("--vllm-venv", type=pathlib.Path, default=None, help="vLLM's own venv (benchmarks.peers.vllm_peer).")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="Write the report (and served results) here.")
    parser.add_argument("--record", default=None, metavar="CASE",
                        help="Also write the served table into the results store (benchmarks/results/CASE.json; needs "
                        "--serve) and regenerate docs/results.md.")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests_per_client < 1 or args.serve_rounds < 1:
        parser.error("--rounds, --serve-rounds and --requests-per-client must be >= 1")
    if args.record and not args.serve:
        parser.error("--record needs --serve (the record is the served table)")
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def _binary_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def report(path: pathlib.Path | str, label: str, args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]]]:
    """Every section of one run, as markdown lines, and the served table's rows (none without ``--serve``)."""
    levels = args.concurrency
    sizes = {dtype: forward_weight_bytes(path, dtype) for dtype in args.dtypes}
    parameters = next(iter(sizes.values()))[0]
    bandwidths: list[float] = []
    samples = engine_rounds(path, args.dtypes, levels, args, bandwidths)
    bandwidth = max(bandwidths)
    lines = [f"Model: {label}, {parameters / 1e6:.1f}M parameters; torch threads: {args.threads} "
             f"({torch_thread_count(args.threads)} here); `ar`, "
             f"{args.max_tokens} tokens a request, requests a client: {args.requests_per_client}, interleaved rounds: "
             f"{args.rounds} (medians).",
             f"Memory bandwidth (torch sum over {_binary_size(BANDWIDTH_BYTES)}, best pass): {bandwidth / 1e9:.1f} GB/s "
             f"(rounds: {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)}).", "",
             "**The engine alone**", ""]
    lines += engine_table(samples, args.dtypes, levels, {d: s[1] for d, s in sizes.items()}, bandwidth)
    if not args.serve:
        return lines, []
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="real-size-serve-"))
    served = served_rounds(path, args, out)
    rows = served_rows(served, samples, args.dtypes, levels, {d: s[1] for d, s in sizes.items()}, bandwidth)
    lines += ["", f"**Served** ({args.serve_requests} requests a level, the same streaming client, one server at a time; "
              f"medians of {args.serve_rounds} interleaved rounds; the engine alone's figures from the section above)", ""]
    return lines + served_table(rows), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("actors", "cluster", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    command = COMMAND + (" " + " ".join(args.argv) if args.argv else "")
    if args.model is not None:
        lines, rows = report(args.model, args.model, args)
    else:
        with tempfile.TemporaryDirectory(prefix="real-size-") as root:
            path = build_checkpoint(SHAPES[args.shape], pathlib.Path(root), f"llama-{args.shape}")
            lines, rows = report(path, f"random Llama {args.shape} ({', '.join(f'{k}={v}' for k, v in SHAPES[args.shape].items())})",
                           args)
    text = "\n".join([f"Command: `{command}`", ""] + lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "real-size.md").write_text(text)
    if args.record:
        print(f"recorded {record(args, public_command(args), rows)}")
    return 0


def public_command(args: argparse.Namespace) -> str:
    """The command as a record shows it: ``--vllm-venv VENV``, without ``--out`` and ``--record`` (places of
    this machine, not of the measurement)."""
    words, skip = [], False
    for word in args.argv:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in ("--out", "--record"):
            skip = "=" not in word
            continue
        if name == "--vllm-venv":
            words += [name, "VENV"]
            skip = "=" not in word
            continue
        words.append(word)
    return " ".join([COMMAND, *words])


def record(args: argparse.Namespace, command: str, rows: list[dict[str, Any]]) -> pathlib.Path:
    """Write the served table into the results store (``--record CASE``) and regenerate the page."""
    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    label = args.shape if args.model is None else pathlib.Path(args.model).name
    notes = (f"`ar`, {args.max_tokens} streamed tokens, T = 1, {args.serve_requests} requests a level, one server at a "
             f"time, the same client; medians (range) of {args.serve_rounds} interleaved rounds, x vLLM per round. "
             f"Engine alone: medians of {args.rounds} rounds; fraction: weight bytes / forward time / bandwidth (same run).")
    return update(make_record(args.record, f"A real-size model ({label}, random weights) served: specserve and vLLM's "
                              "CPU build", command, rows, notes=notes, section="Peers"))


if __name__ == "__main__":
    raise SystemExit(main())
