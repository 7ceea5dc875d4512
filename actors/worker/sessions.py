"""Sessions of a model worker: one per request, each owning one KV cache slot.

A session holds the request's committed context (prompt + final tokens) and what its cache slot
holds: columns ``[0, base)`` hold the keys/values of ``context[:base]`` (the *linear* part);
after it, up to K *chains* of tokens that were fed but are not committed (drafts, queued
ensemble tokens) laid out chain-major: token ``j`` of chain ``k`` at column
``chain_start + k * chain_stride + j``, at rotary position ``chain_start + j``.

:meth:`Session.sync` commits the tokens a step brings and finds what the slot already holds:
the chain that agrees longest with the new context is kept (its entries are copied to the
columns right after the linear part unless it is chain 0, which is already there) and everything
else is forgotten by lowering ``base``: rollback is a length change, never a copy of the prefix,
and nothing committed is ever recomputed. The last committed token is always left unfed
(*pending*), so every call feeds at least one token and gets the row of the next position.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.messages import RowSampling
from verifiers.randomness import TorchRandomSource

logger = logging.getLogger(__name__)

#: How long the state of a reaped session is kept for its request to come back: the longest
#: ``limits.request_timeout_s``, which bounds how long the coordinator holds a request paused.
PARKED_TTL_S = 86400.0


class SessionNotFoundError(KeyError):
    """The session does not exist (never opened, released, failed, or expired)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


@dataclass
class Session:
    """One request's state on one worker (see the module docstring for the slot layout)."""

    session_id: str
    slot: int
    context: list[int]
    sampling: RowSampling
    sources: dict[str, TorchRandomSource]
    prompt_length: int = 0
    base: int = 0
    chain_start: int = 0
    chain_stride: int = 0
    chains: list[list[int]] = field(default_factory=list)
    verify_state: Any = None
    last_draft: list[int] = field(default_factory=list)  # draft 0 of the last Sample (a PreDraft's block)
    last_used: float = field(default_factory=time.monotonic)
    tokens_fed: int = 0
    forward_calls: int = 0
    #: Whether a drafted chain the new context agrees with is kept (False: an EAGLE-3 head, whose
    #: committed positions read the target's states, not its own, :mod:`actors.model.eagle3_serving`).
    keep_chains: bool = True

    def generated(self) -> list[int]:
        """The committed tokens after the prompt (what penalties count)."""
        return self.context[self.prompt_length:]

    def source(self, stream: str) -> TorchRandomSource:
        source = self.sources.get(stream)
        if source is None:
            raise ValueError(f"session {self.session_id!r} owns no random stream {stream!r}")
        return source

    def sync(self, append: tuple[int, ...] | list[int], copy_columns: Callable[[int, list[int], list[int]], None]) -> list[int]:
        """Commit ``append``, keep what the slot holds of the context, return the pending tokens
        (committed, not yet fed; at least one). ``copy_columns(slot, src, dst)`` moves a kept
        chain's entries next to the linear part."""
        self.context.extend(int(t) for t in append)
        self.base = min(self.base, len(self.context))
        if self.chains and self.base == self.chain_start and self.keep_chains:
            self._keep_best_chain(copy_columns)
        self.chains = []
        self.base = min(self.base, len(self.context) - 1)
        return self.context[self.base:]

    def _keep_best_chain(self, copy_columns: Callable[[int, list[int], list[int]], None]) -> None:
        uncached = self.context[self.base:]
        matches = [common_prefix(chain, uncached) for chain in self.chains]  # per chain
        best = max(range(len(matches)), key=lambda k: matches[k])
        kept = matches[best]
        if kept and best:
            src = [self.chain_start + best * self.chain_stride + j for j in range(kept)]
            copy_columns(self.slot, src, [self.base + j for j in range(kept)])
        self.base += kept


