"""``min_p`` and ``min_tokens`` (vLLM's sampling extensions) keep every strategy lossless.

Both are row transforms (:mod:`verifiers.penalties`): ``min_p`` drops the tokens below
``min_p`` times the row's largest probability, ``min_tokens`` bans the end-of-sequence ids in
every row with fewer than ``min_tokens`` generated tokens before it, so inside a block each
position has its own ban. Exact enumeration on tiny context-dependent models (float64,
TV < 1e-9) for sd (token, block, greedy block), multi-draft and se; controls show the transforms
change the law and that a block banned with its first position's context is caught.
"""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import TinyModel, model_pair
from verifiers.reference import executor as executor_module
from verifiers.reference.exact import exact_law, sequence_law, total_variation
from verifiers.penalties import Penalties, penalize, penalized_probs
from verifiers.reference import autoregressive_generate, speculative_generate
from verifiers.reference.ensemble import ensemble_autoregressive_generate, ensemble_generate, ensemble_next_token_probs
from verifiers.sampling import logits_to_probs

PROMPT = (1, 0)
EXACT_TOLERANCE = 1e-9
EOS = 0
# min_p drops tokens below 0.3 x the largest; EOS is banned at the first two positions.
TRANSFORMS = Penalties(min_p=0.3, min_tokens=2, eos_ids=(EOS,))


def _target_law(target_fn, length: int, transforms: Penalties = TRANSFORMS, **sampling):
    def next_token_probs(context):
        logits = torch.as_tensor(target_fn(context))[None]  # [1, V]
        return penalized_probs(logits, temperature=sampling.get("temperature", 1.0), top_k=sampling.get("top_k", 0),
                               top_p=sampling.get("top_p", 1.0), penalties=transforms, prompt=PROMPT,
                               generated=[tuple(context)[len(PROMPT):]])[0]

    return sequence_law(next_token_probs, PROMPT, length)


def _speculative_law(draft_fn, target_fn, length, *, method, gamma, num_drafts=1, **sampling):
    return exact_law(lambda source: tuple(speculative_generate(
        draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method, num_drafts=num_drafts,
        generator=source, penalties=TRANSFORMS, **sampling,
    )[0]))


def test_min_p_keeps_the_tokens_at_or_above_min_p_times_the_largest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))  # [1, V=4]
    kept = logits_to_probs(logits, temperature=1.0, min_p=0.3)  # floor 0.15: keeps 0, 1, 2
    assert torch.allclose(kept, torch.tensor([[0.5, 0.3, 0.15, 0.0]], dtype=torch.float64) / 0.95, atol=1e-15)
    # min_p before top-p: top_p 0.6 on the renormalised row (0.526, 0.316, 0.158) keeps two tokens.
    both = logits_to_probs(logits, temperature=1.0, min_p=0.3, top_p=0.6)
    assert both[0, 2] == 0 and both[0, 3] == 0 and abs(float(both[0, :2].sum()) - 1.0) < 1e-15
    assert torch.equal(logits_to_probs(logits, temperature=0.0, min_p=0.9), logits_to_probs(logits, temperature=0.0))


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_min_p_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match="min_p"):
        logits_to_probs(torch.zeros(1, 3), temperature=1.0, min_p=bad)


def test_min_tokens_bans_eos_in_the_rows_before_it():
    logits = torch.zeros(3, 4, dtype=torch.float64)  # [N=3, V=4]
    out = penalize(logits, Penalties(min_tokens=2, eos_ids=(0, 3)), prompt=[1], generated=[[], [2], [2, 2]])
    inf = float("-inf")
    assert out.tolist() == [[inf, 0.0, 0.0, inf], [inf, 0.0, 0.0, inf], [0.0, 0.0, 0.0, 0.0]]
    assert not Penalties(min_tokens=2).active  # no EOS ids: nothing to ban
    assert not Penalties(min_p=0.5).active  # min_p needs no context


