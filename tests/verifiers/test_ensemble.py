"""Ensemble functions and the speculative ensemble (arXiv:2502.01662), proved by enumeration.

Exactness: ``exact_law`` runs :func:`verifiers.reference.ensemble.ensemble_generate` itself on
every branch of its random choices and compares the law of the generated tokens with
``sequence_law`` of the ensemble rows (TV < 1e-9). The tiny models are context dependent
(:class:`tests.verifiers.tiny_models.TinyModel`), so misaligned rows would show. Sizes are
chosen so every enumeration stays below ~1000 leaves (the file runs in about a minute on one
core).
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from tests.verifiers.tiny_models import TinyModel, chi_square_pvalue
from verifiers.ensemble import (
    contrastive_ensemble_logits,
    default_proposer,
    make_ensemble,
    member_probs,
    next_scorer,
    shared_vocab_logits,
    verify_segment,
    weighted_ensemble_logits,
)
from verifiers.reference.exact import exact_law, sequence_law, total_variation
from verifiers.randomness import split_sources
from verifiers.reference.ensemble import (
    ensemble_autoregressive_generate,
    ensemble_generate,
    ensemble_next_token_probs,
)
from verifiers.single_draft import verify_token
from verifiers.types import PAD_TOKEN
from verifiers.adaptive import AdaptiveGammaSettings, StepCosts

EXACT_TV = 1e-9
CHI_SQUARE_ALPHA = 1e-3  # fixed seeds: the outcome is deterministic; alpha bounds a false alarm
PROMPT = (1,)
NEG_INF = float("-inf")


def _members(vocabs: tuple[int, ...], seed: int, *, mask_prob: float = 0.0) -> list[TinyModel]:
    """Context-dependent members; member i > 0 resembles member 0 (partial agreement, so
    both acceptance and rejection branches are exercised)."""
    first = TinyModel(vocabs[0], seed, mask_prob=mask_prob)
    others = [
        TinyModel(vocab, seed + 101 * i, mask_prob=mask_prob, base=_truncated(first, vocab), noise=0.8)
        for i, vocab in enumerate(vocabs[1:], start=1)
    ]
    return [first, *others]


def _truncated(model: TinyModel, vocab: int):
    """``model``'s logits resized to ``vocab`` entries (padded with fresh values if larger),
    so members of different vocabulary sizes can still resemble each other."""

    def logits(context: tuple[int, ...]) -> torch.Tensor:
        base = model(context)
        if base.shape[0] >= vocab:
            return base[:vocab]
        return torch.cat([base, torch.zeros(vocab - base.shape[0], dtype=torch.float64)])

    return logits


def _ensemble_law(model_fns, length: int, **ensemble_args) -> dict[tuple[int, ...], float]:
    return sequence_law(ensemble_next_token_probs(model_fns, **ensemble_args), PROMPT, length)


def _speculative_law(model_fns, length: int, **kwargs) -> dict[Hashable, float]:
    def procedure(source) -> Hashable:
        tokens, _ = ensemble_generate(model_fns, PROMPT, length, generator=source, **kwargs)
        assert len(tokens) == length
        return tuple(tokens)

    return exact_law(procedure, max_leaves=20_000)


# --------------------------------------------------------------------------------------------
# Ensemble functions
# --------------------------------------------------------------------------------------------


def test_weighted_ensemble_is_the_probability_mixture_of_eq4():
    member_logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = (0.5, 0.3, 0.2)
    rows = make_ensemble("weighted", 3, weights=weights).probs(member_logits, temperature=1.0)  # [5, 7]
    mixture = sum(w * torch.softmax(member_logits[i], dim=-1) for i, w in enumerate(weights))
    torch.testing.assert_close(rows, mixture, rtol=0, atol=1e-14)


def test_weighted_ensemble_default_weights_are_uniform():
    member_logits = torch.randn(2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    uniform = make_ensemble("weighted", 2).probs(member_logits, temperature=1.0)
    explicit = make_ensemble("weighted", 2, weights=[0.5, 0.5]).probs(member_logits, temperature=1.0)
    torch.testing.assert_close(uniform, explicit, rtol=0, atol=0)


@pytest.mark.parametrize(
    "weights, match",
    [((0.5,), "expected 2 weights"), ((0.7, 0.7), "sum to 1"), ((1.5, -0.5), ">= 0"), ((float("nan"), 1.0), ">= 0")],
)
def test_weighted_ensemble_rejects_bad_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        make_ensemble("weighted", 2, weights=weights)


def test_contrastive_ensemble_is_eq5():
    expert, amateur = torch.randn(2, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mu = 0.3
    rows = make_ensemble("contrastive", 2, mu=mu).probs(torch.stack([expert, amateur]), temperature=1.0)
    torch.testing.assert_close(rows, torch.softmax(expert - mu * amateur, dim=-1), rtol=0, atol=1e-15)


def test_contrastive_ensemble_takes_expert_and_amateur_only():
    with pytest.raises(ValueError, match="exactly 2 members"):
        make_ensemble("contrastive", 3)
    with pytest.raises(ValueError, match="weighted ensembles only"):
        make_ensemble("contrastive", 2, weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="mu"):
        make_ensemble("contrastive", 2, mu=-1.0)


def test_contrastive_after_top_k_has_no_nan():
    """-inf - mu * (-inf) is NaN in IEEE arithmetic; top-k'd members produce exactly that."""
    expert = torch.tensor([2.0, NEG_INF, 1.0, NEG_INF, 0.5], dtype=torch.float64)
    amateur = torch.tensor([1.0, NEG_INF, NEG_INF, 3.0, -1.0], dtype=torch.float64)
    mu = 0.5
    logits = contrastive_ensemble_logits(expert, amateur, mu)
    assert not bool(torch.isnan(logits).any())
    assert not bool((logits == float("inf")).any())
    # Expert -inf stays -inf (tokens 1, 3); amateur-only -inf (token 2) takes the amateur's
    # smallest finite logit (-1.0).
    expected = torch.tensor([2.0 - 0.5, NEG_INF, 1.0 + 0.5, NEG_INF, 0.5 + 0.5], dtype=torch.float64)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    for temperature in (0.0, 0.7, 1.0):
        rows = make_ensemble("contrastive", 2, mu=mu).probs(torch.stack([expert, amateur]), temperature=temperature)
        assert bool(torch.isfinite(rows).all())
        assert abs(float(rows.sum()) - 1.0) < 1e-12
        assert float(rows[1]) == 0.0 and float(rows[3]) == 0.0


