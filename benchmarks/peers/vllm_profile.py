"""Where vLLM's CPU build spends a decode step, by kind of op (not a test; run it with the peer's
venv, see :mod:`benchmarks.peers.vllm_peer`):

    VENV/bin/python benchmarks/peers/vllm_profile.py --rows 1,16

vLLM is never a dependency of this project: this file imports it only inside :func:`main`'s run,
and its report functions (:func:`classify`, :func:`split_step`, :func:`table`) are plain Python.

vLLM's offline engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the embedded
target in float32 with the peer server's settings (``VLLM_CPU_KVCACHE_SPACE``, the venv's
``libiomp5.so`` in ``LD_PRELOAD``: the script restarts itself with it when it is missing), bound to
core ``--core`` with one torch thread (``OMP_NUM_THREADS=1``; the peer server's engine runs the
same: one thread on core 0, the other core kept for its API server), like specserve's model
workers. Its model is compiled by inductor at start-up, with ``cpp.enable_kernel_profile`` so that
each fused kernel (norms, rotary, SiLU-mul, residual adds) shows in the profile. For each
``--rows``: that many requests of ``--prompt-tokens`` random tokens start together; after their
prefill and ``--warmup`` decode steps, ``--steps`` decode steps are timed bare (``LLMEngine.step``)
and then ``--steps`` more under ``torch.profiler`` with vLLM's own scopes
(``VLLM_CUSTOM_SCOPES_FOR_PROFILING``). Each profiled step splits into its forward (the model's
scope and the head's, as in specserve's ``SlotBackend.forward``), split like
:mod:`benchmarks.micro.forward_profile` (GEMMs, attention, cache writes, the fused and other kernels, and
what no op accounts for: Python, dispatch, the compiled graph's wrappers), then sampling, input
preparation, and the rest of the step (scheduling, output processing, bookkeeping). Prints a
markdown table in ms per step.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

#: profiler record name -> the forward column it is counted in (every other op: "kernels").
FORWARD_KINDS = {
    "_C::onednn_mm": "GEMMs", "aten::mm": "GEMMs", "aten::addmm": "GEMMs", "aten::bmm": "GEMMs",
    "aten::linear": "GEMMs", "mkldnn::_linear_pointwise": "GEMMs",
    "_C::cpu_attention_with_kv_cache": "attention",
    "_C::cpu_attn_reshape_and_cache": "cache writes",
}
FORWARD_COLUMNS = ("GEMMs", "attention", "cache writes", "kernels", "no op")
#: vLLM's profiling scopes (``record_function_or_nullcontext``) -> the step column they make.
#: The forward is the model's (``forward``) and its head's (``postprocess``: the kept rows' logits),
#: as in specserve's ``SlotBackend.forward``.
STEP_SCOPES = {"gpu_model_runner: forward": "forward", "gpu_model_runner: postprocess": "forward",
               "gpu_model_runner: sample": "sampling", "gpu_model_runner: preprocess": "inputs"}
FORWARD_SCOPES = frozenset(name for name, column in STEP_SCOPES.items() if column == "forward")
STEP_COLUMNS = ("forward", "sampling", "inputs", "rest of step")
#: Records that are scopes or wrappers, not ops: they own no time of their own in the split.
WRAPPER_PREFIXES = ("gpu_model_runner:", "llm_engine step:", "schedule:", "## Call CompiledFxGraph",
                    "Pregraph bytecode", "AOTDispatcher", "Torch-Compiled Region", "vllm::unified_")
DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1",
            "VLLM_DISABLE_COMPILE_CACHE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Record:
    """One profiler record: its name, own and total time, and the names of the records it runs under."""

    name: str
    self_us: float
    total_us: float
    scopes: tuple[str, ...] = ()


@dataclass
class StepSplit:
    """ms per step: the step's wall time and each column of :data:`STEP_COLUMNS` and of the
    forward's :data:`FORWARD_COLUMNS`."""

    step_ms: float
    bare_step_ms: float
    step: dict[str, float] = field(default_factory=dict)
    forward: dict[str, float] = field(default_factory=dict)


def classify(name: str) -> str:
    """The forward column of an op record (an inductor kernel or any other op: ``kernels``)."""
    return FORWARD_KINDS.get(name, "kernels")


def is_wrapper(name: str) -> bool:
    return name.startswith(WRAPPER_PREFIXES)


def in_forward(record: Record) -> bool:
    return not FORWARD_SCOPES.isdisjoint(record.scopes)


def split_step(records: Iterable[Record], steps: int, wall_ms: float, bare_step_ms: float) -> StepSplit:
    """``records`` of ``steps`` profiled steps that took ``wall_ms`` in all -> ms per step.

    A step column's time is the total time of its scope records; the forward's op columns add up
    the own time of the ops under the forward scope, and its ``no op`` is the forward's time less
    those (Python and dispatch); the rest of the step is the step's wall time less its scopes."""
    scope_us = dict.fromkeys(STEP_COLUMNS[:-1], 0.0)
    forward_us = dict.fromkeys(FORWARD_COLUMNS[:-1], 0.0)
    for record in records:
        if record.name in STEP_SCOPES:
            scope_us[STEP_SCOPES[record.name]] += record.total_us
        elif in_forward(record) and not is_wrapper(record.name):
            forward_us[classify(record.name)] += record.self_us
    forward_us["no op"] = max(0.0, scope_us["forward"] - sum(forward_us.values()))
    step_us = {**scope_us, "rest of step": max(0.0, 1e3 * wall_ms - sum(scope_us.values()))}
    return StepSplit(step_ms=wall_ms / steps, bare_step_ms=bare_step_ms,
                     step={name: value / 1e3 / steps for name, value in step_us.items()},
                     forward={name: value / 1e3 / steps for name, value in forward_us.items()})


