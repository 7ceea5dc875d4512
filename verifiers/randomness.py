"""Every random choice in specserve goes through a :class:`RandomSource`.

Verification rules and decode loops never call ``torch.rand`` or ``torch.multinomial``
themselves: they ask a source for a Bernoulli draw (accept / reject) or a categorical draw
(a token). In production the source wraps an explicit ``torch.Generator``
(:class:`TorchRandomSource`); in the exactness tests it is an enumerating source
(:mod:`verifiers.reference.exact`) that follows every branch with its probability, so the exact
output law of the *same code* that serves requests can be computed in float64.

Contract (both implementations honour it):

* ``bernoulli(prob)`` takes a probability tensor of any shape ``[...]`` (values in [0, 1])
  and returns a bool tensor ``[...]``; ``True`` with exactly that probability.
* ``categorical(probs)`` takes ``[..., V]`` rows that each sum to 1 (non-negative) and
  returns int64 indices ``[...]``; index ``v`` with probability ``probs[..., v]``.

A row's probabilities are used as given: no epsilon is added anywhere, so a zero
probability is never drawn and the law is not biased.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RandomSource(Protocol):
    """Source of the only two kinds of random choice the algorithms make."""

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        """``prob [...]`` in [0, 1] -> bool ``[...]``, True with probability ``prob``."""
        ...

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs [..., V]`` (rows sum to 1) -> int64 ``[...]`` drawn from each row."""
        ...


class TorchRandomSource:
    """A :class:`RandomSource` driven by an explicit ``torch.Generator`` (CPU).

    The order in which draws consume the generator is part of the contract: two runs that
    make the same calls with the same shapes from the same seed draw the same values, which
    is what lets the distributed coordinator reproduce :mod:`verifiers.reference` token for
    token.
    """

    def __init__(self, generator: torch.Generator):
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.generator = generator

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        prob = torch.as_tensor(prob, dtype=torch.float64)
        uniform = torch.rand(prob.shape, generator=self.generator, dtype=torch.float64)  # [...]
        # U ~ [0, 1): P(U < prob) = prob exactly, including prob = 0 and prob = 1.
        return uniform < prob

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        probs = torch.as_tensor(probs)
        batch_shape = probs.shape[:-1]
        flat = _flat_rows(probs)  # [N, V]
        return _inverse_cdf(flat, self.uniforms(flat.shape[0])).reshape(batch_shape)

    def uniforms(self, count: int) -> torch.Tensor:
        """The ``[count, 1]`` float64 uniforms a :meth:`categorical` call over ``count`` rows draws."""
        return torch.rand((count, 1), generator=self.generator, dtype=torch.float64)


def _flat_rows(probs: torch.Tensor) -> torch.Tensor:
    """``probs [..., V]`` -> host rows ``[N, V]``, float32 rows kept in float32 and any other
    dtype in float64 (the rows' precision, :data:`verifiers.sampling.ROW_DTYPES`)."""
    dtype = torch.float32 if probs.dtype == torch.float32 else torch.float64
    return probs.reshape(-1, probs.shape[-1]).to(dtype).cpu()