def test_contrastive_is_invariant_to_logit_shifts_with_masks():
    expert = torch.tensor([2.0, NEG_INF, 1.0, 0.0], dtype=torch.float64)
    amateur = torch.tensor([1.0, 0.5, NEG_INF, 3.0], dtype=torch.float64)
    function = make_ensemble("contrastive", 2, mu=0.4)
    rows = function.probs(torch.stack([expert, amateur]), temperature=1.0)
    shifted = function.probs(torch.stack([expert + 3.0, amateur - 7.0]), temperature=1.0)
    torch.testing.assert_close(rows, shifted, rtol=0, atol=1e-14)


def _argmax_trap_members() -> torch.Tensor:
    """Member 0 prefers token 0, member 1 token 1, yet the mixture prefers token 2."""
    probs = torch.tensor([[0.5, 0.1, 0.4], [0.1, 0.5, 0.4]], dtype=torch.float64)
    return torch.log(probs)  # [2, 3]


def test_temperature_zero_is_the_argmax_of_the_ensemble_not_of_a_member():
    member_logits = _argmax_trap_members()
    greedy = make_ensemble("weighted", 2).probs(member_logits, temperature=0.0)
    assert greedy.tolist() == [0.0, 0.0, 1.0]
    member_greedy = member_probs(member_logits, temperature=0.0)
    assert member_greedy.argmax(dim=-1).tolist() == [0, 1]
    # Contrastive: expert argmax 0, but 0 is the amateur's favourite too and loses.
    expert = torch.tensor([1.0, 0.9, 0.0], dtype=torch.float64)
    amateur = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)
    contrastive = make_ensemble("contrastive", 2, mu=0.5).probs(torch.stack([expert, amateur]), temperature=0.0)
    assert contrastive.tolist() == [0.0, 1.0, 0.0]


