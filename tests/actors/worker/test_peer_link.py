"""The direct link a burst uses to call a peer worker on its node (actors/worker/peer_link.py)."""

from __future__ import annotations

import threading
from multiprocessing import AuthenticationError

import pytest

from actors.worker.peer_link import PeerLink, PeerLinkAddress, PeerLinkError, PeerLinkServer


def _echo(items):
    return [("seen", item) for item in items], list(reversed(items))


def test_a_call_returns_what_the_handler_returns():
    server = PeerLinkServer(_echo, node_id="n1")
    link = PeerLink(server.address)
    try:
        for round_ in range(3):  # one connection, calls in order
            call = link.submit([round_, "a", {"k": round_}])
            assert call.result() == ([("seen", round_), ("seen", "a"), ("seen", {"k": round_})],
                                     [{"k": round_}, "a", round_])
        assert server.calls == 3
        assert server.address.node_id == "n1"
    finally:
        link.close()
        server.close()


def test_a_handler_error_reaches_the_caller_and_the_link_keeps_working():
    def handler(items):
        if items == ["boom"]:
            raise ValueError("bad item")
        return _echo(items)

    server = PeerLinkServer(handler, node_id="")
    link = PeerLink(server.address)
    try:
        with pytest.raises(PeerLinkError, match="ValueError: bad item"):
            link.submit(["boom"]).result()
        assert not link.broken
        assert link.submit([1]).result() == ([("seen", 1)], [1])
    finally:
        link.close()
        server.close()


def test_a_client_without_the_key_is_refused_and_nothing_it_sends_is_run():
    ran = []

    def handler(items):
        ran.append(items)
        return _echo(items)

    server = PeerLinkServer(handler, node_id="")
    try:
        wrong = PeerLinkAddress(server.address.node_id, server.address.address, b"x" * 32)
        with pytest.raises(AuthenticationError):
            PeerLink(wrong)
        link = PeerLink(server.address)  # the listener still accepts a client with the key
        assert link.submit([7]).result() == ([("seen", 7)], [7])
        assert ran == [[7]]
        link.close()
    finally:
        server.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's SystemExit
def test_a_peer_that_goes_away_mid_call_fails_the_call_and_breaks_the_link():
    started, release = threading.Event(), threading.Event()

    def handler(items):
        started.set()
        release.wait(5)
        raise SystemExit  # the serving thread ends without replying, as a dying worker would

    server = PeerLinkServer(handler, node_id="")
    link = PeerLink(server.address)
    try:
        call = link.submit([1])
        assert started.wait(5)
        release.set()
        with pytest.raises(PeerLinkError, match="broke"):
            call.result()
        assert link.broken
    finally:
        link.close()
        server.close()


def test_one_call_in_flight_per_link_and_a_result_is_read_once():
    server = PeerLinkServer(_echo, node_id="")
    link = PeerLink(server.address)
    try:
        call = link.submit([1])
        with pytest.raises(PeerLinkError, match="in flight"):
            link.submit([2])
        assert call.result() == ([("seen", 1)], [1])
        with pytest.raises(PeerLinkError, match="already read"):
            call.result()
    finally:
        link.close()
        server.close()


def _serve_in_a_process(queue):
    server = PeerLinkServer(_echo, node_id="n")
    queue.put(server.address)
    threading.Event().wait(60)


def test_a_link_to_a_peer_process_that_died_fails_at_submit_so_the_burst_can_use_ray():
    """A worker that died (and was restarted by Ray) leaves its old link closed: sending on it
    raises at once (the burst then makes a Ray call) instead of failing a request later."""
    import multiprocessing
    import os
    import signal

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_serve_in_a_process, args=(queue,), daemon=True)
    process.start()
    try:
        link = PeerLink(queue.get(timeout=60))
        assert link.submit([1]).result() == ([("seen", 1)], [1])
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        with pytest.raises(PeerLinkError, match="closed"):
            link.submit([2])
        assert link.broken and not link.in_flight
    finally:
        if process.is_alive():
            process.kill()
