"""RowSources: one verifier call over the blocks of several requests, each row on its own stream.

The engine verifies the blocks of every request of a step that share a rule and a block length
in ONE call (actors.engine.verify_together). These tests prove that call is the per-request
calls it replaces: token for token with seeded streams (each stream sees the draws a batch-1
call makes), and, by exact enumeration in float64, the joint law of a batched call is the
product of the rows' laws verified alone (TV < 1e-9).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from verifiers.exact import exact_law, total_variation
from verifiers.randomness import RowSources, TorchRandomSource
from verifiers.single_draft import verify_block, verify_token

RULES = {"token": verify_token, "block": verify_block}
EXACT_TOLERANCE = 1e-9


def _rows(batch: int, gamma: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (draft tokens [B, gamma], draft rows [B, gamma, V], target rows [B, gamma+1, V]),
    float64; each draft token has positive draft probability."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(2 * torch.randn(batch, gamma, vocab, generator=generator, dtype=torch.float64), -1)
    target_probs = torch.softmax(2 * torch.randn(batch, gamma + 1, vocab, generator=generator, dtype=torch.float64), -1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, gamma)
    return draft_tokens, draft_probs, target_probs


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_batched_call_draws_what_each_row_alone_draws(rule):
    verify = RULES[rule]
    for case in range(40):
        batch, gamma = 1 + case % 5, 1 + case % 4
        tokens, draft_probs, target_probs = _rows(batch, gamma, 6, case)
        seeds = [1000 * case + b for b in range(batch)]
        together = verify(tokens, draft_probs, target_probs,
                          generator=RowSources([TorchRandomSource(torch.Generator().manual_seed(s)) for s in seeds]))
        for b, seed in enumerate(seeds):
            alone = verify(tokens[b:b + 1], draft_probs[b:b + 1], target_probs[b:b + 1],
                           generator=TorchRandomSource(torch.Generator().manual_seed(seed)))
            assert together.emitted(b) == alone.emitted(0), (rule, case, b)
            assert int(together.num_accepted[b]) == int(alone.num_accepted[0])


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize(("batch", "gamma", "vocab", "seed"), [(2, 2, 3, 1), (3, 1, 3, 2), (2, 3, 2, 3)])
def test_the_law_of_a_batched_call_is_the_product_of_the_rows_laws(rule, batch, gamma, vocab, seed):
    verify = RULES[rule]
    tokens, draft_probs, target_probs = _rows(batch, gamma, vocab, seed)

    def together(source):
        result = verify(tokens, draft_probs, target_probs, generator=RowSources([source] * batch))
        return tuple(tuple(result.emitted(b)) for b in range(batch))

    def alone(b):
        def procedure(source):
            return tuple(verify(tokens[b:b + 1], draft_probs[b:b + 1], target_probs[b:b + 1], generator=source).emitted(0))
        return exact_law(procedure)

    row_laws = [alone(b) for b in range(batch)]
    product = {}
    for outcome in itertools.product(*(law.items() for law in row_laws)):
        key = tuple(emitted for emitted, _ in outcome)
        probability = 1.0
        for _, p in outcome:
            probability *= p
        product[key] = probability
    assert total_variation(exact_law(together), product) < EXACT_TOLERANCE


def test_row_sources_refuse_a_row_count_they_do_not_have():
    sources = RowSources([TorchRandomSource(torch.Generator())] * 2)
    with pytest.raises(ValueError, match="2 row sources"):
        sources.categorical(torch.full((3, 4), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="one source per batch row"):
        RowSources([])
