"""A direct link between two model workers on one node: a burst's per-iteration peer call.

In a solo burst (:mod:`actors.worker.bursts`) the target's worker calls the draft's worker once per
iteration. As a Ray actor call that hop costs about 1 ms each way on a small CPU node (task
submission, scheduling on the callee, the return through the owner), paid on every iteration's
critical path. Between two workers of one node the burst instead sends the call over a Unix
domain socket to a thread of the peer worker that runs the same :meth:`WorkerEngine.run_step`
(``docs/design.md``, solo bursts): the request is one pickled message, the reply the same
``(outcomes, payloads)`` a Ray call returns.

* **Authenticated.** The listener accepts only clients that answer an HMAC challenge with its
  32-byte random key (``multiprocessing.connection``), and the key is only handed out through
  the worker's Ray method :meth:`actors.worker.model_worker.ModelWorker.peer_link_address`; nothing is
  unpickled before that handshake.
* **Blocking, not polling.** Both ends wait in ``recv`` on the socket (no CPU while idle).
  Ray Compiled Graphs were measured for this hop and not taken: their reader spins a core while
  idle, one of the two this node has.
* **Same failure semantics.** A peer that dies closes the socket: the waiting call raises
  :class:`PeerLinkError`, which the burst reports like a failed Ray call (retryable), and the
  link is dropped. Work the peer's thread runs is serialized with its Ray calls by the engine's
  session lock, as with the session reaper.
* **Not with pre-drafting.** A PreDraft's payloads must outlive the burst (the scheduler hands
  their ObjectRef to the next step), and it must run after the same iteration's Sample on the
  draft, which only Ray's per-caller order guarantees: bursts of a request with pre-drafting
  make Ray calls only.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

logger = logging.getLogger(__name__)

#: Handles one call: the items of a peer's ``run_step`` -> ``(outcomes, payloads)``.
StepHandler = Callable[[Sequence[Any]], tuple[list[Any], list[Any]]]


class PeerLinkError(RuntimeError):
    """The peer could not run the call (it raised, or the link broke)."""


@dataclass(frozen=True)
class PeerLinkAddress:
    """Where a worker listens: its Ray node, the socket's address, and the key that opens it."""

    node_id: str
    address: str
    authkey: bytes


def _socket_address() -> str:
    """A fresh Unix socket address: Linux's abstract namespace (nothing on disk to clean up),
    elsewhere a path in a private temporary directory."""
    if sys.platform.startswith("linux"):
        return f"\0specserve-peer-{os.getpid()}-{uuid.uuid4().hex}"
    return os.path.join(tempfile.mkdtemp(prefix="specserve-"), "peer.sock")


class PeerLinkServer:
    """The listening end, in the worker that is called: one thread accepts, one thread per
    connection runs its calls through ``handler`` in order."""

    def __init__(self, handler: StepHandler, node_id: str):
        self.handler = handler
        self.authkey = os.urandom(32)
        self.listener = Listener(_socket_address(), family="AF_UNIX", authkey=self.authkey)
        self.address = PeerLinkAddress(node_id, self.listener.address, self.authkey)
        self.calls = 0
        thread = threading.Thread(target=self._accept_forever, name="peer-link-accept", daemon=True)
        thread.start()

    def _accept_forever(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except OSError:  # closed
                return
            except Exception as error:  # noqa: BLE001 - a client that failed the handshake
                logger.warning("peer link: refused a connection (%s)", type(error).__name__)
                continue
            threading.Thread(target=self._serve, args=(connection,), name="peer-link", daemon=True).start()

    def _serve(self, connection: Connection) -> None:
        with connection:
            while True:
                try:
                    items = pickle.loads(connection.recv_bytes())
                except (EOFError, OSError):  # the caller went away
                    return
                try:
                    reply: tuple[str, Any] = ("ok", self.handler(items))
                except Exception as error:  # noqa: BLE001 - reported to the caller, like a failed Ray call
                    reply = ("error", f"{type(error).__name__}: {error}")
                self.calls += 1
                try:
                    connection.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                except OSError:
                    return

    def close(self) -> None:
        self.listener.close()


class PeerLink:
    """The calling end: one connection to a peer's :class:`PeerLinkServer`, one call in flight."""

    def __init__(self, address: PeerLinkAddress):
        self.connection = Client(address.address, family="AF_UNIX", authkey=address.authkey)
        self.in_flight = False
        self.broken = False

    def submit(self, items: Sequence[Any]) -> LinkCall:
        """Send one call; its reply is read by :meth:`LinkCall.result`."""
        if self.in_flight:
            raise PeerLinkError("a call is already in flight on this link")
        try:
            self.connection.send_bytes(pickle.dumps(list(items), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as error:
            self.broken = True
            raise PeerLinkError(f"the peer link is closed ({type(error).__name__})") from error
        self.in_flight = True
        return LinkCall(self)

    def _reply(self) -> tuple[list[Any], list[Any]]:
        try:
            status, value = pickle.loads(self.connection.recv_bytes())
        except (EOFError, OSError) as error:
            self.broken = True
            raise PeerLinkError(f"the peer link broke ({type(error).__name__})") from error
        finally:
            self.in_flight = False
        if status != "ok":
            raise PeerLinkError(value)
        return value

    def close(self) -> None:
        self.broken = True
        self.connection.close()


class LinkCall:
    """A call sent on a :class:`PeerLink`; :meth:`result` waits for its ``(outcomes, payloads)``."""

    def __init__(self, link: PeerLink):
        self.link = link
        self.done = False

    def result(self) -> tuple[list[Any], list[Any]]:
        if self.done:
            raise PeerLinkError("this call's result was already read")
        self.done = True
        return self.link._reply()