class SessionStore:
    """Sessions by id, each with a slot from ``slots`` (an :class:`actors.worker.prefix_cache.PrefixCache`:
    a new session starts with the longest prefix of its prompt the worker already holds), and an
    idle reaper thread freeing the slots of sessions unused for ``idle_timeout_s``.

    A reaped session is *parked*, not forgotten: its slot goes back (its prefix cached) but its
    committed context and random streams stay, since its request may only be paused by the
    coordinator (preempted for KV blocks) while it waits to run again. Its next call resumes it
    on a new slot, which recomputes what no cached prefix holds and draws the tokens it would
    have drawn. A parked session is dropped when released or after :data:`PARKED_TTL_S`."""

    def __init__(self, slots: Any, idle_timeout_s: float, name: str):
        self.slots = slots
        self.idle_timeout_s = float(idle_timeout_s)
        self.name = name
        self._sessions: dict[str, Session] = {}
        self._parked: dict[str, tuple[Session, float]] = {}  # reaped: (session, time.monotonic() when parked)
        self.lock = threading.RLock()

    def open(
        self, session_id: str, prompt_ids: list[int], sampling: RowSampling, seeds: dict[str, int], reuse: bool = True
    ) -> Session:
        """Open a session on the slot holding the longest cached prefix of its prompt (none
        with ``reuse=False``)."""
        import torch

        with self.lock:
            if session_id in self._sessions or session_id in self._parked:
                raise ValueError(f"session {session_id!r} already open on {self.name}")
            if not prompt_ids:
                raise ValueError("prompt_ids must not be empty")
            sources = {stream: TorchRandomSource(torch.Generator().manual_seed(int(seed))) for stream, seed in seeds.items()}
            prompt = [int(t) for t in prompt_ids]
            live = ((other.slot, other.context[: other.base]) for other in self._sessions.values())
            slot, reused = self.slots.open(prompt, live, reuse=reuse)
            session = Session(session_id, slot, prompt, sampling, sources, prompt_length=len(prompt), base=reused,
                              keep_chains=getattr(getattr(self.slots, "backend", None), "keeps_chains", True))
            self._sessions[session_id] = session
            return session

    def get(self, session_id: str) -> Session:
        with self.lock:
            session = self._sessions.get(session_id)
            if session is None and session_id in self._parked:
                session = self._resume(session_id)
            if session is None:
                raise SessionNotFoundError(f"no session {session_id!r} on worker {self.name!r}")
            session.last_used = time.monotonic()
            return session

    def _resume(self, session_id: str) -> Session:
        """Reopen parked ``session_id`` on a slot holding the longest cached prefix of its context
        (columns past it are recomputed by its next call: its pending tokens)."""
        session, _ = self._parked.pop(session_id)
        live = ((other.slot, other.context[: other.base]) for other in self._sessions.values())
        session.slot, session.base = self.slots.open(session.context, live)
        session.chains = []
        self._sessions[session_id] = session
        logger.info("%s: resumed parked session %s (%d of %d tokens cached)", self.name, session_id,
                    session.base, len(session.context))
        return session

    def peek(self, session_id: str) -> Session | None:
        """The open session ``session_id`` or None, leaving it as it is (not resumed, not touched)."""
        with self.lock:
            return self._sessions.get(session_id)

    def at_slot(self, slot: int) -> Session | None:
        """The open session on cache slot ``slot``, or None."""
        with self.lock:
            return next((session for session in self._sessions.values() if session.slot == slot), None)

    def release(self, session_id: str) -> bool:
        """Free a session and its slot (or forget a parked one); True if it existed."""
        with self.lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self.slots.release(session.slot, session.context[: session.base])
            return session is not None or self._parked.pop(session_id, None) is not None

    def idle(self, before: float) -> list[Session]:
        """Open sessions last used before ``before`` (``time.monotonic``), least recently used first."""
        with self.lock:
            return sorted((s for s in self._sessions.values() if s.last_used < before), key=lambda s: s.last_used)

    def ids(self) -> list[str]:
        with self.lock:
            return sorted(self._sessions)

    def __len__(self) -> int:
        with self.lock:
            return len(self._sessions)

    def parked(self) -> list[str]:
        """Ids of the parked (reaped, resumable) sessions."""
        with self.lock:
            return sorted(self._parked)

    def reap_idle(self) -> list[str]:
        """Park the sessions idle for longer than ``idle_timeout_s`` (their slots freed, see the
        class doc) and drop those parked for longer than :data:`PARKED_TTL_S`; returns the ids parked."""
        now = time.monotonic()
        with self.lock:
            expired = [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout_s]
            for session_id in expired:
                session = self._sessions.pop(session_id)
                self.slots.release(session.slot, session.context[: session.base])
                session.slot, session.base, session.chains = -1, 0, []
                self._parked[session_id] = (session, now)
            for session_id in [sid for sid, (_, when) in self._parked.items() if now - when > PARKED_TTL_S]:
                del self._parked[session_id]
        if expired:
            logger.warning("%s: freed the slots of %d idle sessions (parked, resumable): %s", self.name, len(expired), expired)
        return expired
