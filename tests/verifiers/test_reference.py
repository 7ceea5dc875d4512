"""The reference decode loop, proven lossless for every single-draft rule.

Exact enumeration runs ``speculative_generate`` itself with the enumerating source as
``generator`` (so the proof covers the loop, the random-stream layout, row alignment and the
greedy state carried between iterations) and compares with the target's exact law over the
same number of tokens. Tiny models are context dependent (see tests/verifiers/tiny_models.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import (
    TinyModel,
    chi_square_pvalue,
    model_pair,
    speculative_law,
    target_law,
)
from verifiers.reference import executor
from verifiers.reference import loops as reference
from verifiers.reference.exact import exact_law, total_variation
from verifiers.reference import autoregressive_generate, speculative_generate
from verifiers.registry import VerifierSpec
from verifiers.single_draft import verify_greedy_block
from verifiers.types import VerifyResult

PROMPT = (1,)
SINGLE_DRAFT = ["token", "block", "greedy_block"]
EXACT_TOLERANCE = 1e-9

# (vocab, gamma, length, seed, mask_prob): vocab 2-4, gamma 2-4, up to 4 tokens, several
# iterations; masked rows (zero-probability tokens) keep the choice tree small for V = 4.
EXACT_CASES = [
    (2, 2, 4, 0, 0.0),
    (3, 2, 3, 2, 0.0),
    (4, 2, 3, 11, 0.5),
    (3, 3, 3, 10, 0.4),
    (4, 4, 2, 9, 0.6),
]
# gamma = 3 over 4 tokens: greedy_block has two modification levels alive at once here
# (asserted below). Token verification's choice tree is ~15x larger on it, so it is left out.
NESTED_CASE = (2, 3, 4, 5, 0.0)


@pytest.mark.parametrize("method", SINGLE_DRAFT)
@pytest.mark.parametrize(("vocab", "gamma", "length", "seed", "mask_prob"), EXACT_CASES)
def test_output_law_equals_target_law_exactly(method, vocab, gamma, length, seed, mask_prob):
    draft_fn, target_fn = model_pair(vocab, seed, mask_prob=mask_prob)
    law = speculative_law(draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method)
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", ["block", "greedy_block"])
def test_output_law_is_exact_across_nested_greedy_modifications(method):
    vocab, gamma, length, seed, mask_prob = NESTED_CASE
    draft_fn, target_fn = model_pair(vocab, seed, mask_prob=mask_prob)
    law = speculative_law(draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method)
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", SINGLE_DRAFT)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_exact_with_temperature(method, temperature):
    draft_fn, target_fn = model_pair(3, 21)
    law = speculative_law(draft_fn, target_fn, PROMPT, 2, gamma=2, method=method, temperature=temperature)
    assert total_variation(law, target_law(target_fn, PROMPT, 2, temperature=temperature)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_exact_with_top_k_and_top_p(method):
    draft_fn, target_fn = model_pair(4, 22)
    kwargs = {"temperature": 1.0, "top_k": 3, "top_p": 0.8}
    law = speculative_law(draft_fn, target_fn, PROMPT, 3, gamma=3, method=method, **kwargs)
    assert total_variation(law, target_law(target_fn, PROMPT, 3, **kwargs)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", SINGLE_DRAFT)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temperature_zero_emits_the_target_greedy_sequence(method, seed):
    draft_fn, target_fn = model_pair(4, 30 + seed, noise=2.0)
    law = speculative_law(draft_fn, target_fn, PROMPT, 6, gamma=3, method=method, temperature=0.0)
    greedy = target_law(target_fn, PROMPT, 6, temperature=0.0)
    assert len(greedy) == 1
    assert law == pytest.approx(greedy, abs=0)


@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_draft_equal_to_target_accepts_everything_exactly(method):
    target_fn = TinyModel(3, 40)
    law = speculative_law(target_fn, target_fn, PROMPT, 3, gamma=2, method=method)
    assert total_variation(law, target_law(target_fn, PROMPT, 3)) < EXACT_TOLERANCE
    _, stats = speculative_generate(
        target_fn, target_fn, PROMPT, 9, gamma=2, method=method, generator=torch.Generator().manual_seed(0)
    )
    assert stats["accepted"] == [2, 2, 2]


def _use_verifier(monkeypatch, spec: VerifierSpec) -> None:
    """Make the reference loop (its argument check and the executor that verifies) use ``spec``."""
    monkeypatch.setattr(reference, "get_verifier", lambda name: spec)
    monkeypatch.setattr(executor, "get_verifier", lambda name: spec)


def _record_greedy_levels(monkeypatch) -> list[int]:
    """Record how many modification levels each greedy call receives."""
    level_counts: list[int] = []

    def recording_verify(*args, state=None, **kwargs):
        level_counts.append(0 if state is None else int((state.horizon > 0).sum()))
        return verify_greedy_block(*args, state=state, **kwargs)

    spec = VerifierSpec("greedy_block", recording_verify, multi_draft=False, stateful=True)
    _use_verifier(monkeypatch, spec)
    return level_counts


def test_greedy_case_exercises_nested_modification_levels(monkeypatch):
    """NESTED_CASE reaches states with two live levels, so its exact result covers Alg. 6's
    modification of an already modified target."""
    level_counts = _record_greedy_levels(monkeypatch)
    vocab, gamma, length, seed, mask_prob = NESTED_CASE
    draft_fn, target_fn = model_pair(vocab, seed, mask_prob=mask_prob)
    speculative_law(draft_fn, target_fn, PROMPT, length, gamma=gamma, method="greedy_block")
    assert max(level_counts) >= 2


def _conditional_reading_verifier():
    """Greedy block verification with Eq. (23) misread as CONDITIONAL probabilities:
    ``norm(max(target(x | ctx) - draft(x | ctx), 0))`` at each modified position, the state
    being just the horizons. Built on the production verifier (modified rows, no state)."""

    def verify(draft_tokens, draft_probs, target_probs, *, generator, state=None):
        horizons = list(state or [])
        gamma = draft_tokens.shape[1]
        rows = target_probs.clone()  # [1, gamma+1, V]
        for horizon in horizons:
            for j in range(horizon):
                residual = (rows[0, j] - draft_probs[0, j]).clamp(min=0)
                if residual.sum() > 0:
                    rows[0, j] = residual / residual.sum()
        result = verify_greedy_block(draft_tokens, draft_probs, rows, generator=generator)
        emitted = int(result.num_accepted[0]) + 1
        survivors = [h - emitted for h in horizons if h - emitted > 0]
        if gamma - emitted > 0:
            survivors.append(gamma - emitted)
        return VerifyResult(tokens=result.tokens, num_accepted=result.num_accepted, state=survivors)

    return VerifierSpec("greedy_block", verify, multi_draft=False, stateful=True)


def _constant_model(row: list[float]):
    logits = torch.tensor(row, dtype=torch.float64).log()
    return lambda context: logits.clone()


def test_eq23_read_as_conditionals_is_not_lossless_hand_example(monkeypatch):
    """Counterexample kept visible (docs/verifiers.md): target (0.4, 0.6) and draft (0.8, 0.2)
    at every position, gamma = 2. P(first two tokens = (1, 0)) must be 0.24; the joint
    reading of Eq. (23) gives 0.16 (accepted block 10) + 0.4 (tau = 0, Y = 1) * 0.2 (modified
    row (0.2, 0.8)) = 0.24, the conditional reading makes the modified row a point mass on 1
    and gives 0.16."""
    target_fn, draft_fn = _constant_model([0.4, 0.6]), _constant_model([0.8, 0.2])
    exact = target_law(target_fn, PROMPT, 2)
    joint = speculative_law(draft_fn, target_fn, PROMPT, 2, gamma=2, method="greedy_block")
    assert total_variation(joint, exact) < EXACT_TOLERANCE
    spec = _conditional_reading_verifier()
    _use_verifier(monkeypatch, spec)
    conditional = speculative_law(draft_fn, target_fn, PROMPT, 2, gamma=2, method="greedy_block")
    assert exact[(1, 0)] == pytest.approx(0.24, abs=1e-12)
    assert conditional[(1, 0)] == pytest.approx(0.16, abs=1e-12)
    assert total_variation(conditional, exact) == pytest.approx(0.08, abs=1e-12)


def test_eq23_read_as_conditionals_is_not_lossless_on_context_dependent_models(monkeypatch):
    spec = _conditional_reading_verifier()
    _use_verifier(monkeypatch, spec)
    vocab, gamma, length, seed, mask_prob = NESTED_CASE
    draft_fn, target_fn = model_pair(vocab, seed, mask_prob=mask_prob)
    law = speculative_law(draft_fn, target_fn, PROMPT, length, gamma=gamma, method="greedy_block")
    assert total_variation(law, target_law(target_fn, PROMPT, length)) > 1e-4


def test_reference_re_exports_the_ensemble_loop():
    from verifiers.reference import ensemble_generate
    from verifiers.reference.ensemble import ensemble_generate as original

    assert ensemble_generate is original


# Sampling: a real torch.Generator through the whole loop. Significance level: the test fails
# when p < 1e-4; seeds are fixed, so the outcome is deterministic.
SAMPLES = 1500
SIGNIFICANCE = 1e-4


@pytest.mark.slow  # sampling; the exact enumerations above are the fast proof
@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_sampled_sequences_fit_the_target_law(method):
    draft_fn, target_fn = model_pair(3, 50)
    generator = torch.Generator().manual_seed(1234)
    samples = [
        tuple(speculative_generate(draft_fn, target_fn, PROMPT, 3, gamma=2, method=method, generator=generator)[0])
        for _ in range(SAMPLES)
    ]
    assert chi_square_pvalue(samples, target_law(target_fn, PROMPT, 3)) > SIGNIFICANCE


def test_chi_square_detects_a_wrong_law():
    """The goodness-of-fit check has power at this sample size: samples of the draft model
    are rejected against the target law."""
    draft_fn, target_fn = model_pair(3, 50)
    generator = torch.Generator().manual_seed(1234)
    samples = [tuple(autoregressive_generate(draft_fn, PROMPT, 3, generator=generator)[0]) for _ in range(SAMPLES)]
    assert chi_square_pvalue(samples, target_law(target_fn, PROMPT, 3)) < SIGNIFICANCE


# Interface contract.


@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_generate_returns_exactly_max_new_tokens_and_stats(method):
    draft_fn, target_fn = model_pair(3, 7)
    tokens, stats = speculative_generate(
        draft_fn, target_fn, PROMPT, 7, gamma=3, method=method, generator=torch.Generator().manual_seed(1)
    )
    assert len(tokens) == 7 and all(0 <= t < 3 for t in tokens)
    assert stats["target_calls"] == len(stats["accepted"]) == stats["iterations"]
    assert stats["draft_calls"] == 3 * stats["iterations"]
    assert sum(a + 1 for a in stats["accepted"]) >= 7 > sum(a + 1 for a in stats["accepted"][:-1])
    assert all(0 <= a <= 3 for a in stats["accepted"])


def test_same_seed_same_tokens_and_the_stream_layout_is_the_contract():
    """Replaying the documented random-stream contract by hand gives the same tokens."""
    from verifiers.randomness import split_sources
    from verifiers.sampling import logits_to_probs
    from verifiers.single_draft import verify_block

    draft_fn, target_fn = model_pair(4, 8)
    tokens, _ = speculative_generate(
        draft_fn, target_fn, PROMPT, 12, gamma=4, method="block", generator=torch.Generator().manual_seed(5)
    )
    again, _ = speculative_generate(
        draft_fn, target_fn, PROMPT, 12, gamma=4, method="block", generator=torch.Generator().manual_seed(5)
    )
    assert tokens == again

    def rows(fn, ctx):
        return logits_to_probs(fn(ctx), temperature=1.0)

    draft_source, verify_source = split_sources(torch.Generator().manual_seed(5), 2)
    context, replayed = PROMPT, []
    while len(replayed) < 12:
        draft, draft_rows = [], []
        for _ in range(4):
            row = rows(draft_fn, context + tuple(draft))[None]  # [K=1, V]
            draft.append(int(draft_source.categorical(row)[0]))
            draft_rows.append(row[0])
        target_rows = [rows(target_fn, context + tuple(draft[:i])) for i in range(5)]
        result = verify_block(
            torch.tensor([draft]),
            torch.stack(draft_rows)[None],
            torch.stack(target_rows)[None],
            generator=verify_source,
        )
        replayed += result.emitted(0)
        context += tuple(result.emitted(0))
    assert replayed[:12] == tokens


def test_autoregressive_generate_has_the_target_law():
    _, target_fn = model_pair(3, 9)
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
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(draft_fn, target_fn, PROMPT, -1, gamma=2, method="token", generator=generator)
