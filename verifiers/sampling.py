"""Logits -> probabilities, and drawing a token: the one sampling path of the project.

Every model in specserve (draft, target, ensemble member) turns logits into the probability
rows it samples from with :func:`logits_to_probs`, and verification compares exactly these
rows. Lossless speculative decoding is only lossless if the verifier sees the very
distribution the draft sampled from (post temperature / top-k / top-p), so this transformation
lives in one place.

Order of the transformation (documented contract):

1. temperature ``T``: ``T = 0`` is greedy: a one-hot row at the argmax of the logits (ties go
   to the lowest index), and top-k / top-p are irrelevant (the argmax always survives them).
   ``T > 0``: ``softmax(logits / T)``.
2. top-k (``top_k > 0``): keep the tokens whose logit is >= the k-th largest logit (ties at
   the boundary are all kept, so the rule does not depend on a sort order), renormalise.
3. min-p (``min_p > 0``, vLLM's) on the row left by top-k: keep the tokens whose probability
   is >= ``min_p`` times the row's largest, renormalise.
4. top-p (``top_p < 1``) on the row left by min-p: keep token ``v`` iff the mass of the tokens
   strictly more probable than ``v`` is < ``top_p`` (the smallest nucleus reaching ``top_p``,
   plus any tokens tied with its least probable member), renormalise.

``-inf`` logits are tokens with probability zero; a row whose logits are all ``-inf`` (or any
NaN / ``+inf``) is rejected. No epsilon is added anywhere.

Precision is a parameter (``dtype``): float64 by default, which is what the exactness harness
enumerates; float32 is what a worker on a GPU computes its rows in (``engine.sampling_precision``).
The same functions run either way, and every later step (draws, verification) keeps the rows'
precision (:data:`ROW_DTYPES`; ``tests/verifiers/test_precision.py`` bounds the float32 law
against the float64 one by exact enumeration).
"""

from __future__ import annotations

import torch

from verifiers.randomness import RandomSource, as_random_source


#: The precisions rows may be computed in: float64 (the default, and the exactness harness's) and
#: float32 (a GPU worker's).
ROW_DTYPES = (torch.float64, torch.float32)


def logits_to_probs(
    logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
    dtype: torch.dtype = torch.float64, overwrite: bool = False, checked: bool = False,
) -> torch.Tensor:
    """``logits [..., V]`` -> probability rows ``[..., V]`` in ``dtype`` (one of
    :data:`ROW_DTYPES`; see the module docstring).

    Does not modify ``logits`` unless ``overwrite`` (a caller's own contiguous scratch in ``dtype``,
    which then holds the rows). Each step works in place on a tensor of its own (the values are
    those of the out-of-place operations, bit for bit: the same kernels, element by element).
    ``checked``: the caller has passed the logits these were converted from through
    :func:`check_logits` (finiteness is not checked again).
    """
    _check_sampling_args(temperature, top_k, top_p, min_p)
    given = logits
    logits = _checked_logits(logits, dtype, checked)  # [..., V] in dtype
    if temperature == 0:
        return _argmax_one_hot(logits)
    owned = (overwrite or logits is not given) and logits.is_contiguous()  # ours to write over
    if temperature != 1:  # x / 1 is x, bit for bit
        logits = logits.div_(float(temperature)) if owned else logits / float(temperature)  # [..., V]
        owned = True
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill_(logits < kth_largest, float("-inf")) if owned else \
            logits.masked_fill(logits < kth_largest, float("-inf"))
        owned = True
    probs = _softmax(logits, owned)  # [..., V]
    if min_p > 0.0:
        floor = min_p * probs.amax(dim=-1, keepdim=True)  # [..., 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p < 1.0:
        probs = _nucleus(probs, float(top_p))
    return probs


def sample_token(probs: torch.Tensor, source: torch.Generator | RandomSource) -> torch.Tensor:
    """Draw one token per row of ``probs [..., V]`` -> int64 ``[...]`` through the source's
    ``categorical`` (so exact enumeration sees the draw)."""
    probs = torch.as_tensor(probs)
    if probs.dim() < 1 or probs.shape[-1] < 1:
        raise ValueError(f"probs must have shape [..., V] with V >= 1, got {tuple(probs.shape)}")
    if bool((probs < 0).any()) or not bool(torch.isfinite(probs).all()):
        raise ValueError("probs must be finite and non-negative")
    return as_random_source(source).categorical(probs)