def test_temperature_applies_once_to_the_ensemble_logits():
    member_logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    function = make_ensemble("weighted", 2, weights=[0.25, 0.75])
    mixture = function.probs(member_logits, temperature=1.0)
    sharpened = function.probs(member_logits, temperature=0.5)
    torch.testing.assert_close(sharpened, mixture**2 / (mixture**2).sum(), rtol=0, atol=1e-14)
    assert weighted_ensemble_logits(member_logits, (0.25, 0.75)).shape == (5,)


def test_shared_vocab_truncates_to_the_smallest_member():
    small = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    large = torch.tensor([2.0, 1.0, 0.0, 9.0, 9.0], dtype=torch.float64)
    stacked = shared_vocab_logits([small, large])  # [2, 3]
    assert stacked.shape == (2, 3)
    rows = make_ensemble("weighted", 2).probs(stacked, temperature=1.0)
    expected = 0.5 * torch.softmax(small, -1) + 0.5 * torch.softmax(large[:3], -1)
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-15)


def test_ensemble_functions_do_not_modify_inputs():
    expert = torch.tensor([2.0, NEG_INF, 1.0], dtype=torch.float64)
    amateur = torch.tensor([NEG_INF, 0.5, 1.0], dtype=torch.float64)
    expert_copy, amateur_copy = expert.clone(), amateur.clone()
    contrastive_ensemble_logits(expert, amateur, 0.2)
    member_logits = torch.stack([expert, amateur])
    stacked_copy = member_logits.clone()
    make_ensemble("weighted", 2).probs(member_logits, temperature=0.7)
    assert torch.equal(expert, expert_copy) and torch.equal(amateur, amateur_copy)
    assert torch.equal(member_logits, stacked_copy)


def test_default_proposer_and_next_scorer_tie_breaks():
    assert default_proposer([2, 3, 3]) == 1
    assert default_proposer([1, 1]) == 0
    assert next_scorer([3, 0, 0]) == 1
    assert next_scorer([0, 2, 0]) == 0


# --------------------------------------------------------------------------------------------
# Segment verification (Speculative Ensemble, arXiv:2502.01662, Eq. 6)
# --------------------------------------------------------------------------------------------


def _random_rows(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("method", ["token", "block"])
def test_one_token_segment_emits_the_ensemble_law(method):
    """A proposal drawn from q, accepted with min(1, r/q), else corrected from (r - q)+:
    the emitted token (the proposal if accepted, else the correction) is distributed as r."""
    proposal_row, ensemble_row = _random_rows((2, 4), seed=4)

    def procedure(source) -> Hashable:
        proposal = int(source.categorical(proposal_row))
        verdict = verify_segment(
            torch.tensor([[proposal]]),
            proposal_row.view(1, 1, 4),
            ensemble_row.view(1, 1, 4),
            torch.tensor([2]),
            method=method,
            generator=source,
        )
        return tuple(verdict.emitted(0))

    law = exact_law(procedure)
    expected = {(v,): float(ensemble_row[v]) for v in range(4)}
    assert total_variation(law, expected) < EXACT_TV


@pytest.mark.parametrize("method", ["token", "block"])
def test_fully_accepted_segment_emits_no_bonus(method):
    rows = _random_rows((1, 3, 5), seed=5)  # proposer == ensemble: every token is accepted
    tokens = torch.tensor([[1, 4, 0]])
    rows_copy, tokens_copy = rows.clone(), tokens.clone()
    verdict = verify_segment(
        tokens, rows, rows, torch.tensor([3]), method=method, generator=torch.Generator().manual_seed(0)
    )
    assert bool(verdict.fully_accepted[0]) and int(verdict.num_accepted[0]) == 3
    assert verdict.emitted(0) == [1, 4, 0]
    assert verdict.tokens[0].tolist() == [1, 4, 0, PAD_TOKEN]
    assert torch.equal(rows, rows_copy) and torch.equal(tokens, tokens_copy)


def test_rejected_segment_emits_prefix_and_correction():
    proposal = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)  # [1, 2, 3]
    ensemble = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    verdict = verify_segment(
        torch.tensor([[1, 0]]), proposal, ensemble, torch.tensor([PAD_TOKEN]), method="token",
        generator=torch.Generator().manual_seed(0),
    )
    assert not bool(verdict.fully_accepted[0])
    assert verdict.emitted(0) == [1, 2]


