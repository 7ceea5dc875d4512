"""Bytes and time per step moving a draft's rows between workers: ``python -m benchmarks.micro.row_transport``.

Two Ray actors stand for a draft worker and a target worker of their own (``placement:
separate``) and make one ``sd`` step's calls, as :mod:`actors.coordination.worker_calls` does,
with ``--clients`` requests drafting ``--gamma`` tokens over a ``--vocab``-token vocabulary
(float32 logits, :class:`~verifiers.machines.needs.Sampled` payloads):

* ``object store``: the draft's call returns its payloads, tokens and logits, pickled through
  :mod:`actors.wire`; the target's call reads them as a nested ref and unpickles them;
* ``gloo``: the draft's call holds its logits back (:func:`actors.worker.row_transport.hold_rows`),
  a ``take_rows`` call returns them with ``tensor_transport="gloo"``, the target's call reads
  them as a top-level argument and puts them back (:func:`~actors.worker.row_transport.attach_rows`);
* ``tokens only``: the same two calls with no logits at all: what a step pays with no rows.

The time moving rows per step is a path's median chain (draft call to target call's return)
less the tokens-only chain's. ``--served`` also serves the embedded family on separate workers
(``deploy/default.yaml``, ``sd`` gamma 4, ``--clients`` seeded requests at once) under each
``engine.row_transport`` (``--rounds`` interleaved rounds) and prints tokens/s, the median step, the
median time a step's proposals took to reach the target (from the draft call's end to the target
call holding payloads and rows, the workers' ``CallTiming`` stamps) and whether the tokens agree.
``--record CASE`` writes the figures into the results store. Starts its own local Ray.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

logger = logging.getLogger(__name__)


def _actor_class():
    import ray
    import torch

    from actors.worker.row_transport import HeldRows, attach_rows, hold_rows
    from actors.worker.model_worker import resolve_source

    @ray.remote(num_cpus=0.1, enable_tensor_transport=True)
    class Worker:
        """A draft (``step``, ``step_holding``, ``take_rows``) or a target (``read``, ``read_rows``)."""

        def __init__(self, clients: int, gamma: int, vocab: int):
            generator = torch.Generator().manual_seed(0)
            self.tokens = torch.randint(0, vocab, (clients, 1, gamma), generator=generator)  # [B, 1, gamma]
            self.logits = torch.randn(clients, 1, gamma, vocab, generator=generator)  # [B, 1, gamma, V]
            self.held = HeldRows()

        def payloads(self, with_logits: bool) -> list[Any]:
            from verifiers.machines.needs import Sampled

            # the tensors a step's forwards left (no copy here: making them is the step's work on either path)
            return [Sampled(tokens, logits if with_logits else None) for tokens, logits in zip(self.tokens, self.logits)]

        def step(self, with_logits: bool) -> tuple[list[int], list[Any]]:
            return [0] * len(self.tokens), self.payloads(with_logits)

        def step_holding(self, key: str) -> tuple[list[int], list[Any]]:
            payloads, held = hold_rows(self.payloads(True))
            self.held.keep(key, held)
            return [0] * len(payloads), payloads

        def take_rows(self, key: str):
            return self.held.take(key)

        def read(self, sources: list[Any]) -> int:
            payloads = resolve_source(sources[0])
            return sum(0 if p.logits is None else p.logits.numel() for p in payloads)

        def read_rows(self, sources: list[Any], held) -> int:
            payloads = attach_rows(resolve_source(sources[0]), held)
            return sum(p.logits.numel() for p in payloads)

    return Worker


def _chain_ms(call, repeats: int) -> float:
    """The median milliseconds of ``call()`` (which waits for its chain), after a few warm-up calls."""
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def measure_hops(clients: int, gamma: int, vocab: int, repeats: int) -> dict[str, float]:
    """Each path's median chain (ms), the tokens-only chain, and the rows' bytes per step."""
    import ray
    from ray.experimental.collective import create_collective_group

    worker = _actor_class()
    draft, target = worker.remote(clients, gamma, vocab), worker.remote(clients, gamma, vocab)
    create_collective_group([draft, target], backend="torch_gloo")
    keys = iter(range(10**9))

    def object_store(with_logits: bool = True) -> int:
        _, payloads = draft.step.options(num_returns=2).remote(with_logits)
        return ray.get(target.read.remote([payloads]))

    def gloo() -> int:
        key = f"k{next(keys)}"
        _, payloads = draft.step_holding.options(num_returns=2).remote(key)
        rows = draft.take_rows.options(tensor_transport="gloo").remote(key)
        return ray.get(target.read_rows.remote([payloads], rows))

    numel = clients * gamma * vocab
    assert object_store() == numel and gloo() == numel and object_store(False) == 0
    figures = {"tokens only": _chain_ms(lambda: object_store(False), repeats)}
    figures["object store"] = _chain_ms(object_store, repeats)
    figures["gloo"] = _chain_ms(gloo, repeats)
    figures["bytes"] = 4 * numel
    return figures


def served_run(transport: str, clients: int, max_tokens: int) -> dict[str, Any]:
    """The embedded family on separate workers under ``engine.row_transport`` ``transport``: tokens/s,
    median step, the tokens of each seeded request and what the coordinator reports of the transport."""
    import asyncio

    import ray

    from actors.request_schema import GenerationRequest
    from cluster.config import load_app_args
    from cluster.serving.bringup import start_model_group

    args = load_app_args("deploy/default.yaml", None)
    args = args.model_copy(update={
        "resources": args.resources.model_copy(update={"placement": "separate"}),
        "engine": args.engine.model_copy(update={"row_transport": transport, "burst_ms": 0.0})})
    group = start_model_group(args)
    try:
        requests = [GenerationRequest(request_id=f"r{i}", prompt=f"def f{i}(x):", speculation={"strategy": "sd", "gamma": 4},
                                      sampling={"max_tokens": max_tokens, "seed": i, "temperature": 1.0, "ignore_eos": True})
                    for i in range(clients)]

        async def one(request):
            tokens = []
            async for ref in group.coordinator.generate.options(num_returns="streaming").remote(request):
                chunk = await ref
                if chunk.error:
                    raise RuntimeError(chunk.error)
                tokens.extend(chunk.token_ids)
            return tokens

        async def run_all():
            return await asyncio.gather(*(one(r) for r in requests))

        asyncio.run(run_all())  # warm-up: loads, first steps, the collective group
        before = len(ray.get(group.coordinator.engine_stats.remote())["row_moving_s"])
        started = time.perf_counter()
        tokens = asyncio.run(run_all())
        wall = time.perf_counter() - started
        stats = ray.get(group.coordinator.engine_stats.remote())
    finally:
        group.shutdown()
    steps, moving = stats["step_seconds"], stats["row_moving_s"][before:]
    return {"tokens": tokens, "tokens_per_second": sum(map(len, tokens)) / wall,
            "step_ms": 1e3 * statistics.median(steps) if steps else None, "transport": stats["row_transport"],
            "fallbacks": stats["row_fallbacks"], "moving_ms": 1e3 * statistics.median(moving) if moving else None}


def served_rounds(transports: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--rounds`` rounds of :func:`served_run` per transport, the order reversed every other round
    (the first group a process starts runs slower); per transport the median tokens/s and step."""
    runs: dict[str, list[dict[str, Any]]] = {transport: [] for transport in transports}
    for round_index in range(args.rounds):
        for transport in transports if round_index % 2 == 0 else transports[::-1]:
            result = served_run(transport, args.clients, args.max_tokens)
            runs[transport].append(result)
            print(f"  served, round {round_index}, {transport}: {result['tokens_per_second']:.1f} tok/s, median step "
                  f"{result['step_ms']:.1f} ms, moving rows {result['moving_ms']:.2f} ms (transport {result['transport']}, "
                  f"fallbacks {result['fallbacks']})")
    same = len({str(result["tokens"]) for results in runs.values() for result in results}) == 1
    print(f"  seeded tokens identical across transports and rounds: {same}")
    return {transport: {"tokens": results[0]["tokens"] if same else None,
                        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in results),
                        "step_ms": statistics.median(r["step_ms"] for r in results),
                        "moving_ms": statistics.median(r["moving_ms"] for r in results)}
            for transport, results in runs.items()}


