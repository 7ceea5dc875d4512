"""What one Ray hop costs on this machine: ``python -m benchmarks.served.ray_overhead``.

Measures, with no model work at all, the calls one ``sd`` iteration makes on separate actors:
a no-op actor call (from the driver and from an async coordinator actor), and the
coordinator's chain ``proposal_ref = draft.propose.remote(...)`` ->
``await target.score_and_verify.remote(proposal_ref)`` (and, for comparison, awaiting the
proposal in the coordinator and passing the value) with proposals of the sizes ``sd``
moves (float64 probability rows, 4096-token vocabulary, gamma 2 / 4 / 8); and a burst's hop, a
worker calling another for a draft payload, with torch's pickling and with the engine's
(:mod:`actors.wire`), and over the direct link bursts use between workers of one node
(:mod:`actors.worker.peer_link`). Medians of
``--repeats`` calls, logged (stderr). Starts its own local Ray instance.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

logger = logging.getLogger(__name__)

VOCAB = 4096


def _actors():
    import ray
    import torch

    from actors.messages import ItemOutcome
    from verifiers.machines import Sampled

    @ray.remote(num_cpus=0.25)
    class Worker:
        def noop(self) -> int:
            return 0

        def propose(self, numel: int) -> torch.Tensor:
            return torch.zeros(numel, dtype=torch.float64)

        def verify(self, rows: torch.Tensor) -> int:
            return int(rows.numel())

        def payload(self, as_sampled: bool):
            """A 4-token draft call's returns: (outcomes, payloads), float32 logits over VOCAB."""
            tokens, logits = torch.ones(1, 4, dtype=torch.int64), torch.zeros(1, 4, VOCAB)
            if as_sampled:  # the engine's own types: tensors cross as numpy (actors.wire)
                return [ItemOutcome(value=Sampled(tokens))], [Sampled(tokens, logits)]
            return [tokens], [(tokens, logits)]  # torch's own pickling

        def payload_items(self, items):
            """``payload`` as a peer link's handler: (outcomes, payloads) for the call's items."""
            return self.payload(True)

        def peer_link_address(self):
            from actors.worker.peer_link import PeerLinkServer

            self.link_server = PeerLinkServer(self.payload_items, ray.get_runtime_context().get_node_id())
            return self.link_server.address

        def call_peer_link_ms(self, peer, repeats: int) -> float:
            """The same hop over a direct link to ``peer`` (actors/worker/peer_link.py), sending one item."""
            from actors.worker.peer_link import PeerLink

            link = PeerLink(ray.get(peer.peer_link_address.remote()))
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                link.submit([("session", "need")]).result()
                times.append(time.perf_counter() - started)
            link.close()
            return 1e3 * statistics.median(times)

        def call_peer_ms(self, peer, as_sampled: bool, repeats: int) -> float:
            """A burst's hop: this worker calls ``peer.payload`` (2 returns) and waits for both."""
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                ray.get(list(peer.payload.options(num_returns=2).remote(as_sampled)))
                times.append(time.perf_counter() - started)
            return 1e3 * statistics.median(times)

    @ray.remote(num_cpus=0)
    class Coordinator:
        def __init__(self, draft, target):
            self.draft, self.target = draft, target

        async def noop_ms(self, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                await self.draft.noop.remote()
                times.append(time.perf_counter() - started)
            return 1e3 * statistics.median(times)

        async def chain_ms(self, numel: int, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                proposal_ref = self.draft.propose.remote(numel)
                await self.target.verify.remote(proposal_ref)
                times.append(time.perf_counter() - started)
            return 1e3 * statistics.median(times)

        async def awaited_chain_ms(self, numel: int, repeats: int) -> float:
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                proposal = await self.draft.propose.remote(numel)
                await self.target.verify.remote(proposal)
                times.append(time.perf_counter() - started)
            return 1e3 * statistics.median(times)

    return Worker, Coordinator


def measure(repeats: int = 200) -> dict[str, float]:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        worker_cls, coordinator_cls = _actors()
        draft, target = worker_cls.remote(), worker_cls.remote()
        coordinator = coordinator_cls.remote(draft, target)
        ray.get([draft.noop.remote(), target.noop.remote(), coordinator.noop_ms.remote(5)])
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            ray.get(draft.noop.remote())
            times.append(time.perf_counter() - started)
        results = {
            "driver -> actor no-op call": 1e3 * statistics.median(times),
            "coordinator -> actor no-op call": ray.get(coordinator.noop_ms.remote(repeats)),
        }
        for gamma in (0, 2, 4, 8):
            numel = max(1, gamma * VOCAB)
            label = f"coordinator: draft -> target ObjectRef chain, {numel * 8 // 1024} KB of rows (gamma {gamma})"
            results[label] = ray.get(coordinator.chain_ms.remote(numel, repeats // 2))
            label = f"coordinator: await draft, then target with the value, {numel * 8 // 1024} KB (gamma {gamma})"
            results[label] = ray.get(coordinator.awaited_chain_ms.remote(numel, repeats // 2))
        for as_sampled in (False, True):
            label = ("worker -> worker call returning a 4-token draft payload (64 KB float32), "
                     + ("engine types, tensors as numpy" if as_sampled else "torch tensors"))
            results[label] = ray.get(target.call_peer_ms.remote(draft, as_sampled, repeats))
        label = "worker -> worker over the direct peer link (actors/worker/peer_link.py), the same payload"
        results[label] = ray.get(target.call_peer_link_ms.remote(draft, repeats))
        return results
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Latency of the Ray calls one sd iteration makes.")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for label, value in measure(args.repeats).items():
        logger.info("%-80s %6.2f ms", label, value)


if __name__ == "__main__":
    main()