def test_appending_the_verifiers_bonus_is_not_exact():
    """Negative control (Speculative Ensemble, arXiv:2502.01662, Sec. 3.3): plain speculative decoding with ensemble rows that
    appends the verifier's own bonus token emits the verifier's law at that position, not the
    ensemble's. Enumeration must see the difference, or it could not vouch for the loop."""
    model_fns = _members((3, 3), seed=27)
    function = make_ensemble("weighted", 2)

    def naive(source) -> Hashable:
        context = PROMPT
        proposal_row = member_probs(model_fns[0](context), temperature=1.0)  # [V]
        proposal = int(source.categorical(proposal_row))
        member_logits = torch.stack([fn(context) for fn in model_fns])  # [2, V]
        ensemble_row = function.probs(member_logits, temperature=1.0)  # [V]
        verifier_bonus_row = member_probs(model_fns[1](context + (proposal,)), temperature=1.0)  # [V]
        result = verify_token(
            torch.tensor([[proposal]]),
            proposal_row.view(1, 1, -1),
            torch.stack([ensemble_row, verifier_bonus_row]).unsqueeze(0),  # [1, 2, V]
            generator=source,
        )
        emitted = result.emitted(0)
        if len(emitted) == 1:  # rejected: one more token from the ensemble row
            next_logits = torch.stack([fn(context + tuple(emitted)) for fn in model_fns])
            emitted.append(int(source.categorical(function.probs(next_logits, temperature=1.0))))
        return tuple(emitted)

    expected = _ensemble_law(model_fns, 2)
    assert total_variation(exact_law(naive), expected) > 1e-3
    law = _speculative_law(model_fns, 2, gammas=(1, 1))
    assert total_variation(law, expected) < EXACT_TV


def test_verify_segment_rejects_bad_arguments():
    rows = _random_rows((1, 2, 3), seed=6)
    with pytest.raises(ValueError, match="method"):
        verify_segment(torch.tensor([[0, 1]]), rows, rows, torch.tensor([0]), method="greedy_block", generator=torch.Generator())
    with pytest.raises(ValueError, match="next_tokens"):
        verify_segment(torch.tensor([[0, 1]]), rows, rows, torch.tensor([3]), method="token", generator=torch.Generator())


# --------------------------------------------------------------------------------------------
# The speculative ensemble loop: exact enumeration
# --------------------------------------------------------------------------------------------