def _record(case: str, argv: list[str] | None, hops: dict[str, float], served: dict[str, dict[str, Any]], args) -> None:
    """Write the figures into the results store (``--record CASE``), in the micro-benchmarks' section."""
    import shlex
    import sys

    from benchmarks.reports.store import make_record
    from benchmarks.reports.tables import update

    words = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.micro.row_transport " + " ".join(shlex.quote(w) for w in words)
    rows = []
    for path, transport in (("object store", "object_store"), ("gloo", "gloo")):
        row = {"rows via": path, "hop ms": round(hops[path] - hops["tokens only"], 1)}
        if transport in served:
            row["served ms"] = round(served[transport]["moving_ms"], 1)
            row["tok/s"] = round(served[transport]["tokens_per_second"], 1)
        rows.append(row)
    title = f"Draft rows, separate workers, sd gamma {args.gamma} @{args.clients}, {hops['bytes'] / 1024:,.0f} KiB/step"
    notes = None
    if served:
        same = all(r["tokens"] is not None for r in served.values()) and len({str(r["tokens"]) for r in served.values()}) == 1
        load = os.getloadavg()[0]
        notes = f"Tokens identical; {args.rounds} interleaved rounds; loadavg {load:.0f}." if same else "Tokens DIFFER."
    record = make_record(case, title, command, rows, notes=notes, section="Micro-benchmarks")
    print(f"recorded {update(record)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096, help="4096: the embedded family; 151936: the real shape.")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--served", action="store_true", help="Also serve the embedded family under each transport.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="--served: rounds per transport, interleaved.")
    parser.add_argument("--transports", default="object_store,gloo", help="--served: the transports, in this order.")
    parser.add_argument("--record", default=None, metavar="CASE", help="Write the figures into the results store.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import ray

    from cluster.serving.bringup import init_ray

    init_ray()
    try:
        hops = measure_hops(args.clients, args.gamma, args.vocab, args.repeats)
        print(f"{args.clients} clients, gamma {args.gamma}, vocab {args.vocab}: rows {hops['bytes'] / 1024:.0f} KiB per step")
        for path in ("tokens only", "object store", "gloo"):
            moving = "" if path == "tokens only" else f", moving rows {hops[path] - hops['tokens only']:.2f} ms"
            print(f"  {path:12s} chain {hops[path]:.2f} ms{moving}")
        served = served_rounds(args.transports.split(","), args) if args.served else {}
        if args.record:
            _record(args.record, argv, hops, served, args)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
