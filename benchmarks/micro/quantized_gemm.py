"""Quantized matmuls (int8 / int4 weight-only, w8a8) against the float GEMMs they replace (not a test).

Times one ``[rows, in] x [in, out]`` product per kernel, for the weight shapes of a decoder layer
(``--shapes``: out x in; the default: the embedded target's gate/up and down projections and its
head, and a 1024-wide layer's; ``--shapes 279m``: the packed q/k/v, o, gate/up, down and head of
the 279M Llama of :mod:`benchmarks.peers.real_size`), at ``--rows`` rows, one torch thread,
medians of ``--repeats`` interleaved rounds. Each kernel cycles through ``--copies`` distinct weights, so that, as in a
model's forward, its weights come from memory rather than the cache (``--copies 1``: one
cache-resident weight). Kernels:

* ``fp32``: ``F.linear`` in float32 (MKL); ``fp32-onednn``: oneDNN's matmul over the weight in its
  blocked layout (what the lean decoder runs in float32, :mod:`actors.model.lean_decoder`);
* ``bf16``: ``F.linear`` in bfloat16; ``bf16-onednn``: oneDNN's matmul over the bf16 weight in its
  blocked layout (what the lean decoder runs a bf16 target with);
* ``int8`` / ``int4`` / ``w8a8``: the quantized linears of :mod:`actors.model.quantized` (modules,
  their conversions included) over ``--inputs`` inputs (float32 by default; a bf16 model's copy
  feeds bfloat16); ``int4-g128``: the int4 kernel with groups of 128 inputs;
* with ``--fp32-kernels``, ``int8-fp32`` / ``int4-fp32``: the same kernels fed float32 inputs
  directly (their slow path in torch 2.13, the reason for the rounding).

    python -m benchmarks.micro.quantized_gemm
    python -m benchmarks.micro.quantized_gemm --rows 1,16 --shapes 2816x1024,1024x2816 --repeats 101
    python -m benchmarks.micro.quantized_gemm --shapes 1024x384 --fp32-kernels --repeats 5 --copies 2
    python -m benchmarks.micro.quantized_gemm --shapes 279m --inputs bfloat16 --forward --record quantized-gemm-279m

``--forward`` then times whole one-row forwards of the 279M random Llama in bfloat16
(:meth:`actors.model.backends.SlotBackend.forward`, context 150, lean decoder): the target (1 x 1
and 1 x 5, the verification of gamma 4) and each quantized copy built from its weights (1 x 1, a
draft step); ``--record CASE`` writes both tables into the results store.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from actors.model.quantized import Int4Linear, Int8Linear, W8A8Linear

DEFAULT_SHAPES = "1024x384,384x1024,4096x384,2816x1024,1024x2816"
#: ``--shapes`` presets: the 279M Llama's packed q/k/v, o, gate/up, down and head weights.
PRESETS = {"279m": "1536x1024,1024x1024,5632x1024,1024x2816,4096x1024"}
COMMAND = "python -m benchmarks.micro.quantized_gemm"
#: ``--forward``: cached tokens per row, and the quantized copies timed.
FORWARD_CONTEXT = 150
FORWARD_COPIES = ("int8", "int4", "w8a8")
#: The kernels a record keeps (the columns of a whole forward's rows).
RECORDED = ("bf16-onednn", "int8", "int4", "w8a8")


COLUMNS = ("fp32", "fp32-onednn", "bf16", "bf16-onednn", "int8", "int4", "int4-g128", "w8a8")
FP32_KERNEL_COLUMNS = ("int8-fp32", "int4-fp32")


def _kernels(out_features: int, in_features: int, rows: int, fp32_kernels: bool,
             seed: int = 0, input_dtype: torch.dtype = torch.float32) -> dict[str, Callable[[], object]]:
    """Each kernel's product of one ``[rows, in]`` input by one weight (``seed``), ready to time."""
    generator = torch.Generator().manual_seed(out_features * 7 + in_features + 1000 * seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * in_features ** -0.5)
    inputs = torch.randn(rows, in_features, generator=generator)  # [rows, in]
    weight, half, half_weight = linear.weight.detach(), inputs.bfloat16(), linear.weight.detach().bfloat16()
    kernels = {"fp32": lambda: F.linear(inputs, weight), "bf16": lambda: F.linear(half, half_weight)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        kernels["fp32-onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(inputs, blocked, None, "none", [], "")
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            blocked_half = torch.ops.mkldnn._reorder_linear_weight(half_weight, 16)
            kernels["bf16-onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(half, blocked_half, None, "none", [], "")
    int8, int4, w8a8 = Int8Linear(linear), Int4Linear(linear), W8A8Linear(linear)
    fed = inputs.to(input_dtype)  # [rows, in]
    kernels.update({"int8": lambda: int8(fed), "int4": lambda: int4(fed), "w8a8": lambda: w8a8(fed)})
    if in_features % 128 == 0:
        int4_wide = Int4Linear(linear, 128)
        kernels["int4-g128"] = lambda: int4_wide(fed)
    if fp32_kernels:
        int8_scales, int4_scales = int8.scales.float(), int4.scales_and_zeros.float()
        kernels["int8-fp32"] = lambda: torch.ops.aten._weight_int8pack_mm(inputs, int8.weight_int8, int8_scales)
        kernels["int4-fp32"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            inputs, int4.weight_int4, int4.group_size, int4_scales)
    return kernels


def _time(runs: list[Callable[[], object]], inner: int) -> float:
    """Microseconds per product, over ``inner`` passes through ``runs`` (one per weight copy)."""
    started = time.perf_counter()
    for _ in range(inner):
        for run in runs:
            run()
    return (time.perf_counter() - started) / (inner * len(runs)) * 1e6


def gemm_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time every kernel at every shape and row count (printed as it goes) -> one row each."""
    columns = COLUMNS + (FP32_KERNEL_COLUMNS if args.fp32_kernels else ())
    input_dtype = getattr(torch, args.inputs)
    table = []
    print("| weight (out x in) | rows | " + " | ".join(columns) + " |  (us per product, median)")
    for shape in PRESETS.get(args.shapes, args.shapes).split(","):
        out_features, in_features = (int(size) for size in shape.lower().split("x"))
        for rows in (int(r) for r in args.rows.split(",")):
            copies = [_kernels(out_features, in_features, rows, args.fp32_kernels, seed, input_dtype)
                      for seed in range(args.copies)]
            kernels = {name: [copy[name] for copy in copies] for name in copies[0]}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for runs in kernels.values():
                _time(runs, 1)  # warm-up
            for _ in range(args.repeats):
                for name, runs in kernels.items():
                    times[name].append(_time(runs, args.inner))
            cells = [f"{statistics.median(times[name]):.1f}" if name in times else "-" for name in columns]
            print(f"| {out_features} x {in_features} | {rows} | " + " | ".join(cells) + " |")
            table.append({"weight (out x in)": f"{out_features} x {in_features}", "rows": rows,
                          **{f"{name} us": round(statistics.median(times[name]), 1) for name in columns if name in times}})
    return table


def forward_rows(repeats: int) -> list[dict[str, Any]]:
    """Whole one-row forwards of the 279M random Llama in bfloat16 and of its quantized copies (see
    the module doc), interleaved, medians of ``repeats`` -> one row each, with its ratio to the
    target's 1 x 1 forward."""
    from actors.model.backends import SlotBackend
    from actors.model.batch import linear_row
    from benchmarks.peers.real_size import SHAPES, build_checkpoint

    generator = torch.Generator().manual_seed(0)

    def forward(backend: SlotBackend, new: int) -> Callable[[], object]:
        slot = backend.allocate()
        context = torch.randint(1, 4000, (FORWARD_CONTEXT,), generator=generator).tolist()
        backend.forward([linear_row(slot, 0, context, 0, [FORWARD_CONTEXT - 1])])
        rows = [linear_row(slot, FORWARD_CONTEXT, torch.randint(1, 4000, (new,), generator=generator).tolist(),
                           FORWARD_CONTEXT, [new - 1])]
        return lambda: backend.forward(rows)

    with tempfile.TemporaryDirectory(prefix="quantized-gemm-") as root:
        path = str(build_checkpoint(SHAPES["279m"], pathlib.Path(root), "llama-279m"))
        options = dict(dtype="bfloat16", max_context=1024, max_slots=2, scratch_columns=16)
        target = SlotBackend.load(path, **options)
        cases = {"bf16 target, 1 x 1": forward(target, 1), "bf16 target, 1 x 5": forward(target, 5)}
        for quantization in FORWARD_COPIES:
            cases[f"{quantization} copy, 1 x 1"] = forward(SlotBackend.load(path, quantization=quantization, **options), 1)
        for run in cases.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - started) * 1e3)
    base = statistics.median(times["bf16 target, 1 x 1"])
    table = [{"forward": name, "ms": round(statistics.median(values), 2), "x target 1 x 1": round(statistics.median(values) / base, 2)}
             for name, values in times.items()]
    print(f"\n| 279M Llama forward, context {FORWARD_CONTEXT}, 1 thread | median ms | x target 1 x 1 |")
    for row in table:
        print(f"| {row['forward']} | {row['ms']:.2f} | {row['x target 1 x 1']:.2f} |")
    return table


def record(case: str, args: argparse.Namespace, gemms: list[dict[str, Any]], forwards: list[dict[str, Any]],
           argv: list[str]) -> pathlib.Path:
    """Write the tables into the results store (``--record CASE``) and regenerate the page."""
    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    words, skip = [], False
    for word in argv:
        if skip or word.split("=", 1)[0] == "--record":
            skip = not skip and "=" not in word
            continue
        words.append(word)
    by_rows: dict[int, list[dict[str, Any]]] = {}
    for row in gemms:
        by_rows.setdefault(row["rows"], []).append(row)
    shapes = (f"Its {len(PRESETS[args.shapes].split(','))} shapes" if args.shapes in PRESETS else
              "Shapes " + ", ".join(row["weight (out x in)"].replace(" ", "") for row in gemms if row["rows"] == gemms[0]["rows"]))
    counts = " / ".join(str(count) for count in by_rows)
    rows = [{"case": f"GEMMs, {counts} rows, us",
             **{name: " / ".join(f"{sum(row[f'{name} us'] for row in shape_rows):.0f}" for shape_rows in by_rows.values())
                for name in RECORDED}}]
    if forwards:  # the target's forward under bf16-onednn (what it runs), each copy's under its kernel
        by_name = {row["forward"].split()[0]: row for row in forwards if row["forward"].endswith("1 x 1")}
        rows.append({"case": "forward, 1 x 1, ms", **{name: round(by_name[key]["ms"], 1)
                                                        for name, key in zip(RECORDED, ("bf16", *RECORDED[1:])) if key in by_name}})
    notes = f"{shapes}; one thread; medians of {args.repeats} rounds, {args.copies} weights a kernel; {args.inputs} inputs."
    return update(make_record(case, "Quantized GEMMs and forwards against bf16, 279M Llama",
                              " ".join([COMMAND, *words]), rows, notes=notes, section="Micro-benchmarks"))


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16", help="Comma-separated row counts.")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"Comma-separated out x in weight shapes, or one of {sorted(PRESETS)}.")
    parser.add_argument("--repeats", type=int, default=31, help="Interleaved rounds (median reported).")
    parser.add_argument("--inner", type=int, default=5, help="Passes over the copies per timed round.")
    parser.add_argument("--copies", type=int, default=16, help="Distinct weights each kernel cycles through.")
    parser.add_argument("--fp32-kernels", action="store_true", help="Also time the kernels fed float32 inputs (slow).")
    parser.add_argument("--inputs", choices=("float32", "bfloat16"), default="float32", help="The quantized modules' input dtype.")
    parser.add_argument("--forward", action="store_true", help="Also time the 279M Llama's and its copies' forwards.")
    parser.add_argument("--forward-repeats", type=int, default=11, help="Interleaved rounds of --forward.")
    parser.add_argument("--record", default=None, metavar="CASE", help="Write the tables into the results store.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gemms = gemm_rows(args)
    forwards = forward_rows(args.forward_repeats) if args.forward else []
    if args.record:
        print(f"recorded {record(args.record, args, gemms, forwards, list(sys.argv[1:] if argv is None else argv))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
