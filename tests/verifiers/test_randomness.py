"""RowSources: one verifier call over the blocks of several requests, each row on its own stream.

The engine verifies the blocks of every request of a step that share a rule and a block length
in ONE call (actors.worker.verify_tasks.verify_together). These tests prove that call is the per-request
calls it replaces: token for token with seeded streams (each stream sees the draws a batch-1
call makes), and, by exact enumeration in float64, the joint law of a batched call is the
product of the rows' laws verified alone (TV < 1e-9).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from verifiers.reference.exact import exact_law, total_variation
from verifiers.randomness import RowSources, TorchRandomSource, categorical_together
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


def _sparse_rows(generator: torch.Generator, count: int, vocab: int) -> torch.Tensor:
    """``[count, vocab]`` float64 rows, some with zero entries (never to be drawn)."""
    logits = torch.randn(count, vocab, generator=generator, dtype=torch.float64) * 3
    logits[torch.rand(count, vocab, generator=generator) < 0.3] = float("-inf")
    logits[:, 0] = 0.0  # every row keeps one token
    return torch.softmax(logits, dim=-1)


def test_categorical_together_draws_what_each_source_alone_draws():
    """Many requests' draws in one call (a decode step's sampling): every source returns, for
    several positions in a row, exactly the tokens its own categorical call returns."""
    shapes = torch.Generator().manual_seed(7)
    for trial in range(20):
        counts = [int(c) for c in torch.randint(1, 4, (int(torch.randint(1, 17, (1,), generator=shapes)),),
                                                generator=shapes)]
        vocab = int(torch.randint(2, 300, (1,), generator=shapes))
        seeds = [trial * 100 + i for i in range(len(counts))]
        together = [TorchRandomSource(torch.Generator().manual_seed(s)) for s in seeds]
        alone = [TorchRandomSource(torch.Generator().manual_seed(s)) for s in seeds]
        for _ in range(3):  # positions: each source's stream must stay aligned call after call
            probs = [_sparse_rows(shapes, count, vocab) for count in counts]
            drawn = categorical_together(list(zip(together, probs)))
            for source, rows, tokens in zip(alone, probs, drawn):
                expected = source.categorical(rows)
                assert torch.equal(tokens, expected)
                assert bool((rows.gather(-1, tokens[:, None]) > 0).all())


def test_categorical_together_leaves_other_sources_their_own_calls():
    """The exact enumerator (or any non-torch source) is called as it is: the law is enumerated."""
    probs = torch.tensor([[0.25, 0.75]], dtype=torch.float64)

    def procedure(source):
        (tokens,) = categorical_together([(source, probs)])
        return int(tokens[0])

    law = exact_law(procedure)
    assert law == pytest.approx({0: 0.25, 1: 0.75})