EXACT_CASES = [
    # id, member vocabs, gammas, length, ensemble kwargs, model seed
    ("weighted-2", (3, 3), (2, 2), 3, {"ensemble": "weighted", "weights": (0.3, 0.7)}, 21),
    ("weighted-2-unequal-gammas", (2, 2), (3, 2), 4, {"ensemble": "weighted"}, 22),
    ("weighted-3", (2, 2, 2), (2, 1, 2), 4, {"ensemble": "weighted", "weights": (0.5, 0.2, 0.3)}, 23),
    ("weighted-3-middle-member-default", (2, 2, 2), (1, 2, 1), 4, {"ensemble": "weighted"}, 24),
    ("contrastive-2", (3, 3), (2, 2), 3, {"ensemble": "contrastive", "mu": 0.5}, 25),
    ("contrastive-2-amateur-proposes", (2, 2), (2, 3), 4, {"ensemble": "contrastive", "mu": 0.3}, 26),
]
#: Cases left to the slow tier (make test-rest); the fast tier keeps a weighted and a contrastive one.
SLOW_EXACT_CASES = {"weighted-2", "weighted-3", "weighted-3-middle-member-default", "contrastive-2-amateur-proposes"}


def _case_params(cases):
    """pytest params of ``cases`` named by their id, those in SLOW_EXACT_CASES marked slow."""
    return [pytest.param(case, id=case[0], marks=[pytest.mark.slow] if case[0] in SLOW_EXACT_CASES else []) for case in cases]


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("case", _case_params(EXACT_CASES))
def test_speculative_ensemble_is_exact(case, method):
    _, vocabs, gammas, length, ensemble_args, seed = case
    model_fns = _members(vocabs, seed=seed)
    expected = _ensemble_law(model_fns, length, **ensemble_args)
    law = _speculative_law(model_fns, length, gammas=gammas, method=method, **ensemble_args)
    assert total_variation(law, expected) < EXACT_TV


def _mode(mode: str) -> StepCosts:
    """Step costs naming the step's mode: the scheduler's decision from measured goodput."""
    return StepCosts(draft_s=0.0, verify_s=(0.01,), overhead_s=0.0, plain_s=0.01, plain_overhead_s=0.0,
                     plain_tokens=1, mode=mode)


#: The scripted modes: plain ensemble steps, proposals, the request alone (``any``: proposals).
MODE_SCRIPT = (_mode("plain"), _mode("speculative"), _mode("any"), _mode("speculative"), _mode("plain"),
               _mode("speculative"), _mode("plain"))


class _ModeScript:
    """The mode of each step from the script, indexed by the machine's past (iterations so far
    and the tokens committed): a function of the past only, different on different branches."""

    def __init__(self, machine):
        self.machine = machine
        self.iterations = 0  # asked once per iteration

    def __call__(self) -> StepCosts:
        self.iterations += 1
        return MODE_SCRIPT[(self.iterations + sum(self.machine.committed)) % len(MODE_SCRIPT)]


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("case", _case_params([EXACT_CASES[1], EXACT_CASES[2], EXACT_CASES[5]]))
def test_gamma_auto_with_a_scripted_mode_sequence_keeps_the_ensemble_law(case, method):
    """gamma "auto" of the alternate proposer: plain ensemble steps where the (scripted) measured
    mode says plain (dropping unverified queued tokens), proposals elsewhere; the law is the
    ensemble's."""
    _, vocabs, gammas, length, ensemble_args, seed = case
    model_fns = _members(vocabs, seed=seed)
    kinds: set[str] = set()

    def procedure(source) -> Hashable:
        tokens, stats = ensemble_generate(model_fns, PROMPT, length, generator=source, gammas=gammas, method=method,
                                          adaptive=AdaptiveGammaSettings(gamma_max=max(gammas)),
                                          step_costs=_ModeScript, **ensemble_args)
        kinds.update({"plain"} if stats["plain_steps"] else set())
        kinds.update({"verified"} if stats["verifications"] else set())
        kinds.update({"mixed"} if stats["plain_steps"] and stats["verifications"] else set())
        kinds.update({"dropped"} if stats["dropped_tokens"] else set())
        return tuple(tokens)

    law = exact_law(procedure, max_leaves=50_000)
    assert kinds == {"plain", "verified", "mixed", "dropped"}, kinds
    assert total_variation(law, _ensemble_law(model_fns, length, **ensemble_args)) < EXACT_TV


