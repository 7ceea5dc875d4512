"""Where a served step's time goes at a real vocabulary (not a test): the Qwen2.5-shaped target and
draft of :mod:`benchmarks.peers.real_shape` (V = 151,936, random weights, nothing downloaded), the
engine alone (no Ray, no HTTP: :class:`benchmarks.served.runners.LocalRunner`), ``--clients``
closed-loop clients, ``sd`` with block verification at gamma 4, one torch thread.

The worker's own functions are timed in place (each wrapped for the run): the forwards (target and
draft), the row work (logits -> probability rows: shared vocabulary, penalties, temperature /
top-k / top-p), the draws, the verification calls and the copies of logits to the host
(``transport``; nothing moves in one process on this CPU, so it reads ~0). Shares are of the sum of
the workers' step calls (``Step.run``), which is the step's time.

    python -m benchmarks.peers.step_split
    python -m benchmarks.peers.step_split --top-p 0.9 --label "after, top_p 0.9"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import logging
import pathlib
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from actors.request_schema import GenerationRequest, SamplingParams
from benchmarks.peers.real_shape import GAMMA, VOCAB, build_checkpoints
from benchmarks.served.runners import LocalRunner
from cluster.config import parse_app_args

COMMAND = "python -m benchmarks.peers.step_split"
#: (part of the step, module, attribute) of every function timed in place; a part sums its functions.
TIMED: tuple[tuple[str, str, str], ...] = (
    ("step", "actors.worker.step", "Step.run"),
    ("forward", "actors.model.backends", "SlotBackend.forward"),
    ("rows", "actors.worker.step", "batch_rows"),
    ("rows", "actors.worker.tasks", "session_rows"),
    ("rows", "actors.worker.rows", "session_rows"),
    ("draws", "actors.worker.step", "categorical_together"),
    ("verification", "actors.worker.verify_tasks", "verify_blocks"),
    ("verification", "actors.worker.verify_tasks", "draft_rows_together"),
    ("verification", "actors.worker.verify_tasks", "verify_rows"),
    ("transport", "actors.worker.step", "to_host"),
)
PARTS = ("forward", "rows", "draws", "verification", "transport")


def time_in_place(seconds: dict[str, float]) -> Callable[[], None]:
    """Wrap every function of :data:`TIMED` that exists to add its time to ``seconds[part]``
    (outermost call only, so a nested timed call is not counted twice); returns what restores them."""
    restores: list[Callable[[], None]] = []
    depth = collections.Counter()

    for part, module_name, attribute in TIMED:
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for step in path:
            owner = getattr(owner, step)
        original = getattr(owner, name, None)
        if original is None:
            continue

        def timed(*args: Any, _original: Callable[..., Any] = original, _part: str = part, **kwargs: Any) -> Any:
            depth[_part] += 1
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                depth[_part] -= 1
                if depth[_part] == 0:
                    seconds[_part] += time.perf_counter() - started

        setattr(owner, name, timed)
        restores.append(lambda owner=owner, name=name, original=original: setattr(owner, name, original))
    return lambda: [restore() for restore in reversed(restores)]


def group_args(paths: dict[str, pathlib.Path], clients: int, precision: str) -> Any:
    return parse_app_args({
        "models": {"target": {"path": str(paths["target"]), "role": "target", "dtype": "float32"},
                   "draft": {"path": str(paths["draft"]), "role": "draft", "dtype": "float32"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": GAMMA},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": clients},
        "engine": {"kv_cache_memory": 2**30, "max_model_len": 2048, "goodput_gamma": False,
                   "sampling_precision": precision},
    })


async def run_clients(runner: LocalRunner, args: argparse.Namespace) -> int:
    """``args.requests`` requests from ``args.clients`` closed-loop clients -> tokens generated."""
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 4000, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.requests)]
    counter = iter(range(args.requests))

    async def client() -> int:
        tokens = 0
        for i in counter:
            request = GenerationRequest(
                request_id=f"step-split-{i}", prompt_ids=prompts[i],
                sampling=SamplingParams(temperature=1.0, top_p=args.top_p, max_tokens=args.max_tokens, seed=i,
                                        ignore_eos=True),
                speculation={"strategy": "sd", "method": "block", "gamma": GAMMA})
            async for chunk in runner.coordinator.generate(request):
                if chunk.error:
                    raise RuntimeError(f"request {i} failed: {chunk.error}")
                tokens += len(chunk.token_ids)
        return tokens

    return sum(await asyncio.gather(*(client() for _ in range(args.clients))))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One timed run -> its row: tokens/s and each part's share of the step time."""
    with tempfile.TemporaryDirectory(prefix="step-split-") as root:
        paths = build_checkpoints(pathlib.Path(root), every_id=True)  # rows over all V ids
        runner = LocalRunner(group_args(paths, args.clients, args.precision), temperature=1.0)
        try:
            seconds: dict[str, float] = collections.defaultdict(float)
            restore = time_in_place(seconds)
            try:
                started = time.perf_counter()
                tokens = runner.loop.run_until_complete(run_clients(runner, args))
                wall = time.perf_counter() - started
            finally:
                restore()
        finally:
            runner.close()
    step = seconds["step"]
    row = {"case": args.label}  # (a label naming a top_p other than 1)
    share = {part: round(100 * seconds[part] / step, 1) for part in PARTS}
    row |= {"forward": share["forward"], "rows": round(share["rows"] + share["draws"], 1),
            "verification": share["verification"], "transport": share["transport"],
            "rows + verification": round(share["rows"] + share["draws"] + share["verification"], 1)}
    print(" | ".join(f"{part}: {value}" for part, value in share.items()), "(% of the step time; rows below count the draws)")
    print(f"{tokens / wall:.2f} tok/s, {step:.2f} s in steps")
    return row


def record(case: str, row: dict[str, Any], argv: list[str], clients: int) -> pathlib.Path:
    """Put ``row`` into the results store's ``case`` (replacing the row of the same label)."""
    from benchmarks.reports.store import load_records, make_record
    from benchmarks.reports.tables import update

    previous = next((r for r in load_records() if r["case"] == case), None)
    rows = [r for r in (previous or {}).get("rows", []) if r["case"] != row["case"]] + [row]
    command = f"{COMMAND} " + " ".join(shlex.quote(word) for word in argv)
    return update(make_record(
        case, f"Step split, V = {VOCAB:,}, {clients} clients, sd gamma {GAMMA}, %", command, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--top-p", type=float, default=1.0, help="Every request's top_p (< 1 sorts each row).")
    parser.add_argument("--precision", choices=("auto", "float32", "float64"), default="auto",
                        help="engine.sampling_precision.")
    parser.add_argument("--label", default="today", help="This run's row label in the record.")
    parser.add_argument("--record", default=None, metavar="CASE", help="Also write the row into the results store.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    row = measure(args)
    print(" | ".join(f"{key}: {value}" for key, value in row.items()), "(% of the step time)")
    if args.record:
        print(f"recorded {record(args.record, row, sys.argv[1:] if argv is None else argv, args.clients)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