def top_records(records: Iterable[Record], count: int, steps: int) -> str:
    """The ``count`` op records with most own time under the forward scope, us per step."""
    totals: dict[str, float] = {}
    for record in records:
        if in_forward(record):
            totals[record.name] = totals.get(record.name, 0.0) + record.self_us
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:count]
    return "\n".join(f"  {value / steps:8.1f} us/step  {name}" for name, value in ranked)


def table(splits: dict[int, StepSplit], header: str) -> str:
    """A markdown table of ``splits`` (rows -> split), ms per step."""
    columns = ["bare step", "profiled step", *STEP_COLUMNS, *(f"forward: {name}" for name in FORWARD_COLUMNS)]
    lines = [f"| {header} | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for rows, split in sorted(splits.items()):
        values = [split.bare_step_ms, split.step_ms, *(split.step[name] for name in STEP_COLUMNS),
                  *(split.forward[name] for name in FORWARD_COLUMNS)]
        lines.append(f"| {rows} x 1 | " + " | ".join(f"{value:.2f}" for value in values) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run (vLLM's venv)

def _records(profiler) -> list[Record]:
    """Every record of ``profiler`` with the names of the records above it."""
    records = []
    for event in profiler.events():
        scopes, parent = [], event.cpu_parent
        while parent is not None:
            scopes.append(parent.name)
            parent = parent.cpu_parent
        records.append(Record(event.name, event.self_cpu_time_total, event.cpu_time_total, tuple(scopes)))
    return records


def _restart_with_environment(args: argparse.Namespace) -> None:
    """Restart this script with vLLM's CPU environment when it is not set yet (``LD_PRELOAD`` must
    be set before the process starts)."""
    iomp = pathlib.Path(sys.prefix) / "lib" / "libiomp5.so"
    wanted = {**DEFAULTS, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "OMP_NUM_THREADS": "1"}
    if iomp.exists() and str(iomp) not in os.environ.get("LD_PRELOAD", ""):
        wanted["LD_PRELOAD"] = os.pathsep.join(p for p in (str(iomp), os.environ.get("LD_PRELOAD", "")) if p)
    missing = {key: value for key, value in wanted.items() if key not in os.environ}
    if missing:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})


def _decode_split(engine, rows: int, args: argparse.Namespace, seed: int) -> StepSplit:
    """Start ``rows`` requests, run prefill and warm-up, time bare steps, then profile steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    max_tokens = 1 + args.warmup + 2 * args.steps + 2
    for index in range(rows):
        prompt = torch.randint(10, 4000, (args.prompt_tokens,), generator=generator).tolist()
        engine.add_request(f"{seed}-{index}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed + index))
    for _ in range(1 + args.warmup):  # the prefill (one step for these prompts), then warm-up decode steps
        engine.step()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    bare_ms = 1e3 * (time.perf_counter() - started) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall_ms = 1e3 * (time.perf_counter() - started)
    while engine.has_unfinished_requests():
        engine.step()
    records = _records(profiler)
    if args.top:
        print(top_records(records, args.top, args.steps))
    return split_step(records, args.steps, wall_ms, bare_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(pathlib.Path(__file__).resolve().parents[2] / "models" / "embedded"
                                               / "target"), help="Model directory (default the embedded target).")
    parser.add_argument("--rows", default="1,16", help="Concurrent decode streams, comma-separated (default 1,16).")
    parser.add_argument("--prompt-tokens", type=int, default=120,
                        help="Random prompt tokens per stream (default 120: the profiled steps read ~150-170).")
    parser.add_argument("--warmup", type=int, default=4, help="Decode steps before the timed ones (default 4).")
    parser.add_argument("--steps", type=int, default=24, help="Bare timed, then profiled, steps (default 24 each).")
    parser.add_argument("--core", type=int, default=0, help="The core this process is bound to, with one torch "
                        "thread (default 0, as the peer server's engine runs).")
    parser.add_argument("--top", type=int, default=0, help="Also list the N records with most own time in the "
                        "forward (default 0: none).")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (default 2).")
    args = parser.parse_args(argv)
    _restart_with_environment(args)
    os.sched_setaffinity(0, {args.core})
    if sys.path and pathlib.Path(sys.path[0]).resolve() == pathlib.Path(__file__).resolve().parent:
        sys.path.pop(0)  # this folder's modules must not shadow the ones vLLM imports
    import torch
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, seed=0,
              compilation_config={"inductor_compile_config": {"cpp.enable_kernel_profile": True}})
    print(f"vLLM engine ready after {time.perf_counter() - started:.1f} s; torch threads: "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    splits = {rows: _decode_split(llm.llm_engine, rows, args, seed=1000 * rows)
              for rows in (int(value) for value in args.rows.split(","))}
    print(table(splits, f"vLLM decode step (ms, prompt {args.prompt_tokens} + {args.warmup + 1} tokens, "
                        f"{args.steps} steps)"))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