def test_negative_control_a_plain_step_from_one_member_fails(monkeypatch):
    """Plain steps drawn from member 0's row instead of the ensemble row change the law: the
    enumeration above can fail."""
    import verifiers.machines.ensemble as ensemble_machines

    _, vocabs, gammas, length, ensemble_args, seed = EXACT_CASES[1]
    model_fns = _members(vocabs, seed=seed)
    original = ensemble_machines.plain_ensemble_draw

    def first_member_draw(law, results, committed, source):
        return original(law, [results[0]] * len(results), committed, source)

    monkeypatch.setattr(ensemble_machines, "plain_ensemble_draw", first_member_draw)

    def procedure(source) -> Hashable:
        tokens, _ = ensemble_generate(model_fns, PROMPT, length, generator=source, gammas=gammas, method="token",
                                      adaptive=AdaptiveGammaSettings(gamma_max=3), step_costs=_ModeScript,
                                      **ensemble_args)
        return tuple(tokens)

    law = exact_law(procedure, max_leaves=50_000)
    assert total_variation(law, _ensemble_law(model_fns, length, **ensemble_args)) > 1e-3


@pytest.mark.parametrize("method", ["token", "block"])
def test_speculative_ensemble_is_exact_with_temperature_top_k_and_masked_logits(method):
    model_fns = _members((3, 3), seed=7, mask_prob=0.3)
    sampling = {"temperature": 0.6, "top_k": 2}
    expected = _ensemble_law(model_fns, 3, ensemble="contrastive", mu=0.7, **sampling)
    law = _speculative_law(model_fns, 3, gammas=(2, 2), method=method, ensemble="contrastive", mu=0.7, **sampling)
    assert total_variation(law, expected) < EXACT_TV


@pytest.mark.parametrize("ensemble", ["weighted", pytest.param("contrastive", marks=pytest.mark.slow)])
def test_speculative_ensemble_is_exact_with_different_vocab_sizes(ensemble):
    model_fns = _members((3, 4), seed=8)
    expected = _ensemble_law(model_fns, 3, ensemble=ensemble)
    law = _speculative_law(model_fns, 3, gammas=(2, 2), method="token", ensemble=ensemble)
    assert total_variation(law, expected) < EXACT_TV
    assert all(token < 3 for outcome in law for token in outcome)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize(
    "vocabs, gammas, ensemble_args",
    [
        ((4, 4), (2, 3), {"ensemble": "weighted"}),
        ((4, 4, 4), (3, 2, 1), {"ensemble": "weighted", "weights": (0.2, 0.5, 0.3)}),
        ((4, 4), (3, 2), {"ensemble": "contrastive", "mu": 0.8}),
    ],
)
def test_temperature_zero_generates_the_ensemble_argmax(vocabs, gammas, ensemble_args, method):
    model_fns = _members(vocabs, seed=9)
    length = 6
    expected = _ensemble_law(model_fns, length, temperature=0.0, **ensemble_args)
    assert len(expected) == 1
    law = _speculative_law(model_fns, length, gammas=gammas, method=method, temperature=0.0, **ensemble_args)
    assert law.keys() == expected.keys()
    ((greedy, _),) = expected.items()
    context = PROMPT
    next_probs = ensemble_next_token_probs(model_fns, temperature=1.0, **ensemble_args)
    for token in greedy:  # the greedy path follows the argmax of the ensemble at every step
        assert token == int(torch.argmax(next_probs(context)))
        context = context + (token,)


