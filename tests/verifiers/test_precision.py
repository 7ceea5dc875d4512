"""The rows' precision as a parameter: float32 (what a GPU worker computes its rows in,
``engine.sampling_precision``) against float64 (what the exactness proofs enumerate).

The same functions run in either precision. These tests prove that float32 rows stay float32
through the draws and the single-draft rules, and bound what float32 changes: the exact law of
whole decode loops run on float32 rows is the target's law up to float32 rounding (total
variation < 1e-5, where a misplaced row or a wrong rule costs orders of magnitude more), and
seeded runs draw the same tokens in both precisions but where a uniform falls within rounding
of a step of the CDF.
"""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import model_pair, target_law
from verifiers.reference.exact import exact_law, total_variation
from verifiers.penalties import Penalties, penalized_probs
from verifiers.randomness import TorchRandomSource, categorical_together
from verifiers.reference import speculative_generate
from verifiers.sampling import logits_to_probs
from verifiers.single_draft import verify_block, verify_greedy_block, verify_token

FLOAT32_LAW_BOUND = 1e-5  # float32 rounding of a few rows of a few entries is ~1e-7


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 50, 0.9), (0.0, 0, 1.0)])
def test_float32_rows_are_the_float64_rows_rounded(temperature, top_k, top_p):
    logits = 3.0 * torch.randn(4, 4096, generator=torch.Generator().manual_seed(1))  # [4, V]
    rows64 = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    rows32 = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, dtype=torch.float32)
    assert rows64.dtype == torch.float64 and rows32.dtype == torch.float32
    assert torch.equal(rows32 > 0, rows64 > 0)  # the same support: truncation decided alike
    assert float((rows32.double() - rows64).abs().max()) < 1e-6


def test_penalized_float32_rows_match_float64():
    logits = 2.0 * torch.randn(2, 64, generator=torch.Generator().manual_seed(2))  # [2, V]
    penalties = Penalties(presence=0.5, frequency=0.25, repetition=1.3, logit_bias=((3, 2.0),))
    kwargs = dict(temperature=0.9, penalties=penalties, prompt=(1, 2, 3), generated=[[4, 4], [5]])
    rows64 = penalized_probs(logits, **kwargs)
    rows32 = penalized_probs(logits, **kwargs, dtype=torch.float32)
    assert rows32.dtype == torch.float32
    assert float((rows32.double() - rows64).abs().max()) < 1e-6


def test_rows_of_another_precision_are_refused():
    with pytest.raises(ValueError, match="float64 or float32"):
        logits_to_probs(torch.zeros(1, 4), temperature=1.0, dtype=torch.float16)


class _DtypeSpy:
    """A RandomSource that records the dtype of every probability it is handed, then draws
    (so the rule runs as served)."""

    def __init__(self, seed: int):
        self.inner = TorchRandomSource(torch.Generator().manual_seed(seed))
        self.dtypes: set[torch.dtype] = set()

    def bernoulli(self, prob):
        self.dtypes.add(prob.dtype)
        return self.inner.bernoulli(prob)

    def categorical(self, probs):
        self.dtypes.add(probs.dtype)
        return self.inner.categorical(probs)


@pytest.mark.parametrize("verify", [verify_token, verify_block, verify_greedy_block])
def test_single_draft_rules_compute_in_the_rows_precision(verify):
    generator = torch.Generator().manual_seed(3)
    draft32 = logits_to_probs(torch.randn(2, 3, 16, generator=generator), temperature=1.0, dtype=torch.float32)
    target32 = logits_to_probs(torch.randn(2, 4, 16, generator=generator), temperature=1.0, dtype=torch.float32)
    tokens = torch.multinomial(draft32.reshape(-1, 16), 1, generator=generator).reshape(2, 3)  # [B, gamma]
    spy = _DtypeSpy(4)
    verify(tokens, draft32, target32, generator=spy)
    assert spy.dtypes == {torch.float32}
    spy64 = _DtypeSpy(4)
    verify(tokens, draft32.double(), target32.double(), generator=spy64)
    assert spy64.dtypes == {torch.float64}


@pytest.mark.parametrize("method", [pytest.param("token", marks=pytest.mark.slow), "block",
                                    pytest.param("greedy_block", marks=pytest.mark.slow)])
def test_float32_decode_loop_law_is_the_target_law_up_to_rounding(method):
    """Exact enumeration of speculative decoding with float32 rows (two or three iterations
    tokens): within float32 rounding of the target's law, and of the float64 run's law."""
    draft_fn, target_fn = model_pair(3, seed=11, noise=1.0)
    prompt, length = (1,), 3

    def law(dtype):
        def procedure(source):
            tokens, _ = speculative_generate(draft_fn, target_fn, prompt, length, gamma=2, method=method,
                                             generator=source, dtype=dtype)
            return tuple(tokens)

        return exact_law(procedure)

    law32, law64 = law(torch.float32), law(torch.float64)
    exact = target_law(target_fn, prompt, length)
    assert total_variation(law64, exact) < 1e-9
    assert total_variation(law32, exact) < FLOAT32_LAW_BOUND
    assert total_variation(law32, law64) < FLOAT32_LAW_BOUND


def test_float32_draws_are_the_float64_draws():
    """Seeded draws from the same logits in both precisions: the same tokens (a uniform would
    have to land within ~1e-7 of a CDF step to differ)."""
    logits = 2.0 * torch.randn(400, 4096, generator=torch.Generator().manual_seed(5))  # [N, V]
    rows64 = logits_to_probs(logits, temperature=1.0)
    rows32 = logits_to_probs(logits, temperature=1.0, dtype=torch.float32)
    tokens64 = TorchRandomSource(torch.Generator().manual_seed(6)).categorical(rows64)
    tokens32 = TorchRandomSource(torch.Generator().manual_seed(6)).categorical(rows32)
    assert int((tokens64 != tokens32).sum()) <= 1
    assert bool((rows32[torch.arange(400), tokens32] > 0).all())


def test_draws_together_keep_each_precision():
    """A batched draw over rows of two precisions gives each request what its own call gives."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(7))
    rows = [logits_to_probs(logits[:1], temperature=1.0), logits_to_probs(logits[1:], temperature=1.0, dtype=torch.float32)]
    alone = [TorchRandomSource(torch.Generator().manual_seed(seed)).categorical(row) for seed, row in zip((8, 9), rows)]
    together = categorical_together(
        [(TorchRandomSource(torch.Generator().manual_seed(seed)), row) for seed, row in zip((8, 9), rows)])
    assert [t.tolist() for t in together] == [t.tolist() for t in alone]