def _check_sampling_args(temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (temperature >= 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"top_p must be a number, got {type(top_p).__name__}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)):
        raise TypeError(f"min_p must be a number, got {type(min_p).__name__}")
    if not (0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")


def _softmax(logits: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``torch.softmax`` over the last dim; ``in_place``: into ``logits`` itself (contiguous), the
    same kernel row by row (max, then exp and sum, then the scale, element for element), so the
    same values without a second ``[..., V]`` tensor."""
    if not in_place:
        return torch.softmax(logits, dim=-1)
    return torch._softmax(logits, -1, False, out=logits)


def _checked_logits(logits: torch.Tensor, dtype: torch.dtype = torch.float64, checked: bool = False) -> torch.Tensor:
    """``logits`` in ``dtype``, refused (:func:`check_logits`) unless every row is usable; a
    widening conversion (float32 -> float64) is exact, so the check reads the narrower tensor."""
    if dtype not in ROW_DTYPES:
        raise ValueError(f"rows are computed in float64 or float32, got {dtype}")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    widening = widens_exactly(logits.dtype, dtype)
    if widening and not checked:
        check_logits(logits)
    logits = logits.to(dtype)
    if not (widening or checked):
        check_logits(logits)
    return logits


def widens_exactly(source: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether converting floating ``source`` values to ``dtype`` keeps every value (float32 or
    16 bits -> float64, 16 bits -> float32): a check of the values may then read the narrower tensor."""
    return source.is_floating_point and source.itemsize <= dtype.itemsize


def check_logits(logits: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every row of floating ``logits [..., V]`` can be sampled from:
    no NaN, no ``+inf``, not ``-inf`` everywhere."""
    # One reduction covers the three bad cases: amax propagates NaN, is +inf if any entry
    # is, and is -inf only for a row that is -inf everywhere.
    if bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return
    if bool(torch.isnan(logits).any()):
        raise ValueError("logits contain NaN")
    if bool((logits == float("inf")).any()):
        raise ValueError("logits contain +inf")
    raise ValueError("logits has a row that is -inf everywhere (no token has positive probability)")


def _argmax_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """One-hot rows (the logits' dtype) at the argmax; torch.argmax returns the first maximal index."""
    winners = torch.argmax(logits, dim=-1, keepdim=True)  # [..., 1]
    return torch.zeros_like(logits).scatter_(-1, winners, 1.0)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep ``v`` iff the mass strictly more probable than ``v`` is < top_p; renormalise."""
    # mass_above[..., v] = sum of probs[..., u] over u with probs[..., u] > probs[..., v].
    # Computed by pairwise comparison: rows are small in tests and this is exact and
    # independent of sort order; for large V use the sorted form below.
    if probs.shape[-1] <= 64:
        greater = probs.unsqueeze(-2) > probs.unsqueeze(-1)  # [..., V(v), V(u)]
        mass_above = (greater * probs.unsqueeze(-2)).sum(dim=-1)  # [..., V]
    else:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
        inclusive = torch.cumsum(sorted_probs, dim=-1)  # [..., V]
        # Mass of the strictly larger ones: cumulative mass before the first entry of the
        # tie group that v belongs to.
        exclusive = inclusive - sorted_probs  # [..., V]
        first_of_group = _first_of_tie_group(sorted_probs)  # [..., V] index into sorted
        mass_above_sorted = exclusive.gather(-1, first_of_group)  # [..., V]
        mass_above = torch.empty_like(probs).scatter_(-1, order, mass_above_sorted)
    kept = (mass_above < top_p) & (probs > 0)  # [..., V]
    truncated = torch.where(kept, probs, torch.zeros_like(probs))
    return truncated / truncated.sum(dim=-1, keepdim=True)


def _first_of_tie_group(sorted_desc: torch.Tensor) -> torch.Tensor:
    """For each position of a descending-sorted row, the position where its run of equal
    values starts."""
    vocab = sorted_desc.shape[-1]
    positions = torch.arange(vocab).expand_as(sorted_desc)  # [..., V]
    starts_group = torch.ones_like(sorted_desc, dtype=torch.bool)
    starts_group[..., 1:] = sorted_desc[..., 1:] != sorted_desc[..., :-1]
    start_positions = torch.where(starts_group, positions, torch.zeros_like(positions))
    return torch.cummax(start_positions, dim=-1).values


def token_logprob(row: torch.Tensor, token: int, top: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """``(token, log row[token], ((id, logprob) of the ``top`` most likely ids, most likely
    first))`` for one probability row ``[V]`` (the law the token was sampled from)."""
    logs = torch.log(row.to(torch.float64))  # [V]; log 0 = -inf
    best = torch.topk(logs, min(top, logs.shape[-1])) if top > 0 else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return int(token), float(logs[int(token)]), alternatives