@pytest.mark.parametrize(
    "vocabs, ensemble_args",
    [((3, 3), {"ensemble": "weighted", "weights": (0.6, 0.4)}), ((3, 3), {"ensemble": "contrastive"}),
     ((2, 3, 2), {"ensemble": "weighted"})],
)
def test_standard_ensemble_loop_is_exact(vocabs, ensemble_args):
    model_fns = _members(vocabs, seed=10)
    expected = _ensemble_law(model_fns, 3, **ensemble_args)

    def procedure(source) -> Hashable:
        tokens, stats = ensemble_autoregressive_generate(model_fns, PROMPT, 3, generator=source, **ensemble_args)
        assert stats["model_calls"] == [3] * len(vocabs)
        return tuple(tokens)

    assert total_variation(exact_law(procedure), expected) < EXACT_TV


# --------------------------------------------------------------------------------------------
# The loop: sampling through a real torch.Generator
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # sampling; the exact enumerations above are the fast proof
@pytest.mark.parametrize(
    "vocabs, gammas, method, ensemble_args, seed",
    [
        ((3, 3, 3), (2, 2, 1), "token", {"ensemble": "weighted"}, 11),
        ((3, 3), (2, 3), "block", {"ensemble": "contrastive", "mu": 0.5}, 12),
    ],
)
def test_speculative_ensemble_samples_pass_chi_square(vocabs, gammas, method, ensemble_args, seed):
    model_fns = _members(vocabs, seed=seed)
    length, num_samples = 3, 1500
    expected = _ensemble_law(model_fns, length, **ensemble_args)
    generator = torch.Generator().manual_seed(seed)
    samples = [
        tuple(ensemble_generate(model_fns, PROMPT, length, gammas=gammas, method=method, generator=generator, **ensemble_args)[0])
        for _ in range(num_samples)
    ]
    assert chi_square_pvalue(samples, expected) > CHI_SQUARE_ALPHA


def test_standard_ensemble_samples_pass_chi_square():
    model_fns = _members((3, 3), seed=13)
    expected = _ensemble_law(model_fns, 3, ensemble="contrastive", mu=0.4)
    generator = torch.Generator().manual_seed(13)
    samples = [
        tuple(ensemble_autoregressive_generate(model_fns, PROMPT, 3, ensemble="contrastive", mu=0.4, generator=generator)[0])
        for _ in range(1500)
    ]
    assert chi_square_pvalue(samples, expected) > CHI_SQUARE_ALPHA


# --------------------------------------------------------------------------------------------
# The loop: schedule, calls, streams
# --------------------------------------------------------------------------------------------


def test_alternate_proposer_schedule_and_calls_when_everything_is_accepted():
    """Identical members at T = 0 accept every token. Alg. 1 with gammas (3, 2) and 5 tokens:
    member 0 proposes 3 (3 calls); member 1 scores them, draws its bonus and proposes 1 more
    (2 calls); member 0's 3 are accepted; member 0 scores member 1's 2 (1 call, no room for a
    bonus); they are accepted."""
    model = TinyModel(4, seed=14)
    tokens, stats = ensemble_generate(
        [model, model], PROMPT, 5, gammas=(3, 2), temperature=0.0, generator=torch.Generator().manual_seed(0)
    )
    expected = _ensemble_law([model, model], 5, temperature=0.0)
    assert tuple(tokens) in expected
    assert stats["model_calls"] == [4, 2]
    assert stats["proposers"] == [0, 1]
    assert stats["accepted"] == [3, 2]
    baseline = ensemble_autoregressive_generate([model, model], PROMPT, 5, temperature=0.0, generator=torch.Generator())
    assert baseline[0] == tokens and baseline[1]["model_calls"] == [5, 5]


