"""Free local ports for servers the benchmarks and tests start (cluster/serving/local_ports.py)."""

from __future__ import annotations

import random
import socket

from cluster.serving.local_ports import LOWEST_PORT, ephemeral_start, free_local_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_local_ports(9)
    assert len(set(ports)) == 9
    assert all(LOWEST_PORT <= port < ephemeral_start() for port in ports)
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in ports]
    try:
        for sock, port in zip(sockets, ports):
            sock.bind(("127.0.0.1", port))  # raises if another listener had it
    finally:
        for sock in sockets:
            sock.close()


def test_a_port_in_use_is_never_chosen() -> None:
    taken = free_local_ports(1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()

        class TakenFirst(random.Random):
            def sample(self, population, k):  # the held port comes up first
                return [taken] + [port for port in random.Random(0).sample(population, k) if port != taken]

        ports = free_local_ports(3, rng=TakenFirst())
    assert taken not in ports and len(set(ports)) == 3
