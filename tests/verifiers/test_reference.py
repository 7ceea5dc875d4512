"""The reference decode loop: exact output law (enumeration) and its interface contract."""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import model_pair, speculative_law, target_law
from verifiers.exact import total_variation
from verifiers.reference import autoregressive_generate, speculative_generate

PROMPT = (1,)
# (vocab, gamma, length, seed, mask_prob): small enough that enumeration takes ~1 s each.
EXACT_CASES = [
    (2, 2, 4, 0, 0.0),
    (2, 3, 2, 1, 0.0),
    (3, 2, 2, 2, 0.0),
    (4, 2, 2, 3, 0.3),
]


@pytest.mark.parametrize(("vocab", "gamma", "length", "seed", "mask_prob"), EXACT_CASES)
def test_token_method_reproduces_the_target_law_exactly(vocab, gamma, length, seed, mask_prob):
    draft_fn, target_fn = model_pair(vocab, seed, mask_prob=mask_prob)
    law = speculative_law(draft_fn, target_fn, PROMPT, length, gamma=gamma, method="token")
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < 1e-9


def test_generate_returns_exactly_max_new_tokens_and_stats():
    draft_fn, target_fn = model_pair(3, 7)
    tokens, stats = speculative_generate(
        draft_fn, target_fn, PROMPT, 7, gamma=3, method="token", generator=torch.Generator().manual_seed(1)
    )
    assert len(tokens) == 7 and all(0 <= t < 3 for t in tokens)
    assert stats["target_calls"] == len(stats["accepted"]) == stats["iterations"]
    assert sum(a + 1 for a in stats["accepted"]) >= 7
    assert all(0 <= a <= 3 for a in stats["accepted"])


def test_same_seed_same_tokens():
    draft_fn, target_fn = model_pair(4, 8)

    def run(seed):
        return speculative_generate(
            draft_fn, target_fn, PROMPT, 12, gamma=4, method="token", generator=torch.Generator().manual_seed(seed)
        )[0]

    assert run(5) == run(5)


def test_autoregressive_generate_has_the_target_law():
    _, target_fn = model_pair(3, 9)
    from verifiers.exact import exact_law

    law = exact_law(lambda source: tuple(autoregressive_generate(target_fn, PROMPT, 3, generator=source)[0]))
    assert total_variation(law, target_law(target_fn, PROMPT, 3)) < 1e-12


def test_bad_loop_arguments_are_named():
    draft_fn, target_fn = model_pair(2, 0)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(draft_fn, target_fn, PROMPT, 3, gamma=0, method="token", generator=generator)
    with pytest.raises(ValueError, match="num_drafts"):
        speculative_generate(draft_fn, target_fn, PROMPT, 3, gamma=2, method="token", num_drafts=2, generator=generator)
    with pytest.raises(ValueError, match="valid methods"):
        speculative_generate(draft_fn, target_fn, PROMPT, 3, gamma=2, method="nope", generator=generator)
