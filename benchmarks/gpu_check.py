"""``make gpu-check``: everything to run on a GPU's first lending, in one command, under 10 minutes.

1. **The device tests** (``pytest -m device -k cuda``: the forward, KV rollback, decode graphs and
   verification rules parametrized by device, ``tests/devices.py``); their summary line.
2. **A random-weight 1B-shape target in bfloat16 and a random draft**, built here
   (:func:`benchmarks.peers.real_size.build_checkpoint`: the ``1b`` shape, TinyLlama-1.1B's, and a
   4-layer draft of the same vocabulary; nothing downloaded), served by the engine alone on the
   device (the production Coordinator and ModelWorkers in this process,
   :class:`benchmarks.served.runners.LocalRunner`): ``ar`` and ``sd`` gamma 4 at 1 and 16 clients,
   temperature 1, EOS ignored; once with eager forwards and once with ``engine.cuda_graphs``.
3. **Per level:** tokens/s and the step's time split: forwards (the workers'
   ``forward_seconds_total``, the logits' host copy included), verification (the verifier calls of
   the workers' steps), row work (the rest of the workers' step calls: rows, penalties, draws,
   sessions) and coordinator + hand-off (the rest of the wall time: scheduling and passing results
   between the in-process workers; Ray's transport is not in this path).
4. **Kernel launches per forward:** ``torch.profiler`` over one decode forward of the target (one
   row, one token): the kernel launches the host made (graph launches included) and the kernels the
   device ran, with the forward's median time, eager and with a CUDA graph.

``--dry-run`` (``make gpu-check DRY=1``) runs the same pipeline on CPU with tiny shapes and the
device tests on ``cpu``, so the command cannot rot where no GPU is (CI runs it); on CPU the profile
counts the top-level aten operators of a forward instead of kernel launches.

    python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from actors.model.batch import linear_row
from actors.model.decode_graphs import decode_graphs
from actors.worker import step as worker_step
from actors.worker.model_worker import ModelWorker
from benchmarks.peers.real_size import SHAPES, build_checkpoint
from benchmarks.served.engine_load import timed_run
from benchmarks.served.prompts import load_prompts
from cluster.config import parse_app_args

logger = logging.getLogger("benchmarks.gpu_check")

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The draft of the 1B target: 4 Llama layers over the target's vocabulary (~80M parameters).
DRAFT_SHAPE = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=32000)
#: ``--dry-run``'s shapes: tiny, over the embedded tokenizer's 4,096 ids.
DRY_TARGET = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096)
DRY_DRAFT = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096)
STRATEGIES = {"ar": {"strategy": "ar"}, "sd": {"strategy": "sd", "method": "block", "gamma": 4}}
#: Host-side calls that start work on a CUDA device (a kernel, or a recorded graph).
LAUNCHES = frozenset({"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch"})
KV_CACHE_BYTES = 8 * 2**30  # per worker on the GPU (two workers share the process)


@dataclass
class Level:
    """One served level: tokens/s and the step's time split (seconds over the level)."""

    graphs: bool
    strategy: str
    clients: int
    tokens_per_s: float
    wall_s: float
    forward_s: float
    verify_s: float
    step_s: float

    def split(self) -> dict[str, float]:
        """Each part's share of the wall time (sums to 1)."""
        row_s = max(self.step_s - self.forward_s - self.verify_s, 0.0)
        rest_s = max(self.wall_s - self.step_s, 0.0)
        total = self.forward_s + self.verify_s + row_s + rest_s or 1.0
        return {"forwards": self.forward_s / total, "row work": row_s / total,
                "verification": self.verify_s / total, "coordinator + hand-off": rest_s / total}


@dataclass
class Profile:
    """One decode forward of the target: host launches, device kernels (CPU: aten ops), median seconds."""

    graphs: bool
    launches: int
    kernels: int
    forward_s: float


# ----------------------------------------------------------------------------- the device tests

