"""The one logits -> rows path of a worker: the shared vocabulary, the request's penalties, then
temperature / top-k / top-p (:func:`verifiers.penalties.penalized_probs`, over the one sampling path
:func:`verifiers.sampling.logits_to_probs`), on the host, which is where the verifiers run, in the
request's precision (``RowSampling.precision``: float64, or float32 where ``engine.sampling_precision``
settles so; draws and single-draft verification keep it). A step's rows are made together
(:func:`rows_together`: one transform per settings group, each request's rows those of its own call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actors.worker.sessions import Session
from verifiers.penalties import Penalties, penalized_probs
from verifiers.sampling import check_logits, widens_exactly


def session_rows(session: Session, logits: torch.Tensor, after: list[list[int]],
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """The one logits -> rows path of a worker: shared-vocabulary truncation, then the request's
    penalties (row ``i`` penalized with the generated tokens followed by ``after[i]``, the
    uncommitted tokens before its position) and temperature / top-k / top-p
    (:func:`verifiers.penalties.penalized_probs`), in ``dtype`` (default: the request's
    ``RowSampling.precision``)."""
    sampling = session.sampling
    generated = None
    if sampling.penalties.active:
        committed = session.generated()
        generated = [committed + list(tokens) for tokens in after]
    return penalized_probs(
        shared_vocab(session, logits), temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        penalties=sampling.penalties, prompt=session.context[: session.prompt_length], generated=generated,
        dtype=dtype if dtype is not None else row_dtype(sampling.precision),
    )


def row_dtype(precision: str) -> torch.dtype:
    """``RowSampling.precision`` ("float64" / "float32") -> the torch dtype of the rows."""
    if precision not in ("float64", "float32"):
        raise ValueError(f"RowSampling.precision must be 'float64' or 'float32', got {precision!r}")
    return getattr(torch, precision)


def shared_vocab(session: Session, logits: torch.Tensor) -> torch.Tensor:
    limit = session.sampling.vocab_limit
    return logits if limit is None else logits[..., :limit]

#: The largest tensor a step's rows and verification make at once: glibc maps a fresh block (whose
#: pages the kernel faults in and zeroes on every step) for anything above its largest mmap
#: threshold, 32 MiB (``actors.worker.allocator``), so larger batches are cut into runs below it.
STEP_TENSOR_BYTES = 16 << 20


@dataclass(frozen=True)
class RowRequest:
    """One call of :func:`session_rows` to make: ``session``'s rows of ``logits [..., V]`` (row ``i``
    after the uncommitted tokens ``after[i]``), in ``dtype`` (default: the request's precision)."""

    session: Session
    logits: torch.Tensor
    after: list[list[int]]
    dtype: torch.dtype | None = None

    def alone(self) -> torch.Tensor:
        """This request's rows by :func:`session_rows` alone."""
        return session_rows(self.session, self.logits, self.after, self.dtype)


def rows_together(requests: Sequence[RowRequest]) -> list[torch.Tensor]:
    """Many :func:`session_rows` calls, the rows of a step, in one transform per settings group:
    requests whose rows do not depend on their context (no active penalties) and share the
    temperature, top-k, top-p, min-p, precision, vocabulary and device are stacked ``[N, V]`` (in
    request order, so each request's rows are a view of its group's) and transformed by ONE
    :func:`verifiers.penalties.penalized_probs` call where the logits are; any other request is
    :meth:`RowRequest.alone`. Each request gets the rows its own call gives (the transform works
    row by row), so a request's rows do not depend on the requests beside it."""
    rows: list[torch.Tensor | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
        key = _group_key(request)
        if key is None:
            rows[index] = request.alone()
        else:
            groups.setdefault(key, []).append(index)
    for (temperature, top_k, top_p, min_p, dtype, vocab, _), group in groups.items():
        row_bytes = vocab * dtype.itemsize
        for members in byte_chunks(group, [requests[i].logits[..., 0].numel() * row_bytes for i in group]):
            if len(members) == 1:
                rows[members[0]] = requests[members[0]].alone()
            else:
                _transform_together([requests[i] for i in members], members, rows,
                                    (temperature, top_k, top_p, min_p, dtype, vocab))
    return rows  # type: ignore[return-value]


def byte_chunks(keys: Sequence[Any], sizes: Sequence[int], budget: int = STEP_TENSOR_BYTES) -> list[list[Any]]:
    """``keys`` in order, cut into runs whose ``sizes`` (bytes) sum to at most ``budget`` (a key
    larger than it runs alone)."""
    chunks: list[list[Any]] = []
    total = budget + 1
    for key, size in zip(keys, sizes):
        if total + size > budget:
            chunks.append([])
            total = 0
        chunks[-1].append(key)
        total += size
    return chunks


def _transform_together(requests: Sequence[RowRequest], members: list[int], rows: list[torch.Tensor | None],
                        settings: tuple) -> None:
    """The rows of ``requests`` (of one settings group) in ONE transform, each request's a view
    stored at ``rows[members[i]]``."""
    temperature, top_k, top_p, min_p, dtype, vocab = settings
    flat = [shared_vocab(request.session, request.logits).reshape(-1, vocab) for request in requests]  # [n_i, V]
    stacked = torch.empty(sum(len(x) for x in flat), vocab, dtype=dtype, device=flat[0].device)  # [N, V]
    offsets = [0]
    widening = all(widens_exactly(logits.dtype, dtype) for logits in flat)
    for logits in flat:
        if widening:  # checked before the conversion, on the narrower tensor
            check_logits(logits)
        stacked[offsets[-1]: offsets[-1] + len(logits)].copy_(logits)  # the dtype conversion .to(dtype) does
        offsets.append(offsets[-1] + len(logits))
    probs = penalized_probs(stacked, temperature=temperature, top_k=top_k, top_p=top_p,
                            penalties=Penalties(min_p=min_p), dtype=dtype, overwrite=True,
                            checked=widening)  # [N, V], in stacked
    for i, request, start, end in zip(members, requests, offsets, offsets[1:]):
        rows[i] = probs[start:end].reshape(*request.logits.shape[:-1], vocab)


def _group_key(request: RowRequest) -> tuple | None:
    """The settings a request's rows are transformed with, or None when they depend on its context
    (active penalties: made alone)."""
    sampling = request.session.sampling
    if sampling.penalties.active:
        return None
    logits = request.logits
    limit = sampling.vocab_limit
    vocab = logits.shape[-1] if limit is None else min(limit, logits.shape[-1])
    dtype = request.dtype if request.dtype is not None else row_dtype(sampling.precision)
    return (sampling.temperature, sampling.top_k, sampling.top_p, sampling.penalties.min_p, dtype, vocab, logits.device)
