"""Where one forward of an embedded model goes, by kind of op (not a test; the target by default).

Runs :meth:`actors.model.backends.SlotBackend.forward` for ``rows x new`` tokens after
``--context`` cached tokens per row (slots in a run, read in place) under ``torch.profiler``, on
each path of ``--paths`` (``lean``: :mod:`actors.model.lean_decoder`; ``model``: the model's own
transformers decoder module), and splits each forward's time into: the GEMMs (q/k/v, o, MLP and
head projections), attention (sdpa over the cached keys/values), the cache writes, every other
torch op (norms, rotary, activations, masks, views), and what no torch op accounts for (Python,
dispatch; the forward's wall time minus the ops' own time). One torch thread; ``--repeats``
profiled forwards per case after a warm-up.

    python -m benchmarks.micro.forward_profile
    python -m benchmarks.micro.forward_profile --shapes 16x1 --paths lean
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch.profiler import ProfilerActivity, profile

from actors.model.backends import SlotBackend
from actors.model.batch import linear_row
from models import embedded_model_path

#: aten op name -> the column it is counted in (every other op: "other ops").
KINDS = {
    "aten::mm": "GEMMs", "aten::addmm": "GEMMs", "aten::bmm": "GEMMs", "mkldnn::_linear_pointwise": "GEMMs",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_attention_math": "attention",
    "aten::_index_put_impl_": "cache writes", "aten::index_select": "cache writes",
}
COLUMNS = ("GEMMs", "attention", "cache writes", "other ops", "outside ops")


def _split(backend: SlotBackend, rows: int, new: int, context: int, repeats: int) -> tuple[float, dict[str, float]]:
    """The split of ``repeats`` forwards: (ms per forward, {column: share of the wall time})."""
    generator = torch.Generator().manual_seed(rows * 10 + new)
    slots = [backend.allocate() for _ in range(rows)]
    for slot in slots:
        backend.forward([linear_row(slot, 0, torch.randint(1, 4000, (context,), generator=generator).tolist(), 0,
                                    [context - 1])])
    work = [linear_row(slot, context, torch.randint(1, 4000, (new,), generator=generator).tolist(), context,
                       [new - 1]) for slot in slots]
    for _ in range(3):
        backend.forward(work)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for _ in range(repeats):
            backend.forward(work)
        wall_us = 1e6 * (time.perf_counter() - started)
    for slot in slots:
        backend.free(slot)
    totals = dict.fromkeys(COLUMNS, 0.0)
    for event in profiler.key_averages():
        totals[KINDS.get(event.key, "other ops")] += event.self_cpu_time_total
    totals["outside ops"] = max(0.0, wall_us - sum(totals.values()))
    return wall_us / repeats / 1e3, {name: value / wall_us for name, value in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x1,1x5,16x1,16x5", help="rows x new tokens, comma-separated.")
    parser.add_argument("--context", type=int, default=150, help="Cached tokens per row (default 150).")
    parser.add_argument("--repeats", type=int, default=20, help="Profiled forwards per case (default 20).")
    parser.add_argument("--paths", default="lean,model", help="Forward paths: lean, model (default both).")
    parser.add_argument("--model", default="target", help="Which embedded model (default target).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"| forward (embedded {args.model}, context {args.context}, 1 thread) | path | ms (profiled) | "
          + " | ".join(COLUMNS) + " |")
    print("| --- | --- | ---: |" + " ---: |" * len(COLUMNS))
    for path in (p.strip() for p in args.paths.split(",")):
        backend = SlotBackend.load(str(embedded_model_path(args.model)), max_context=1024,
                                   max_slots=max(rows for rows, _ in shapes), scratch_columns=288,
                                   lean_forward=path == "lean")
        for rows, new in shapes:
            ms, shares = _split(backend, rows, new, args.context, args.repeats)
            print(f"| {rows} x {new} | {path} | {ms:.1f} | "
                  + " | ".join(f"{100 * shares[name]:.0f}%" for name in COLUMNS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
