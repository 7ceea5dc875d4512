"""A step's draft rows held apart from its payloads, for Ray Direct Transport (RDT).

On the object-store path (:mod:`actors.coordination.worker_calls`) a proposing worker's payloads
(:class:`~verifiers.machines.needs.Sampled`, tokens and logits) are pickled into Ray's object
store and copied out by the verifying worker. With RDT the proposing call keeps its payloads'
logits back (:func:`hold_rows`: one flat tensor and where each payload's rows lie in it), its
payloads carry tokens only, and a one-return call (``take_rows``, ``tensor_transport`` "gloo"
or "nccl") hands the held tensor to the verifying call as a top-level argument, which Ray moves
sender to receiver over the collective group (Gloo: CPU tensors; NCCL: device tensors).
:func:`attach_rows` puts the rows back into the payloads, as views of the received tensor:
values, dtype and shape unchanged, so every rule reads what it read before.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from verifiers.machines.needs import Sampled

#: Held rows a worker keeps at most (the oldest dropped): a coordinator takes each right after its call.
MAX_HELD = 8

#: ``layout[j]``: where payload j's logits lie in the flat rows, ``(offset, shape)``, or None (kept in the payload).
Layout = list[tuple[int, tuple[int, ...]] | None]


def empty_rows() -> tuple[Layout, torch.Tensor]:
    """What a call with nothing held hands over: no layout, no rows."""
    return [], torch.empty(0)


def hold_rows(payloads: Sequence[Any], device: str = "cpu") -> tuple[list[Any], tuple[Layout, torch.Tensor]]:
    """``payloads`` with the logits of every :class:`Sampled` taken out, and ``(layout, rows)``:
    ``rows`` ``[N]`` the taken logits flattened end to end (the first one's dtype; logits of
    another dtype stay in their payload), on ``device`` (where the transport reads: a GPU for
    NCCL)."""
    layout: Layout = []
    parts: list[torch.Tensor] = []
    kept: list[Any] = []
    offset, dtype = 0, None
    for payload in payloads:
        logits = payload.logits if type(payload) is Sampled else None
        if logits is None or (dtype is not None and logits.dtype != dtype):
            layout.append(None)
            kept.append(payload)
            continue
        dtype = logits.dtype
        layout.append((offset, tuple(logits.shape)))  # [K, n, V]
        parts.append(logits.reshape(-1))
        offset += logits.numel()
        kept.append(dataclasses.replace(payload, logits=None))
    if not parts:
        return kept, empty_rows()
    return kept, (layout, torch.cat(parts).to(device))


def attach_rows(payloads: Sequence[Any], held: tuple[Layout, torch.Tensor], device: str = "cpu") -> list[Any]:
    """``payloads`` (a list from :func:`hold_rows`) with their logits back from ``held``, moved to
    ``device`` (where the verifier builds its rows: the host today); a payload that failed (an
    error outcome, no logits taken) is left as it is."""
    layout, rows = held
    if not layout:
        return list(payloads)
    if len(layout) != len(payloads):
        raise ValueError(f"held rows for {len(layout)} payloads, the source call returned {len(payloads)}")
    rows = rows.to(device)
    restored = []
    for payload, place in zip(payloads, layout):
        if place is None:
            restored.append(payload)
            continue
        offset, shape = place
        count = 1
        for size in shape:
            count *= size
        restored.append(dataclasses.replace(payload, logits=rows[offset: offset + count].view(shape)))
    return restored


def rows_nbytes(held: tuple[Layout, torch.Tensor]) -> int:
    """Bytes of the held rows."""
    return held[1].numel() * held[1].element_size()


class HeldRows:
    """A worker's held rows by key, until the coordinator's ``take_rows`` call takes them."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, tuple[Layout, torch.Tensor]] = OrderedDict()
        self.taken = 0  # held rows handed over

    def keep(self, key: str, held: tuple[Layout, torch.Tensor]) -> None:
        self._held[key] = held
        while len(self._held) > MAX_HELD:
            self._held.popitem(last=False)

    def take(self, key: str) -> tuple[Layout, torch.Tensor]:
        """The rows held under ``key`` (none: the call failed before holding any)."""
        held = self._held.pop(key, None)
        if held is None:
            return empty_rows()
        self.taken += 1
        return held