def _inverse_cdf(flat: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Rows ``flat [N, V]`` and one uniform per row ``[N, 1]`` (float64) -> int64 indices ``[N]``.

    Inverse-CDF sampling: exact in float64, one code path for every caller, and independent of
    torch.multinomial's internal algorithm. Float32 rows accumulate their CDF in float32 (the
    law drawn is the rows' up to that rounding, ``tests/verifiers/test_precision.py``); the
    search compares in float64, so a uniform never rounds onto a CDF step. Each row's result
    depends on that row and its uniform only (the cumulative sum runs along each row), so rows
    drawn in one call or in many agree."""
    cdf = torch.cumsum(flat, dim=-1)  # [N, V], in the rows' precision
    point = uniform * cdf[:, -1:].to(torch.float64)  # [N, 1]; the total is 1 up to rounding
    if cdf.dtype != torch.float64:  # the same count of CDF entries <= it, without a float64 copy of the CDF
        point = _largest_at_most(point, cdf.dtype)
    index = torch.searchsorted(cdf, point, right=True)  # [N, 1]
    index = _skip_zero_mass(flat, index.clamp_(max=flat.shape[-1] - 1))
    return index.reshape(-1).to(torch.int64)


def _largest_at_most(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest number of ``dtype`` at most each float64 value: an entry ``c`` of ``dtype`` is
    ``<= values`` exactly when it is ``<=`` this (so a search over ``dtype`` entries counts what a
    float64 search would)."""
    rounded = values.to(dtype)
    return torch.where(rounded.to(torch.float64) > values, torch.nextafter(rounded, rounded.new_tensor(float("-inf"))),
                       rounded)


def categorical_together(draws: list[tuple[RandomSource, torch.Tensor]]) -> list[torch.Tensor]:
    """Many requests' categorical draws in one call: ``draws[i] = (source_i, probs_i [k_i, V])``
    -> ``tokens_i [k_i]``, each exactly what ``source_i.categorical(probs_i)`` returns.

    With torch sources every source draws its own uniforms (the very draws its own call makes, in
    the same order), then ONE cumulative sum and search runs over all the rows: the per-row work
    of a decode step's sampling is done once for the step instead of once per request. Any other
    source (the exact enumerator), or rows of another shape or precision than the first's, are
    drawn one call each."""
    if not draws:
        return []
    vocab, dtype = draws[0][1].shape[-1], draws[0][1].dtype
    if not all(isinstance(source, TorchRandomSource) and probs.dim() == 2 and probs.shape[-1] == vocab
               and probs.dtype == dtype for source, probs in draws):
        return [source.categorical(probs) for source, probs in draws]
    counts = [probs.shape[0] for _, probs in draws]
    uniform = torch.cat([source.uniforms(count) for (source, _), count in zip(draws, counts)])  # [sum k_i, 1]
    tokens, start = [], 0
    for run in adjacent_runs([_flat_rows(probs) for _, probs in draws]):  # no copy of rows already side by side
        flat = cat_adjacent(run)  # [n, V]
        tokens.append(_inverse_cdf(flat, uniform[start: start + len(flat)]))
        start += len(flat)
    return list(torch.split(torch.cat(tokens), counts))


def adjacent_runs(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut where one does not lie right after the one before in the same
    storage (each run is what :func:`cat_adjacent` joins without a copy)."""
    runs = [[tensors[0]]]
    for previous, tensor in zip(tensors, tensors[1:]):
        if _follows(previous, tensor):
            runs[-1].append(tensor)
        else:
            runs.append([tensor])
    return runs


def _follows(previous: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether contiguous ``tensor`` starts where contiguous ``previous`` ends, in one storage, with
    the same dtype, device and row shape."""
    return (previous.is_contiguous() and tensor.is_contiguous() and tensor.dtype == previous.dtype
            and tensor.device == previous.device and tensor.shape[1:] == previous.shape[1:]
            and tensor.storage_offset() == previous.storage_offset() + previous.numel()
            and tensor.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr())


def cat_adjacent(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` along dim 0; a view, without a copy, when the tensors already lie one
    after the other in one storage (the rows a step makes together, ``actors.worker.rows.rows_together``),
    a single contiguous tensor included. Callers only read it."""
    first = tensors[0]
    if not (first.is_contiguous() and all(_follows(previous, tensor) for previous, tensor in zip(tensors, tensors[1:]))):
        return torch.cat(tensors)
    return first.as_strided((sum(len(tensor) for tensor in tensors), *first.shape[1:]), first.stride())


def _skip_zero_mass(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Move an index that landed on a zero-probability entry (possible only through rounding
    at the top of the CDF) to the last entry with positive mass, so zero mass is never drawn."""
    chosen = flat.gather(-1, index)  # [N, 1]
    if bool((chosen > 0).all()):
        return index
    positions = torch.arange(flat.shape[-1]).expand_as(flat)  # [N, V]
    last_positive = torch.where(flat > 0, positions, -1).max(dim=-1, keepdim=True).values
    return torch.where(chosen > 0, index, last_positive)


class RowSources:
    """One random stream per batch row, for a verifier called on the rows of several requests at
    once: every draw of batch row ``b`` comes from ``sources[b]``, and each stream sees exactly
    the calls a batch-1 call on that row alone makes (same calls, same shapes, same order), so a
    request's tokens do not depend on which requests share the call.

    Verifiers pass the batch rows of a Bernoulli call over a subset of rows through
    :func:`bernoulli_rows`; ``categorical`` takes every row ``[B, V]`` in order.
    """

    def __init__(self, sources: list[RandomSource]):
        if not sources:
            raise ValueError("RowSources needs one source per batch row")
        self.sources = list(sources)

    def bernoulli_rows(self, prob: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``prob [A]`` of batch rows ``rows [A]`` -> bool ``[A]``, element j from ``sources[rows[j]]``."""
        draws = [self.sources[int(row)].bernoulli(prob[j: j + 1]) for j, row in enumerate(rows.tolist())]
        return torch.cat(draws) if draws else torch.zeros(0, dtype=torch.bool)

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        """``prob [B]``, one per batch row in order."""
        return self.bernoulli_rows(prob, torch.arange(prob.shape[0]))

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs [B, V]``: row ``b`` drawn from ``sources[b]``."""
        if probs.shape[0] != len(self.sources):
            raise ValueError(f"categorical over {probs.shape[0]} rows with {len(self.sources)} row sources")
        return torch.cat(categorical_together([(source, probs[b: b + 1]) for b, source in enumerate(self.sources)]))


def bernoulli_rows(source: RandomSource, prob: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A Bernoulli draw over the batch rows ``rows`` (``prob [A]``): per row from its own stream
    when ``source`` is a :class:`RowSources`, else one call of ``source``."""
    if isinstance(source, RowSources):
        return source.bernoulli_rows(prob, rows)
    return source.bernoulli(prob)


def as_random_source(generator: torch.Generator | RandomSource) -> RandomSource:
    """Accept either a ``torch.Generator`` (wrapped) or a ready :class:`RandomSource`."""
    if isinstance(generator, (TorchRandomSource, RowSources)):  # the served sources: no protocol check
        return generator
    if isinstance(generator, torch.Generator):
        return TorchRandomSource(generator)
    if isinstance(generator, RandomSource):
        return generator
    raise TypeError(
        f"generator must be a torch.Generator or a RandomSource, got {type(generator).__name__}"
    )


def stream_seeds(seed: int, count: int) -> list[int]:
    """Seeds of ``count`` independent random streams derived from one request seed.

    Stream layout (the contract between :mod:`verifiers.reference` and the distributed
    coordinator, which gives each seed to the actor that owns the stream):

    * speculative decoding: stream 0 = draft-token sampling, stream 1 = verification;
    * ensembles over n members: stream i = member i's sampling (i < n), stream n = verification.
    """
    generator = torch.Generator().manual_seed(int(seed))
    return [int(torch.randint(0, 2**62, (1,), generator=generator)) for _ in range(count)]


def split_sources(generator: torch.Generator | RandomSource, count: int) -> list[RandomSource]:
    """``count`` independent streams from one generator (see :func:`stream_seeds` for the layout).

    A ``torch.Generator`` yields fresh generators seeded from it in order, exactly as
    :func:`stream_seeds` does from ``initial_seed``-style integer seeds; any other source (the
    exact enumerator) is shared by every stream, which keeps enumeration exact.
    """
    if isinstance(generator, torch.Generator):
        seeds = [int(torch.randint(0, 2**62, (1,), generator=generator)) for _ in range(count)]
        return [TorchRandomSource(torch.Generator().manual_seed(s)) for s in seeds]
    source = as_random_source(generator)
    return [source] * count
