"""Micro-benchmark of one batched forward of an embedded model (not a test; the target by default).

Times :meth:`actors.model.backends.SlotBackend.forward` for decode rows (``rows x 1`` token), the
shape of verifying gamma 4 (``rows x 5``) and one prefill, with the rows' slots in a run (the
keys/values are read in place) and spread out (every other slot: gathered into the reused
buffer); next to transformers' own ``DynamicCache`` forward of the same shape (no masks,
equal lengths). Each case keeps ``--context`` tokens cached per row and repeats its forward at
that context (the new tokens are written over the same columns), interleaved across cases;
medians of ``--repeats``. One torch thread, like a CPU model worker. Every in-place case runs on
each path of ``--paths``: ``lean`` (the lean decoder forward, :mod:`actors.model.lean_decoder`, the
default) and ``model`` (the model's own transformers decoder module), each over its own copy of
the model.

First of all, in the fresh process, a *decode run*: ``--run-steps`` consecutive one-token
forwards of the largest batch, each one column further (the context grows as in serving).
A run is where fresh per-step tensors cost most: glibc serves a large allocation with a fresh
``mmap`` (pages faulted in) until freeing one raises its threshold, and a gathered key/value
tensor one column larger every step stays just above that threshold.

    python -m benchmarks.micro.forward_micro
    python -m benchmarks.micro.forward_micro --rows 1,4,16 --context 150 --repeats 31
    python -m benchmarks.micro.forward_micro --model draft --rows 1
    python -m benchmarks.micro.forward_micro --paths lean --rows 16
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

from actors.model.backends import SlotBackend
from actors.model.batch import linear_row
from benchmarks.served.bare_limit import dynamic_cache_forward
from models import embedded_model_path

logger = logging.getLogger("benchmarks.micro.forward_micro")

PREFILL_TOKENS = 131  # the committed prompts' median length


def _tokens(generator: torch.Generator, count: int) -> list[int]:
    return torch.randint(1, 4000, (count,), generator=generator).tolist()


def _slot_forward(backend: SlotBackend, slots: list[int], context: int, new: int) -> Callable[[], object]:
    """A forward of ``new`` tokens on each of ``slots`` after ``context`` cached tokens."""
    generator = torch.Generator().manual_seed(len(slots) * 100 + new)
    backend.forward([linear_row(slot, 0, _tokens(generator, context), 0, [context - 1]) for slot in slots])
    rows = [linear_row(slot, context, _tokens(generator, new), context, [new - 1]) for slot in slots]
    return lambda: backend.forward(rows)


def _dynamic_cache_forward(backend: SlotBackend, rows: int, context: int, new: int) -> Callable[[], object]:
    """transformers' own forward of the same shape over a DynamicCache cropped back each time."""
    return dynamic_cache_forward(backend.model, rows, context, new)


def _decode_run_ms(backend: SlotBackend, slots: list[int], context: int, steps: int) -> float:
    """Median ms of ``steps`` consecutive one-token forwards on ``slots``, one column further each
    (after one prefill per slot, as requests arrive one by one)."""
    generator = torch.Generator().manual_seed(11)
    for slot in slots:
        backend.forward([linear_row(slot, 0, _tokens(generator, context), 0, [context - 1])])
    times = []
    for step in range(steps):
        rows = [linear_row(slot, context + step, _tokens(generator, 1), context + step, [0]) for slot in slots]
        times.append(_elapsed_ms(lambda rows=rows: backend.forward(rows)))
    return statistics.median(times)


def _elapsed_ms(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16", help="Comma-separated batch sizes (default 1,16).")
    parser.add_argument("--context", type=int, default=150, help="Cached tokens per row (default 150).")
    parser.add_argument("--repeats", type=int, default=21, help="Timed forwards per case (default 21).")
    parser.add_argument("--run-steps", type=int, default=30, help="Steps of the decode run (default 30).")
    parser.add_argument("--paths", default="lean,model",
                        help="Comma-separated forward paths: lean (the lean decoder), model (its own decoder module).")
    parser.add_argument("--model", default="target", help="Which embedded model (default target; or draft, partner).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    sizes = [int(x) for x in args.rows.split(",")]
    paths = [path.strip() for path in args.paths.split(",")]
    backends = {path: SlotBackend.load(str(embedded_model_path(args.model)), max_context=1024,
                                       max_slots=2 * max(sizes) + 2, scratch_columns=288, lean_forward=path == "lean")
                for path in paths}
    backend = backends[paths[0]]
    slots = [backend.allocate() for _ in range(2 * max(sizes) + 2)]
    run_ms = _decode_run_ms(backend, slots[: max(sizes)], args.context, args.run_steps)
    path_slots = {path: slots if path == paths[0] else [other.allocate() for _ in slots]
                  for path, other in backends.items()}
    cases: dict[str, Callable[[], object]] = {}
    for rows in sizes:
        for new in (1, 5):
            for path, other in backends.items():
                run_slots = path_slots[path][:rows]
                cases[f"{rows} x {new}, {path}, slots in a run"] = _slot_forward(
                    other, run_slots, args.context, new)
            spread_slots = slots[: 2 * rows : 2]
            if rows > 1:
                cases[f"{rows} x {new}, {paths[0]}, every other slot"] = _slot_forward(
                    backend, spread_slots, args.context, new)
            cases[f"{rows} x {new}, transformers DynamicCache"] = _dynamic_cache_forward(backend, rows, args.context, new)
    prefill_rows = [linear_row(slots[-1], 0, _tokens(torch.Generator().manual_seed(7), PREFILL_TOKENS), 0,
                               [PREFILL_TOKENS - 1])]
    cases[f"prefill of {PREFILL_TOKENS} tokens, {paths[0]}"] = lambda: backend.forward(prefill_rows)
    for run in cases.values():  # warm-up
        run()
    timings: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved
        for name, run in cases.items():
            timings[name].append(_elapsed_ms(run))
    print(f"| forward (embedded {args.model}, context {args.context}, 1 thread) | median ms |")
    print("| --- | ---: |")
    print(f"| decode run: {max(sizes)} x 1, {paths[0]}, {args.run_steps} steps from context {args.context}, first in the process "
          f"| {run_ms:.1f} |")
    for name, values in timings.items():
        print(f"| {name} | {statistics.median(values):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
