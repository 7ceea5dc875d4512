"""Penalties and logit bias keep every strategy lossless with respect to the penalized law.

The penalized law at a position depends on the tokens generated before it, so inside a block
each position has its own context (verifiers.penalties). Exact enumeration on tiny
context-dependent models (float64, TV < 1e-9) for every lossless rule; a control shows the
test fails when the block is penalized with the context of its first position only.
"""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import model_pair
from verifiers.reference import executor as executor_module
from verifiers.reference.exact import exact_law, sequence_law, total_variation
from verifiers.penalties import NO_PENALTIES, Penalties, penalize, penalized_probs
from verifiers.reference import autoregressive_generate, speculative_generate
from verifiers.reference.ensemble import ensemble_autoregressive_generate, ensemble_generate, ensemble_next_token_probs
from tests.verifiers.tiny_models import TinyModel

PROMPT = (1, 0)
EXACT_TOLERANCE = 1e-9
# Strong, context-dependent penalties: every one changes the law after each generated token.
PENALTIES = Penalties(presence=0.7, frequency=0.4, repetition=1.8, logit_bias=((2, 0.9), (0, -0.5)))


def _penalized_target_law(target_fn, length: int, penalties: Penalties = PENALTIES, **sampling):
    def next_token_probs(context):
        logits = torch.as_tensor(target_fn(context))[None]  # [1, V]
        generated = [tuple(context)[len(PROMPT):]]
        return penalized_probs(logits, temperature=sampling.get("temperature", 1.0), top_k=sampling.get("top_k", 0),
                               top_p=sampling.get("top_p", 1.0), penalties=penalties, prompt=PROMPT,
                               generated=generated)[0]

    return sequence_law(next_token_probs, PROMPT, length)


def _speculative_law(draft_fn, target_fn, length, *, method, gamma, num_drafts=1, **sampling):
    return exact_law(
        lambda source: tuple(speculative_generate(
            draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method, num_drafts=num_drafts,
            generator=source, penalties=PENALTIES, **sampling,
        )[0])
    )


def test_penalize_matches_the_documented_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, float("-inf")]])  # [1, V=4]
    out = penalize(logits, Penalties(presence=0.5, frequency=0.25, repetition=2.0, logit_bias=((1, 3.0),)),
                   prompt=[3], generated=[[0, 0, 1]])
    # token 0: seen twice: 2 / 2 - 0.25 * 2 - 0.5; token 1: seen once: -1 * 2 - 0.25 - 0.5 + 3;
    # token 2: unseen: 0.5; token 3: in the prompt only: -inf stays -inf.
    assert out.tolist() == [[0.0, 0.25, 0.5, float("-inf")]]
    assert penalize(logits, NO_PENALTIES, [3], [[0]]).tolist() == logits.double().tolist()


def test_the_penalties_really_change_the_law():
    _, target_fn = model_pair(3, 5)
    plain = sequence_law(lambda c: torch.softmax(torch.as_tensor(target_fn(c)).double(), -1), PROMPT, 3)
    assert total_variation(plain, _penalized_target_law(target_fn, 3)) > 0.05


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
@pytest.mark.parametrize(("vocab", "gamma", "length", "seed"), [
    pytest.param(3, 2, 3, 3, marks=pytest.mark.slow), (2, 3, 3, 8), pytest.param(4, 2, 2, 13, marks=pytest.mark.slow),
])
def test_single_draft_rules_are_exact_under_penalties(method, vocab, gamma, length, seed):
    draft_fn, target_fn = model_pair(vocab, seed)
    law = _speculative_law(draft_fn, target_fn, length, method=method, gamma=gamma)
    assert total_variation(law, _penalized_target_law(target_fn, length)) < EXACT_TOLERANCE


@pytest.mark.slow  # tests/verifiers/test_multi_draft.py keeps fast multi-draft enumerations
@pytest.mark.parametrize("method", ["spectr", "sequential_gbv"])
def test_multi_draft_rules_are_exact_under_penalties(method):
    draft_fn, target_fn = model_pair(3, 17)
    law = _speculative_law(draft_fn, target_fn, 2, method=method, gamma=2, num_drafts=2)
    assert total_variation(law, _penalized_target_law(target_fn, 2)) < EXACT_TOLERANCE


def test_exact_with_penalties_temperature_and_top_k_top_p():
    draft_fn, target_fn = model_pair(4, 23)
    sampling = {"temperature": 0.8, "top_k": 3, "top_p": 0.9}
    law = _speculative_law(draft_fn, target_fn, 2, method="block", gamma=2, **sampling)
    assert total_variation(law, _penalized_target_law(target_fn, 2, **sampling)) < EXACT_TOLERANCE


def test_autoregressive_samples_the_penalized_law():
    _, target_fn = model_pair(3, 29)
    law = exact_law(lambda s: tuple(autoregressive_generate(target_fn, PROMPT, 3, generator=s, penalties=PENALTIES)[0]))
    assert total_variation(law, _penalized_target_law(target_fn, 3)) < EXACT_TOLERANCE


ENSEMBLE_CASES = [
    {"ensemble": "weighted", "weights": [0.6, 0.4]},
    {"ensemble": "contrastive", "mu": 0.4},
]


@pytest.mark.parametrize("ensemble_args", ENSEMBLE_CASES, ids=["weighted", "contrastive"])
@pytest.mark.parametrize("method", [pytest.param("token", marks=pytest.mark.slow), "block"])
def test_speculative_ensemble_is_exact_under_penalties(ensemble_args, method):
    model_fns = [TinyModel(3, 41), TinyModel(3, 42)]
    law = exact_law(lambda s: tuple(ensemble_generate(
        model_fns, PROMPT, 3, gammas=(2, 1), method=method, generator=s, penalties=PENALTIES, **ensemble_args
    )[0]))
    expected = sequence_law(ensemble_next_token_probs(model_fns, penalties=PENALTIES, prompt=PROMPT, **ensemble_args),
                            PROMPT, 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


def test_standard_ensemble_samples_the_penalized_ensemble_law():
    model_fns = [TinyModel(3, 43), TinyModel(3, 44)]
    law = exact_law(lambda s: tuple(ensemble_autoregressive_generate(
        model_fns, PROMPT, 3, generator=s, penalties=PENALTIES
    )[0]))
    expected = sequence_law(ensemble_next_token_probs(model_fns, penalties=PENALTIES, prompt=PROMPT), PROMPT, 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


def test_penalizing_a_block_with_its_first_context_is_caught(monkeypatch):
    """Control: rows penalized with the context of the block's first position only (the bug
    this module exists to prevent) give a measurably different law."""
    original = executor_module.LocalExecutor._rows

    def stale_rows(self, logits, contexts, *rest):
        return original(self, logits, [min(contexts, key=len)] * len(contexts), *rest)

    monkeypatch.setattr(executor_module.LocalExecutor, "_rows", stale_rows)
    draft_fn, target_fn = model_pair(3, 3)
    law = _speculative_law(draft_fn, target_fn, 3, method="block", gamma=2)
    assert total_variation(law, _penalized_target_law(target_fn, 3)) > 1e-3
