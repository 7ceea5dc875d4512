"""Weight-only int8 / int4 matmuls against the float GEMMs they replace (not a test).

Times one ``[rows, in] x [in, out]`` product per kernel, for the weight shapes of a decoder layer
(``--shapes``: out x in; the default: the embedded target's gate/up and down projections and its
head, and a 1024-wide layer's), at ``--rows`` rows, one torch thread, medians of ``--repeats``
interleaved rounds. Each kernel cycles through ``--copies`` distinct weights, so that, as in a
model's forward, its weights come from memory rather than the cache (``--copies 1``: one
cache-resident weight). Kernels:

* ``fp32``: ``F.linear`` in float32 (MKL); ``fp32-onednn``: oneDNN's matmul over the weight in its
  blocked layout (what the lean decoder runs in float32, :mod:`actors.model.lean_decoder`);
* ``bf16``: ``F.linear`` in bfloat16;
* ``int8`` / ``int4``: the quantized linears of :mod:`actors.model.quantized` over float32 inputs
  (rounded to bfloat16 inside the product, where the kernels are fast);
* with ``--fp32-kernels``, ``int8-fp32`` / ``int4-fp32``: the same kernels fed float32 inputs
  directly (their slow path in torch 2.13, the reason for the rounding).

    python -m benchmarks.micro.quantized_gemm
    python -m benchmarks.micro.quantized_gemm --rows 1,16 --shapes 2816x1024,1024x2816 --repeats 101
    python -m benchmarks.micro.quantized_gemm --shapes 1024x384 --fp32-kernels --repeats 5 --copies 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from actors.model.quantized import Int4Linear, Int8Linear

DEFAULT_SHAPES = "1024x384,384x1024,4096x384,2816x1024,1024x2816"


COLUMNS = ("fp32", "fp32-onednn", "bf16", "int8", "int4")
FP32_KERNEL_COLUMNS = ("int8-fp32", "int4-fp32")


def _kernels(out_features: int, in_features: int, rows: int, fp32_kernels: bool,
             seed: int = 0) -> dict[str, Callable[[], object]]:
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
    int8, int4 = Int8Linear(linear), Int4Linear(linear)
    kernels.update({"int8": lambda: int8(inputs), "int4": lambda: int4(inputs)})
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


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16", help="Comma-separated row counts.")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="Comma-separated out x in weight shapes.")
    parser.add_argument("--repeats", type=int, default=31, help="Interleaved rounds (median reported).")
    parser.add_argument("--inner", type=int, default=5, help="Passes over the copies per timed round.")
    parser.add_argument("--copies", type=int, default=16, help="Distinct weights each kernel cycles through.")
    parser.add_argument("--fp32-kernels", action="store_true", help="Also time the kernels fed float32 inputs (slow).")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    columns = COLUMNS + (FP32_KERNEL_COLUMNS if args.fp32_kernels else ())
    print("| weight (out x in) | rows | " + " | ".join(columns) + " |  (us per product, median)")
    for shape in args.shapes.split(","):
        out_features, in_features = (int(size) for size in shape.lower().split("x"))
        for rows in (int(r) for r in args.rows.split(",")):
            copies = [_kernels(out_features, in_features, rows, args.fp32_kernels, seed) for seed in range(args.copies)]
            kernels = {name: [copy[name] for copy in copies] for name in copies[0]}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for runs in kernels.values():
                _time(runs, 1)  # warm-up
            for _ in range(args.repeats):
                for name, runs in kernels.items():
                    times[name].append(_time(runs, args.inner))
            cells = [f"{statistics.median(times[name]):.1f}" if name in times else "-" for name in columns]
            print(f"| {out_features} x {in_features} | {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
