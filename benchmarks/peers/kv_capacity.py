"""How many requests a KV budget runs at once (not a test): the Qwen2.5-shaped target of
:mod:`benchmarks.peers.real_shape` (32,768-token context, a whole slot of ~96 MiB) served by the
engine alone (the production Coordinator and ModelWorkers in this process) with
``engine.kv_cache_memory`` of ``--kv-cache-memory`` (default 512 MiB: five whole slots), and
``--requests`` requests of ``--prompt`` tokens sent at once (ar). Reports the KV blocks, the most
requests running at once (the scheduler's running list, what ``GET /v1/status`` counts), how many
completed, failed and were preempted.

    python -m benchmarks.peers.kv_capacity
    python -m benchmarks.peers.kv_capacity --requests 64 --prompt 1000 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import tempfile
import time

import torch

from actors.coordination.coordinator import Coordinator
from actors.request_schema import GenerationRequest, SamplingParams
from actors.worker.model_worker import ModelWorker
from benchmarks.peers.real_shape import CONTEXT, build_checkpoints
from benchmarks.served.runners import LocalActorHandle
from cluster.config import parse_app_args
from cluster.serving.bringup import worker_sessions

COMMAND = "python -m benchmarks.peers.kv_capacity"


def _coordinator(paths: dict[str, pathlib.Path], kv_cache_memory: int, requests: int) -> Coordinator:
    """The target alone (ar) with the production worker settings (cluster.serving.bringup)."""
    config = parse_app_args({
        "models": {"target": {"path": str(paths["target"]), "role": "target", "dtype": "float32"}},
        "defaults": {"strategy": "ar"},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": requests, "max_queued_requests": requests, "request_timeout_s": 7200},
        "engine": {"kv_cache_memory": kv_cache_memory, "max_model_len": CONTEXT},
    }).freeze()
    workers = {m.name: LocalActorHandle(ModelWorker(m, config.session_idle_timeout_s, max_sessions=worker_sessions(config),
                                                    kv_cache_memory=config.kv_cache_memory, max_model_len=config.max_model_len,
                                                    max_tokens_per_step=config.max_tokens_per_step))
               for m in config.models}
    return Coordinator(workers, config, export_to_ray=False)


async def _serve(coordinator: Coordinator, requests: list[GenerationRequest]) -> tuple[list[list], int]:
    """Every request's chunks and the most requests running at once (polled every 10 ms)."""
    peak = 0

    async def collect(request: GenerationRequest) -> list:
        return [chunk async for chunk in coordinator.generate(request)]

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(coordinator.scheduler.running))
            await asyncio.sleep(0.01)

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        results = await asyncio.gather(*(collect(request) for request in requests))
    finally:
        watcher.cancel()
        await coordinator.scheduler.close()
    return results, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-memory", type=int, default=512 * 2**20, help="engine.kv_cache_memory in bytes.")
    parser.add_argument("--requests", type=int, default=48, help="Requests sent at once (default 48).")
    parser.add_argument("--prompt", type=int, default=1000, help="Prompt tokens per request (default 1000).")
    parser.add_argument("--max-tokens", type=int, default=8, help="Tokens per request (default 8).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    requests = [GenerationRequest(request_id=f"kv-capacity-{i}",
                                  prompt_ids=torch.randint(1, 4000, (args.prompt,), generator=generator).tolist(),
                                  sampling=SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i,
                                                          ignore_eos=True))
                for i in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="kv-capacity-") as root:
        coordinator = _coordinator(build_checkpoints(pathlib.Path(root)), args.kv_cache_memory, args.requests)
        cache = coordinator.workers["target"]._instance.backend.cache
        started = time.perf_counter()
        results, peak = asyncio.run(_serve(coordinator, requests))
        wall_s = time.perf_counter() - started
    failed = sum(1 for chunks in results if chunks[-1].error is not None)
    completed = sum(1 for chunks in results if chunks[-1].finished and chunks[-1].error is None)
    print(f"Command: `{COMMAND} --kv-cache-memory {args.kv_cache_memory} --requests {args.requests} "
          f"--prompt {args.prompt} --max-tokens {args.max_tokens}`; one torch thread.\n")
    print("| budget | blocks x tokens | requests x prompt tokens | most running at once | completed | failed | "
          "preempted | wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.kv_cache_memory / 2**20:,.0f} MiB | {cache.num_blocks:,} x {cache.block_size} | {args.requests} x "
          f"{args.prompt} | {peak} | {completed} | {failed} | {coordinator.scheduler.admission.preemptions} | {wall_s:.1f} |")
    return 0 if failed == 0 and completed == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