def test_the_transforms_really_change_the_law():
    _, target_fn = model_pair(3, 5)
    plain = sequence_law(lambda c: torch.softmax(torch.as_tensor(target_fn(c)).double(), -1), PROMPT, 3)
    law = _target_law(target_fn, 3)
    assert total_variation(plain, law) > 0.05
    assert all(sequence[0] != EOS and sequence[1] != EOS for sequence, p in law.items() if p > 0)


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
@pytest.mark.parametrize(("vocab", "gamma", "length", "seed"), [(3, 2, 3, 3), (4, 3, 3, 8)])
def test_single_draft_rules_are_exact_with_min_p_and_min_tokens(method, vocab, gamma, length, seed):
    draft_fn, target_fn = model_pair(vocab, seed)
    law = _speculative_law(draft_fn, target_fn, length, method=method, gamma=gamma)
    assert total_variation(law, _target_law(target_fn, length)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", ["spectr", "sequential_gbv"])
def test_multi_draft_rules_are_exact_with_min_p_and_min_tokens(method):
    draft_fn, target_fn = model_pair(3, 17)
    law = _speculative_law(draft_fn, target_fn, 3, method=method, gamma=2, num_drafts=2)
    assert total_variation(law, _target_law(target_fn, 3)) < EXACT_TOLERANCE


def test_exact_with_temperature_top_k_top_p_and_penalties_together():
    draft_fn, target_fn = model_pair(4, 23)
    transforms = Penalties(presence=0.5, repetition=1.5, min_p=0.2, min_tokens=1, eos_ids=(EOS,))
    sampling = {"temperature": 0.8, "top_k": 3, "top_p": 0.9}
    law = exact_law(lambda source: tuple(speculative_generate(
        draft_fn, target_fn, PROMPT, 3, gamma=2, method="block", generator=source, penalties=transforms, **sampling,
    )[0]))
    assert total_variation(law, _target_law(target_fn, 3, transforms, **sampling)) < EXACT_TOLERANCE


def test_autoregressive_samples_the_transformed_law():
    _, target_fn = model_pair(3, 29)
    law = exact_law(lambda s: tuple(autoregressive_generate(target_fn, PROMPT, 3, generator=s, penalties=TRANSFORMS)[0]))
    assert total_variation(law, _target_law(target_fn, 3)) < EXACT_TOLERANCE


@pytest.mark.parametrize("ensemble_args", [{"ensemble": "weighted", "weights": [0.6, 0.4]},
                                           {"ensemble": "contrastive", "mu": 0.4}], ids=["weighted", "contrastive"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_speculative_ensemble_is_exact_with_min_p_and_min_tokens(ensemble_args, method):
    model_fns = [TinyModel(3, 41), TinyModel(3, 42)]
    law = exact_law(lambda s: tuple(ensemble_generate(
        model_fns, PROMPT, 3, gammas=(2, 1), method=method, generator=s, penalties=TRANSFORMS, **ensemble_args
    )[0]))
    expected = sequence_law(ensemble_next_token_probs(model_fns, penalties=TRANSFORMS, prompt=PROMPT, **ensemble_args),
                            PROMPT, 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


def test_standard_ensemble_samples_the_transformed_ensemble_law():
    model_fns = [TinyModel(3, 43), TinyModel(3, 44)]
    law = exact_law(lambda s: tuple(ensemble_autoregressive_generate(
        model_fns, PROMPT, 3, generator=s, penalties=TRANSFORMS
    )[0]))
    expected = sequence_law(ensemble_next_token_probs(model_fns, penalties=TRANSFORMS, prompt=PROMPT), PROMPT, 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


def test_banning_a_block_with_its_first_context_is_caught(monkeypatch):
    """Control: every row of a block banned (or not) as its first position is gives a
    measurably different law: the ban must follow each row's own position."""
    original = executor_module.LocalExecutor._rows

    def stale_rows(self, logits, contexts, dtype=None):
        return original(self, logits, [min(contexts, key=len)] * len(contexts), dtype)

    monkeypatch.setattr(executor_module.LocalExecutor, "_rows", stale_rows)
    draft_fn, target_fn = model_pair(3, 3)
    try:
        law = _speculative_law(draft_fn, target_fn, 3, method="block", gamma=3)
    except ValueError as error:  # the stale draft rows give a drawn token probability 0: refused
        assert "zero probability" in str(error)
    else:
        assert total_variation(law, _target_law(target_fn, 3)) > 1e-3
