"""Prefix caching: a new session starts from keys/values the worker already holds.

Every cache slot's columns ``[0, n)`` hold the keys/values of some token sequence: a live
session's committed linear part (``context[:base]``, :mod:`actors.worker.sessions`), or what a
parked record's slot holds (nothing writes a free slot). A new session's prompt is matched
against all of them; the longest common prefix, at most the prompt minus its last token (which
always stays pending, so the first forward still yields the next row), is given to the new
session's slot instead of being computed again: its full blocks shared by reference count, the
last partial one copied (:meth:`actors.model.kv_cache.PagedKVCache.copy_prefix`; a later write
into a shared block copies it first). A causal LM's key/value at column ``j`` is a function of
tokens ``0..j`` at positions ``0..j`` alone, so the shared entries are what a prefill would
compute (up to the float rounding of a different batch shape, as for any batched row); the
tests compare rows after a reuse with a fresh prefill.

Released slots are *parked*: what a released session's slot holds is shared with the free slot
with no record (highest first) or with the least recently used record, never the lowest free
slot while there is another, away from the low slots that new sessions get. A parked record
lives until its slot is handed out or the pool takes its blocks back (it then holds fewer
columns: :meth:`~actors.model.kv_cache.PagedKVCache.held_columns`); a record that another
record already contains is not parked twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from actors.worker.sessions import common_prefix

#: Prefixes shorter than this are computed, not copied (the copy and the search would cost
#: about what a few tokens of prefill cost).
MIN_REUSE_TOKENS = 16


class PrefixCache:
    """Hands out cache slots, each with the longest prefix of its prompt the worker already holds.

    ``backend`` has ``allocate()``, ``free(slot)``, ``free_slots()`` and
    ``copy_prefix(src_slot, dst_slot, length)`` (:class:`actors.model.backends.SlotBackend`). With
    ``enabled=False`` it only allocates and frees.
    """

    def __init__(self, backend: Any, *, enabled: bool = True, min_tokens: int = MIN_REUSE_TOKENS):
        self.backend = backend
        self.enabled = bool(enabled)
        self.min_tokens = max(1, int(min_tokens))
        # free slot -> the tokens its columns [0, n) hold; least recently parked or reused first
        self.records: dict[int, tuple[int, ...]] = {}
        self.reused_tokens_total = 0  # prompt tokens copied instead of computed
        self.prompt_tokens_total = 0  # prompt tokens of every session opened

    def open(
        self, prompt: Sequence[int], live: Iterable[tuple[int, Sequence[int]]] = (), *, reuse: bool = True
    ) -> tuple[int, int]:
        """A slot for a new session with ``prompt`` -> ``(slot, reused)``: columns ``[0, reused)``
        of ``slot`` hold ``prompt[:reused]``. ``live``: ``(slot, held tokens)`` of the open
        sessions, whose held columns may be copied too. ``reuse=False``: copy nothing (a session
        that needs the logits of every prompt position computes them all)."""
        self.prompt_tokens_total += len(prompt)
        donor, length = self._best_donor(prompt, live) if self.enabled and reuse else (None, 0)
        slot = self.backend.allocate()
        self.records.pop(slot, None)
        self.backend.truncate(slot, length if donor == slot else 0)  # its stale blocks go back
        if donor is None:
            return slot, 0
        if donor != slot:
            self.backend.copy_prefix(donor, slot, length)
        if donor in self.records:
            self.records[donor] = self.records.pop(donor)  # now the most recently used
        self.reused_tokens_total += length
        return slot, length

    def release(self, slot: int, held: Sequence[int]) -> None:
        """Free ``slot``, whose columns ``[0, len(held))`` hold ``held``; park that record."""
        self.backend.free(slot)
        held = tuple(int(t) for t in held)
        parking = self._parking_slot(held)
        if parking is not None and parking != slot:
            self.backend.copy_prefix(slot, parking, len(held))  # shares its full blocks
        self.backend.truncate(slot, len(held) if parking == slot else 0)
        if parking is not None:
            self.records.pop(parking, None)
            self.records[parking] = held  # the most recently used

    def _best_donor(self, prompt: Sequence[int], live: Iterable[tuple[int, Sequence[int]]]) -> tuple[int | None, int]:
        """The slot holding the longest prefix of ``prompt`` (capped at all but its last token)."""
        limit = len(prompt) - 1
        donor, best = None, self.min_tokens - 1
        for slot, held in itertools.chain(self.records.items(), live):
            length = common_prefix(held[: min(limit, self.backend.held_columns(slot))], prompt)
            if length > best:
                donor, best = slot, length
        return (donor, best) if donor is not None else (None, 0)

    def _parking_slot(self, held: tuple[int, ...]) -> int | None:
        """Where to park ``held`` (None: not worth it, or already held by a record): a free slot
        without a record (highest first), else the least recently used record's; never the
        lowest free slot while there is another (it is the next one handed out)."""
        if not self.enabled or len(held) < self.min_tokens:
            return None
        if any(record[: len(held)] == held for record in self.records.values()):
            return None  # already held by a parked record
        free = self.backend.free_slots()  # lowest first
        candidates = free[1:] or free
        empty = [slot for slot in candidates if slot not in self.records]
        if empty:
            return max(empty)
        return next((slot for slot in self.records if slot in candidates), None)