def test_n_model_chain_follows_the_round_robin_of_alg2():
    """App. B.2 Fig. 7 (gammas 3, 2, 1): segments of 3, 2 and 1 tokens by members 0, 1, 2,
    then member 0 again, ...; every member's calls = its proposals + its scoring calls.

    12 tokens: m0 proposes 3 | m1 scores, bonus + 1 | m2 scores, bonus | verify m0's 3 |
    m0 scores, bonus + 2 | verify m1's 2 | m1 scores, bonus + 1 | verify m2's 1 | m2 scores,
    bonus (room 1) | verify m0's 3 | m0 scores (room 0) | verify m1's 2 | m1 scores | verify
    m2's 1. Calls: m0 3 + 3 + 1, m1 2 + 2 + 1, m2 1 + 1 (the standard ensemble: 12 each)."""
    model = TinyModel(4, seed=15)
    _, stats = ensemble_generate(
        [model] * 3, PROMPT, 12, gammas=(3, 2, 1), temperature=0.0, generator=torch.Generator().manual_seed(0)
    )
    assert stats["proposers"] == [0, 1, 2, 0, 1, 2]
    assert stats["segment_lengths"] == [3, 2, 1, 3, 2, 1]
    assert stats["accepted"] == [3, 2, 1, 3, 2, 1]
    # member 0: 3 proposals + (score + 2 proposals) + final score over the last 3 queued;
    # member 1: (score + 1) twice; member 2: one score per segment it heads, plus the final one.
    assert stats["model_calls"] == [7, 5, 2]


@pytest.mark.parametrize("seed", [16, 17, 18])
def test_after_a_rejection_the_default_proposer_restarts(seed):
    model_fns = _members((3, 3, 3), seed=seed)
    gammas = (2, 3, 1)
    _, stats = ensemble_generate(model_fns, PROMPT, 40, gammas=gammas, generator=torch.Generator().manual_seed(seed))
    rejections = 0
    committed = 0
    for k in range(len(stats["accepted"]) - 1):
        rejected = stats["accepted"][k] < stats["segment_lengths"][k]
        committed += stats["accepted"][k] + int(rejected)
        if rejected:
            rejections += 1
            assert stats["proposers"][k + 1] == default_proposer(gammas) == 1
            assert stats["segment_lengths"][k + 1] == min(gammas[1], 40 - committed)
    assert rejections > 0
    assert set(stats["proposers"]) == {0, 1, 2}  # the alternate proposers did propose


def test_same_seed_same_tokens_and_streams_follow_split_sources():
    model_fns = _members((3, 3), seed=19)
    runs = [
        ensemble_generate(model_fns, PROMPT, 12, gammas=(2, 2), generator=torch.Generator().manual_seed(5))[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    # The default proposer (member 0) draws its first token with stream 0's first categorical.
    sources = split_sources(torch.Generator().manual_seed(5), 3)
    first_row = member_probs(torch.as_tensor(model_fns[0](PROMPT)), temperature=1.0)  # [V]
    first_proposal = int(sources[0].categorical(first_row))
    _, stats = ensemble_generate(model_fns, PROMPT, 12, gammas=(2, 2), generator=torch.Generator().manual_seed(5))
    assert stats["proposers"][0] == 0
    if stats["accepted"][0] > 0:
        assert runs[0][0] == first_proposal


def test_ensemble_generate_rejects_bad_arguments():
    model_fns = _members((3, 3), seed=20)
    with pytest.raises(ValueError, match="gammas"):
        ensemble_generate(model_fns, PROMPT, 3, gammas=(2,), generator=torch.Generator())
    with pytest.raises(ValueError, match="gamma"):
        ensemble_generate(model_fns, PROMPT, 3, gammas=(2, 0), generator=torch.Generator())
    with pytest.raises(ValueError, match="exactly 2 members"):
        ensemble_generate(model_fns * 2, PROMPT, 3, gammas=(1, 1, 1, 1), ensemble="contrastive", generator=torch.Generator())
    with pytest.raises(ValueError, match="method"):
        ensemble_generate(model_fns, PROMPT, 3, gammas=(1, 1), method="spectr", generator=torch.Generator())
    with pytest.raises(ValueError, match="max_new_tokens"):
        ensemble_generate(model_fns, PROMPT, -1, gammas=(1, 1), generator=torch.Generator())
    assert ensemble_generate(model_fns, PROMPT, 0, gammas=(1, 1), generator=torch.Generator())[0] == []
