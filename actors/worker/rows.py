"""The one logits -> rows path of a worker: the shared vocabulary, the request's penalties, then
temperature / top-k / top-p (:func:`verifiers.penalties.penalized_probs`, over the one sampling path
:func:`verifiers.sampling.logits_to_probs`), on the host, which is where the verifiers run, in the
request's precision (``RowSampling.precision``: float64, or float32 where ``engine.sampling_precision``
settles so; draws and single-draft verification keep it).
"""

from __future__ import annotations

import torch

from actors.worker.sessions import Session
from verifiers.penalties import penalized_probs


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