def device_tests(device: str) -> tuple[int, str]:
    """``pytest -m device -k DEVICE`` over the tests -> (exit status, its summary line)."""
    command = [sys.executable, "-m", "pytest", "tests", "-m", "device", "-k", device, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0:
        print(done.stdout[-6000:], done.stderr[-2000:], sep="\n")
    return done.returncode, (lines[-1] if lines else done.stderr.strip()[-200:])


# ----------------------------------------------------------------------------- serving

@contextlib.contextmanager
def workers_on(device: str) -> Iterator[None]:
    """In-process ModelWorkers (no Ray assigns them a GPU) placed on ``device``."""
    pick = ModelWorker._pick_device
    ModelWorker._pick_device = lambda self: device
    try:
        yield
    finally:
        ModelWorker._pick_device = pick


@contextlib.contextmanager
def verify_timer(total: list[float]) -> Iterator[None]:
    """Add the seconds of every step's verifier calls (``Step._verify_waiting``) to ``total[0]``."""
    verify = worker_step.Step._verify_waiting

    def timed(self: Any) -> None:
        started = time.perf_counter()
        try:
            verify(self)
        finally:
            total[0] += time.perf_counter() - started

    worker_step.Step._verify_waiting = timed
    try:
        yield
    finally:
        worker_step.Step._verify_waiting = verify


def group_args(target: pathlib.Path, draft: pathlib.Path, device: str, clients: int) -> Any:
    """The engine's config: the target and the draft in bfloat16, ``ar`` by default."""
    engine: dict[str, Any] = {"max_model_len": 1024}
    if device == "cuda":
        engine["kv_cache_memory"] = KV_CACHE_BYTES
    return parse_app_args({
        "models": {"target": {"path": str(target), "role": "target", "dtype": "bfloat16"},
                   "draft": {"path": str(draft), "role": "draft", "dtype": "bfloat16"}},
        "defaults": {"strategy": "ar"},
        "limits": {"max_concurrent_requests": max(clients, 16)},
        "engine": engine,
    })


def backends(runner: Any) -> dict[str, Any]:
    """Model name -> its worker's backend (in this process)."""
    return {name: handle._instance.backend for name, handle in runner.workers.items()}


def set_graphs(runner: Any, on: bool) -> None:
    """Turn ``engine.cuda_graphs`` on or off in every worker of ``runner`` (as the config would at start)."""
    for backend in backends(runner).values():
        backend.decode_graphs = decode_graphs(backend, on)


def serve_level(runner: Any, prompts: list[str], strategy: str, clients: int, args: argparse.Namespace,
                graphs: bool) -> Level:
    """One closed-loop level -> its :class:`Level`."""
    engines = [handle._instance.engine for handle in runner.workers.values()]
    before = [(engine.forward_seconds_total, engine.step_seconds_total) for engine in engines]
    verify = [0.0]
    with verify_timer(verify):
        run = timed_run(runner, prompts, STRATEGIES[strategy],
                        types.SimpleNamespace(requests=clients * args.requests_per_client, concurrency=clients,
                                              max_tokens=args.max_tokens))
    forward_s = sum(engine.forward_seconds_total - b[0] for engine, b in zip(engines, before))
    step_s = sum(engine.step_seconds_total - b[1] for engine, b in zip(engines, before))
    return Level(graphs, strategy, clients, run.tokens / run.wall_s, run.wall_s, forward_s, verify[0], step_s)


# ----------------------------------------------------------------------------- the profile

def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def profile_decode(backend: Any, graphs: bool, repeats: int = 20) -> Profile:
    """One decode forward (one row, one token after a 32-token prompt) of ``backend``, profiled, and
    the median time of ``repeats`` more; the slot is freed after."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(backend.device).type
    backend.decode_graphs = decode_graphs(backend, graphs)
    slot = backend.allocate()
    try:
        prompt = list(range(2, 34))
        backend.forward([linear_row(slot, 0, prompt, 0, [len(prompt) - 1])])

        def decode() -> None:
            backend.forward([linear_row(slot, len(prompt), [7], len(prompt), [0])])

        decode()  # warm-up (records the slot's graph when on)
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            decode()
            _sync(device)
        averages = prof.key_averages()
        if device == "cuda":
            launches = sum(e.count for e in averages if e.key in LAUNCHES)
            kernels = sum(e.count for e in averages if e.device_type == DeviceType.CUDA)
        else:
            launches = 0
            kernels = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            decode()
            _sync(device)
            times.append(time.perf_counter() - started)
        return Profile(graphs, launches, kernels, statistics.median(times))
    finally:
        backend.free(slot)
        backend.decode_graphs = None


# ----------------------------------------------------------------------------- the report

def level_table(levels: list[Level]) -> list[str]:
    lines = ["| CUDA graphs | strategy | clients | tok/s | forwards | row work | verification | coordinator + hand-off |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for level in levels:
        split = level.split()
        lines.append(f"| {'on' if level.graphs else 'off'} | {level.strategy} | {level.clients} | {level.tokens_per_s:.1f} | "
                     + " | ".join(f"{100 * split[part]:.0f}%" for part in
                                  ("forwards", "row work", "verification", "coordinator + hand-off")) + " |")
    return lines


def profile_lines(profiles: list[Profile], device: str) -> list[str]:
    lines = []
    for item in profiles:
        what = (f"{item.launches} kernel launches, {item.kernels} kernels run" if device == "cuda"
                else f"{item.kernels} top-level aten ops (CPU: no kernel launches)")
        lines.append(f"target decode forward (1 row, 1 token), CUDA graphs {'on' if item.graphs else 'off'}: "
                     f"{what}, median {1e3 * item.forward_s:.2f} ms")
    return lines


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The whole check -> what it printed, as data (the dry-run test reads it)."""
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check: torch sees no CUDA device (use --dry-run for the CPU pipeline)")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"gpu-check on {device} ({name}), torch {torch.__version__}")
    status, summary = (0, "skipped (--no-tests)") if args.no_tests else device_tests(device)
    print(f"device tests (pytest -m device -k {device}): {summary}")
    target_shape, draft_shape = (DRY_TARGET, DRY_DRAFT) if args.dry_run else (SHAPES["1b"], DRAFT_SHAPE)
    prompts = [prompt.text for prompt in load_prompts()]
    levels: list[Level] = []
    profiles: list[Profile] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        target = build_checkpoint(target_shape, pathlib.Path(root), "target")
        draft = build_checkpoint(draft_shape, pathlib.Path(root), "draft", seed=1)
        from benchmarks.served.runners import LocalRunner

        with workers_on(device):
            runner = LocalRunner(group_args(target, draft, device, max(args.clients)), temperature=1.0)
        try:
            models = backends(runner)
            print(f"target: random Llama ({target_shape}), draft: random Llama ({draft_shape}), bfloat16 on {device}; "
                  f"forward paths: {', '.join(f'{n}: {b.forward_path}' for n, b in models.items())}")
            for graphs in ((False, True) if device == "cuda" else (False,)):
                set_graphs(runner, graphs)
                for strategy in STRATEGIES:
                    timed_run(runner, prompts, STRATEGIES[strategy],
                              types.SimpleNamespace(requests=1, concurrency=1, max_tokens=4))  # warm-up
                    for clients in args.clients:
                        levels.append(serve_level(runner, prompts, strategy, clients, args, graphs))
                        logger.info("%s", level_table(levels[-1:])[-1])
            set_graphs(runner, False)
            profiles = [profile_decode(models["target"], graphs) for graphs in ((False, True) if device == "cuda" else (False,))]
        finally:
            runner.close()
    print(f"served by the engine alone: {args.max_tokens} tokens a request, requests a client: {args.requests_per_client}; "
          "the time split is each part's share of the wall time")
    print("\n".join(level_table(levels) + [""] + profile_lines(profiles, device)))
    return {"status": status, "tests": summary, "levels": levels, "profiles": profiles}


def _clients(text: str) -> list[int]:
    values = [int(value) for value in text.split(",") if value.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="The same pipeline on CPU with tiny shapes.")
    parser.add_argument("--no-tests", action="store_true", help="Skip the device tests.")
    parser.add_argument("--clients", type=_clients, default=[1, 16], help="Client counts (default 1,16).")
    parser.add_argument("--max-tokens", type=int, default=None, help="Tokens a request (default 64; dry 8).")
    parser.add_argument("--requests-per-client", type=int, default=None, help="Requests a client a level (default 2; dry 1).")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (8 if args.dry_run else 64)
    args.requests_per_client = args.requests_per_client or (1 if args.dry_run else 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for noisy in ("actors", "cluster", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return check(args)["status"]


if __name__ == "__main__":
    raise SystemExit(main())
