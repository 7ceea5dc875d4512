"""Tiny context-dependent models and law helpers shared by the verifier tests.

A :class:`TinyModel` maps a context (tuple of token ids) to logits ``[V]`` that are a seeded
function of the WHOLE context, so every position sees a different row: a verifier that
misaligns rows and positions changes the output law and fails exact enumeration (a model with
the same row at every position would hide that).

Helpers:

* :func:`model_pair` -- a target and a draft that is a noisy version of it (acceptance is
  neither ~0 nor ~1, so every branch of a rule is exercised);
* :func:`target_law` -- the exact law of ``length`` tokens sampled from the target after
  :func:`verifiers.sampling.logits_to_probs` (what every lossless method must reproduce);
* :func:`speculative_law` -- the exact law of :func:`verifiers.reference.speculative_generate`
  by enumerating its random choices (:func:`verifiers.reference.exact.exact_law`);
* :func:`chi_square_pvalue` -- goodness of fit of sampled sequences against an exact law.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

import torch

from verifiers.reference.exact import exact_law, sequence_law
from verifiers.reference import speculative_generate
from verifiers.sampling import logits_to_probs

ModelFn = Callable[[tuple[int, ...]], torch.Tensor]


def _context_seed(seed: int, context: tuple[int, ...]) -> int:
    """A stable 63-bit seed from (seed, context), identical across processes and runs."""
    digest = hashlib.blake2b(repr((int(seed), tuple(int(t) for t in context))).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


class TinyModel:
    """Logits ``[V]`` (float64) that are a seeded pseudo-random function of the whole context.

    ``scale`` sets how peaked the rows are. ``mask_prob`` > 0 sets some logits to ``-inf``
    (never all of them), so rows with zero-probability tokens occur. With ``base`` given the
    logits are ``base(context) + noise * own(context)``: a draft that resembles ``base``.
    """

    def __init__(
        self,
        vocab: int,
        seed: int,
        *,
        scale: float = 1.5,
        mask_prob: float = 0.0,
        base: ModelFn | None = None,
        noise: float = 1.0,
    ):
        if vocab < 1:
            raise ValueError(f"vocab must be >= 1, got {vocab}")
        self.vocab = vocab
        self.seed = seed
        self.scale = scale
        self.mask_prob = mask_prob
        self.base = base
        self.noise = noise
        self.calls = 0
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, context: tuple[int, ...]) -> torch.Tensor:
        self.calls += 1
        context = tuple(int(t) for t in context)
        cached = self._cache.get(context)
        if cached is None:
            cached = self._logits(context)
            self._cache[context] = cached
        return cached.clone()

    def _logits(self, context: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_context_seed(self.seed, context))
        own = self.scale * torch.randn(self.vocab, generator=generator, dtype=torch.float64)  # [V]
        logits = own if self.base is None else torch.as_tensor(self.base(context), dtype=torch.float64) + self.noise * own
        if self.mask_prob > 0:
            masked = torch.rand(self.vocab, generator=generator, dtype=torch.float64) < self.mask_prob
            masked[int(torch.argmax(logits))] = False  # keep at least one token
            logits = logits.masked_fill(masked, float("-inf"))
        return logits


def causal_lm_fn(model) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """A transformers causal LM as the reference loop's ``ModelFn``: full context -> float64 logits
    ``[V]`` of its last position (memoized per context)."""
    @functools.lru_cache(maxsize=None)
    def logits(context: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([context])).logits[0, -1].double()

    return logits


def model_pair(
    vocab: int, seed: int, *, noise: float = 1.0, scale: float = 1.5, mask_prob: float = 0.0
) -> tuple[TinyModel, TinyModel]:
    """``(draft_fn, target_fn)``: a random context-dependent target and a draft equal to the
    target's logits plus ``noise`` times independent context-dependent logits."""
    target = TinyModel(vocab, seed, scale=scale, mask_prob=mask_prob)
    draft = TinyModel(vocab, seed + 1_000_003, scale=scale, mask_prob=mask_prob, base=target, noise=noise)
    return draft, target


def target_law(
    target_fn: ModelFn,
    prompt: tuple[int, ...],
    length: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict[tuple[int, ...], float]:
    """Exact law of ``length`` tokens sampled autoregressively from the target's rows."""

    def next_token_probs(context: tuple[int, ...]) -> torch.Tensor:
        logits = torch.as_tensor(target_fn(context))
        return logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)

    return sequence_law(next_token_probs, tuple(prompt), length)


def speculative_law(
    draft_fn: ModelFn,
    target_fn: ModelFn,
    prompt: tuple[int, ...],
    length: int,
    *,
    gamma: int,
    method: str,
    num_drafts: int = 1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_leaves: int = 2_000_000,
) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens :func:`speculative_generate` emits, by enumeration."""

    def procedure(source) -> Hashable:
        tokens, _ = speculative_generate(
            draft_fn,
            target_fn,
            prompt,
            length,
            gamma=gamma,
            method=method,
            num_drafts=num_drafts,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=source,
        )
        return tuple(tokens)

    return exact_law(procedure, max_leaves=max_leaves)


def expected_value_law(law: dict[Hashable, float], value: Callable[[Hashable], float]) -> float:
    """``E[value(outcome)]`` under an exact law."""
    return sum(prob * value(outcome) for outcome, prob in law.items())


def chi_square_pvalue(samples: Iterable[Hashable], law: dict[Hashable, float], *, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value of ``samples`` against the exact ``law``.

    Outcomes whose expected count is below ``min_expected`` are pooled into one cell (so the
    chi-square approximation holds); a sample outside the law's support gives p = 0.
    """
    from scipy.stats import chi2  # test-only dependency (dev extra)

    counts = Counter(samples)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no samples")
    if any(outcome not in law or law[outcome] <= 0 for outcome in counts):
        return 0.0
    cells_observed: list[float] = []
    cells_expected: list[float] = []
    pooled_observed = 0.0
    pooled_expected = 0.0
    for outcome, prob in law.items():
        expected = prob * total
        if expected < min_expected:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += expected
        else:
            cells_observed.append(counts.get(outcome, 0))
            cells_expected.append(expected)
    if pooled_expected > 0:
        if pooled_expected < min_expected and cells_expected:
            smallest = min(range(len(cells_expected)), key=cells_expected.__getitem__)
            cells_observed[smallest] += pooled_observed
            cells_expected[smallest] += pooled_expected
        else:
            cells_observed.append(pooled_observed)
            cells_expected.append(pooled_expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(cells_observed, cells_expected))
    degrees = len(cells_expected) - 1
    if degrees < 1:
        return 1.0
    return float(chi2.sf(statistic, degrees))
