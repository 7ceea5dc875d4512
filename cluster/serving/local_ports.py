"""Free TCP ports on 127.0.0.1 for servers started by the benchmarks and the tests.

A port taken from the kernel's ephemeral range (binding port 0) is free when it is chosen, but
the Ray processes a server then starts bind port 0 themselves (the dashboard's and the agents'
listeners), and the kernel may hand one of them the port just chosen: Serve's proxy then fails
to bind its HTTP or gRPC port ("Address already in use") and start-up stalls. Ports below the
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) are never handed out that way.
"""

from __future__ import annotations

import pathlib
import random
import socket

EPHEMERAL_RANGE_PATH = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # above the well-known and registered ports servers usually take


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE_PATH.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_local_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now, below the ephemeral range (held open
    together while choosing, so none is chosen twice). Raises ``RuntimeError`` when fewer are free."""
    rng = rng or random.Random()
    lowest, end = LOWEST_PORT, ephemeral_start()
    if end - lowest < 1000:  # an unusual range: fall back to the kernel's choice
        return _kernel_ports(count)
    held: list[socket.socket] = []
    try:
        for port in rng.sample(range(lowest, end), min(end - lowest, 50 * count)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            held.append(sock)
            if len(held) == count:
                return [s.getsockname()[1] for s in held]
        raise RuntimeError(f"found only {len(held)} of {count} free ports in [{lowest}, {end})")
    finally:
        for sock in held:
            sock.close()


def _kernel_ports(count: int) -> list[int]:
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
