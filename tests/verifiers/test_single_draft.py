"""Single-draft verifiers at the level of one call: the paper's analytic example, the
acceptance-length guarantees, batching, numerics and argument checks. (The lossless proofs
over whole decode loops are in test_reference.py.)"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from tests.verifiers.tiny_models import expected_value_law, model_pair
from verifiers.reference.exact import exact_law, sequence_law
from verifiers.registry import (
    UnknownVerifierError,
    VerifierSpec,
    available_verifiers,
    get_verifier,
    verifier_names,
)
from verifiers.sampling import logits_to_probs
from verifiers.single_draft import GreedyBlockState, verify_block, verify_greedy_block, verify_token
from verifiers.types import PAD_TOKEN

VERIFIERS = {"token": verify_token, "block": verify_block, "greedy_block": verify_greedy_block}


def _iid_rows(row: list[float], count: int) -> torch.Tensor:
    return torch.tensor([row] * count, dtype=torch.float64)


def _one_call_expected_accepted(verify, draft_rows_fn, target_rows_fn, gamma: int) -> float:
    """Exact E[num_accepted] of one verifier call on a draft block sampled from the draft:
    ``*_rows_fn(prefix) -> [V]`` give the rows after a draft prefix."""

    def procedure(source):
        draft, draft_rows = [], []
        for _ in range(gamma):
            row = draft_rows_fn(tuple(draft))
            draft.append(int(source.categorical(row)))
            draft_rows.append(row)
        target_rows = [target_rows_fn(tuple(draft[:i])) for i in range(gamma + 1)]
        result = verify(
            torch.tensor([draft]), torch.stack(draft_rows)[None], torch.stack(target_rows)[None], generator=source
        )
        return int(result.num_accepted[0])

    return expected_value_law(exact_law(procedure), float)


# --- Analytic: the two-token example of Sec. 2 (files 000/003) --------------------------

TARGET_ROW = [1 / 3, 2 / 3]  # M_b(a) = 1/3, M_b(b) = 2/3
DRAFT_ROW = [2 / 3, 1 / 3]  # M_s(a) = 2/3, M_s(b) = 1/3


@pytest.mark.parametrize(
    ("method", "expected"),
    [("token", Fraction(10, 9)), ("block", Fraction(11, 9)), ("greedy_block", Fraction(12, 9))],
)
def test_paper_example_expected_accepted_tokens(method, expected):
    """gamma = 2: token verification accepts 10/9 tokens on average, block verification 11/9
    (Sec. 2), and greedy block verification's first iteration reaches the 12/9 of the ideal
    coupling (Lemma 7: sum over l and x^l of min(M_s(x^l), M_b(x^l)))."""
    value = _one_call_expected_accepted(
        VERIFIERS[method],
        lambda prefix: torch.tensor(DRAFT_ROW, dtype=torch.float64),
        lambda prefix: torch.tensor(TARGET_ROW, dtype=torch.float64),
        gamma=2,
    )
    assert value == pytest.approx(float(expected), abs=1e-12)


def _model_rows(model_fn, prompt):
    return lambda prefix: logits_to_probs(model_fn(prompt + prefix), temperature=1.0)


@pytest.mark.parametrize(("vocab", "gamma", "seed"), [(2, 3, 0), (3, 2, 1), (3, 3, 2), (4, 2, 3)])
def test_acceptance_ordering_token_block_greedy_on_random_models(vocab, gamma, seed):
    """Exact E[tau] of one call: token <= block (Theorem 2) <= greedy first call (Theorem 3),
    and greedy equals Lemma 7's sum_l sum_{x^l} min(M_s(x^l), M_b(x^l))."""
    draft_fn, target_fn = model_pair(vocab, seed)
    prompt = (0,)
    draft_rows, target_rows = _model_rows(draft_fn, prompt), _model_rows(target_fn, prompt)
    accepted = {
        name: _one_call_expected_accepted(verify, draft_rows, target_rows, gamma) for name, verify in VERIFIERS.items()
    }
    assert accepted["token"] <= accepted["block"] + 1e-12
    assert accepted["block"] <= accepted["greedy_block"] + 1e-12
    lemma7 = 0.0
    for length in range(1, gamma + 1):
        draft_law = sequence_law(draft_rows, (), length)
        target_law = sequence_law(target_rows, (), length)
        lemma7 += sum(min(p, target_law.get(x, 0.0)) for x, p in draft_law.items())
    assert accepted["greedy_block"] == pytest.approx(lemma7, abs=1e-12)


def test_block_beats_token_strictly_somewhere():
    """Not a vacuous ordering: on the paper's example block verification is strictly better."""
    draft_rows = lambda prefix: torch.tensor(DRAFT_ROW, dtype=torch.float64)  # noqa: E731
    target_rows = lambda prefix: torch.tensor(TARGET_ROW, dtype=torch.float64)  # noqa: E731
    token = _one_call_expected_accepted(verify_token, draft_rows, target_rows, 2)
    block = _one_call_expected_accepted(verify_block, draft_rows, target_rows, 2)
    assert block - token == pytest.approx(1 / 9, abs=1e-12)


# --- One-call behaviour -------------------------------------------------------------------


@pytest.mark.parametrize("method", list(VERIFIERS))
def test_identical_rows_accept_the_whole_block_and_draw_the_bonus_from_target(method):
    rows = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.25, 0.25, 0.5]], dtype=torch.float64)
    law = exact_law(
        lambda source: tuple(
            VERIFIERS[method](torch.tensor([[1, 0]]), rows[None, :2], rows[None], generator=source).emitted(0)
        )
    )
    assert law == pytest.approx({(1, 0, 0): 0.25, (1, 0, 1): 0.25, (1, 0, 2): 0.5}, abs=1e-15)


@pytest.mark.parametrize("method", list(VERIFIERS))
@pytest.mark.parametrize(
    ("draft_tokens", "target_argmax", "expected"),
    [
        ([1, 2, 3, 4], [1, 2, 3, 4, 0], [1, 2, 3, 4, 0]),
        ([1, 2, 3, 4], [1, 2, 0, 4, 2], [1, 2, 0]),
        ([1, 2, 3, 4], [3, 2, 3, 4, 2], [3]),
        ([0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1]),
    ],
)
def test_one_hot_rows_emit_the_target_argmax(method, draft_tokens, target_argmax, expected):
    """Temperature 0: every rule keeps the prefix the target agrees with, then the target's
    argmax (deterministically)."""
    draft_probs = torch.nn.functional.one_hot(torch.tensor(draft_tokens), 5).to(torch.float64)[None]
    target_probs = torch.nn.functional.one_hot(torch.tensor(target_argmax), 5).to(torch.float64)[None]
    law = exact_law(
        lambda source: tuple(
            VERIFIERS[method](torch.tensor([draft_tokens]), draft_probs, target_probs, generator=source).emitted(0)
        )
    )
    assert law == {tuple(expected): 1.0}


@pytest.mark.parametrize("method", list(VERIFIERS))
def test_batch_rows_are_independent(method):
    """A batch of two rows has the product law of the rows verified alone (no mixing of rows,
    and for greedy_block each row's own state is applied and advanced)."""
    gamma, vocab = 3, 3
    generator = torch.Generator().manual_seed(7)
    target_probs = torch.softmax(2 * torch.randn(2, gamma + 1, vocab, generator=generator, dtype=torch.float64), -1)
    draft_probs = torch.softmax(2 * torch.randn(2, gamma, vocab, generator=generator, dtype=torch.float64), -1)
    draft_tokens = torch.tensor([[0, 2, 1], [1, 1, 0]])
    state = None
    if method == "greedy_block":
        state = GreedyBlockState(
            log_ratio=torch.tensor([[0.7, 0.2], [float("inf"), 0.0]], dtype=torch.float64),
            horizon=torch.tensor([[1, 2], [2, 0]]),
        )

    def outcome(result, row):
        extra = ()
        if result.state is not None:
            live = result.state.horizon[row] > 0
            extra = (
                tuple(result.state.horizon[row][live].tolist()),
                tuple(round(v, 9) for v in result.state.log_ratio[row][live].tolist()),
            )
        return (tuple(result.emitted(row)), extra)

    verify = VERIFIERS[method]
    joint = exact_law(
        lambda source: tuple(
            outcome(verify(draft_tokens, draft_probs, target_probs, generator=source, state=state), row)
            for row in range(2)
        )
    )
    singles = []
    for row in range(2):
        row_state = None if state is None else state.rows([row])
        singles.append(
            exact_law(
                lambda source, row=row, row_state=row_state: outcome(
                    verify(
                        draft_tokens[row : row + 1],
                        draft_probs[row : row + 1],
                        target_probs[row : row + 1],
                        generator=source,
                        state=row_state,
                    ),
                    0,
                )
            )
        )
    product = {(a, b): pa * pb for a, pa in singles[0].items() for b, pb in singles[1].items()}
    assert joint.keys() == product.keys()
    for key, prob in product.items():
        assert joint[key] == pytest.approx(prob, abs=1e-14)


@pytest.mark.parametrize("method", list(VERIFIERS))
def test_inputs_are_not_modified(method):
    generator = torch.Generator().manual_seed(3)
    target_probs = torch.softmax(torch.randn(2, 5, 6, generator=generator, dtype=torch.float64), -1)
    draft_probs = torch.softmax(torch.randn(2, 4, 6, generator=generator, dtype=torch.float64), -1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, 6), 1, generator=generator).reshape(2, 4)
    copies = [t.clone() for t in (draft_tokens, draft_probs, target_probs)]
    result = VERIFIERS[method](draft_tokens, draft_probs, target_probs, generator=generator)
    if method == "greedy_block":
        state_copy = (result.state.log_ratio.clone(), result.state.horizon.clone())
        VERIFIERS[method](draft_tokens, draft_probs, target_probs, generator=generator, state=result.state)
        assert torch.equal(result.state.log_ratio, state_copy[0]) and torch.equal(result.state.horizon, state_copy[1])
    for original, copy in zip((draft_tokens, draft_probs, target_probs), copies):
        assert torch.equal(original, copy)


@pytest.mark.parametrize("method", list(VERIFIERS))
@pytest.mark.parametrize("batch", [1, 8])
def test_large_vocab_rows_give_well_formed_results(method, batch):
    gamma, vocab = 8, 32000
    generator = torch.Generator().manual_seed(11)
    target_probs = torch.softmax(3 * torch.randn(batch, gamma + 1, vocab, generator=generator, dtype=torch.float64), -1)
    draft_logits = torch.log(target_probs[:, :gamma]) + torch.randn(batch, gamma, vocab, generator=generator, dtype=torch.float64)
    draft_probs = torch.softmax(draft_logits, -1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=generator).reshape(batch, gamma)
    result = VERIFIERS[method](draft_tokens, draft_probs, target_probs, generator=generator)
    assert result.tokens.shape == (batch, gamma + 1) and result.num_accepted.shape == (batch,)
    for row in range(batch):
        tau = int(result.num_accepted[row])
        assert 0 <= tau <= gamma
        assert result.tokens[row, :tau].tolist() == draft_tokens[row, :tau].tolist()
        assert 0 <= int(result.tokens[row, tau]) < vocab
        assert (result.tokens[row, tau + 1 :] == PAD_TOKEN).all()
    if method == "greedy_block":
        assert not torch.isnan(result.state.log_ratio).any()
        assert (result.state.horizon < gamma).all()


@pytest.mark.parametrize("method", list(VERIFIERS))
def test_extreme_ratios_do_not_overflow(method):
    """Ratios of 1e-150 / 1 over 4 positions multiply to 1e-600 (below float64): handled in
    log space without NaN, and the law stays exact (emitted tokens have target mass)."""
    tiny = 1e-150
    target_probs = _iid_rows([tiny, 1 - tiny], 5)[None]  # the draft tokens are nearly impossible
    draft_probs = _iid_rows([1 - tiny, tiny], 4)[None]
    law = exact_law(
        lambda source: tuple(
            VERIFIERS[method](torch.tensor([[0, 0, 0, 0]]), draft_probs, target_probs, generator=source).emitted(0)
        )
    )
    assert law[(1,)] == pytest.approx(1.0, abs=1e-12)
    huge = exact_law(
        lambda source: tuple(
            VERIFIERS[method](torch.tensor([[1, 1, 1, 1]]), draft_probs, target_probs, generator=source).emitted(0)
        )
    )
    assert sum(p for seq, p in huge.items() if seq[:4] == (1, 1, 1, 1)) == pytest.approx(1.0, abs=1e-12)


# --- greedy_block state ------------------------------------------------------------------


def test_greedy_state_after_a_rejection_holds_the_paper_example_modification():
    """Sec. C of 003: when aa is rejected and Y = b, the next position's modified target is a
    point mass on b; the state encodes rho = M_b(b) / M_s(b) = 2 over one position."""
    draft_probs = _iid_rows(DRAFT_ROW, 2)[None]
    target_probs = _iid_rows(TARGET_ROW, 3)[None]
    law = exact_law(
        lambda source: _summary(verify_greedy_block(torch.tensor([[0, 0]]), draft_probs, target_probs, generator=source))
    )
    assert law == pytest.approx({((0, 0, 0), ()): 1 / 12, ((0, 0, 1), ()): 1 / 6, ((1,), ((1, 2.0),)): 3 / 4})
    state = GreedyBlockState(log_ratio=torch.tensor([[math.log(2.0)]], dtype=torch.float64), horizon=torch.tensor([[1]]))
    # Next call: draft "a" again at the modified position -> never accepted, correction is b.
    next_law = exact_law(
        lambda source: tuple(
            verify_greedy_block(
                torch.tensor([[0, 0]]), draft_probs, target_probs, generator=source, state=state
            ).emitted(0)
        )
    )
    assert next_law == pytest.approx({(1,): 1.0})


def _summary(result):
    live = result.state.horizon[0] > 0
    levels = tuple(
        (int(h), round(math.exp(r), 12))
        for h, r in zip(result.state.horizon[0][live].tolist(), result.state.log_ratio[0][live].tolist())
    )
    return (tuple(result.emitted(0)), levels)


def test_greedy_state_rows_and_concat_round_trip():
    state = GreedyBlockState(
        log_ratio=torch.tensor([[0.5, 1.0], [0.25, 0.0]], dtype=torch.float64), horizon=torch.tensor([[2, 1], [3, 0]])
    )
    single = [state.rows([0]), state.rows([1])]
    merged = GreedyBlockState.concat([single[0], GreedyBlockState.empty(1), single[1]])
    assert merged.batch == 3
    assert torch.equal(merged.rows([0, 2]).horizon, state.horizon)
    assert torch.equal(merged.rows([0, 2]).log_ratio, state.log_ratio)
    assert (merged.rows([1]).horizon == 0).all()


def test_greedy_state_is_validated():
    rows = _iid_rows([0.5, 0.5], 3)[None]
    with pytest.raises(TypeError, match="GreedyBlockState"):
        verify_greedy_block(torch.tensor([[0, 1]]), rows[:, :2], rows, generator=torch.Generator(), state=[1])
    wide = GreedyBlockState(log_ratio=torch.zeros(2, 1, dtype=torch.float64), horizon=torch.ones(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch"):
        verify_greedy_block(torch.tensor([[0, 1]]), rows[:, :2], rows, generator=torch.Generator(), state=wide)
    long = GreedyBlockState(log_ratio=torch.zeros(1, 1, dtype=torch.float64), horizon=torch.tensor([[2]]))
    with pytest.raises(ValueError, match="gamma"):
        verify_greedy_block(torch.tensor([[0, 1]]), rows[:, :2], rows, generator=torch.Generator(), state=long)


# --- argument checks ---------------------------------------------------------------------


@pytest.mark.parametrize("method", list(VERIFIERS))
def test_bad_shapes_and_tokens_are_named(method):
    verify = VERIFIERS[method]
    rows = _iid_rows([0.5, 0.5], 3)[None]  # [1, 3, 2]
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(torch.tensor([0, 1]), rows[:, :2], rows, generator=generator)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(torch.tensor([[0, 1]]), rows, rows, generator=generator)
    with pytest.raises(ValueError, match="target_probs"):
        verify(torch.tensor([[0, 1]]), rows[:, :2], rows[:, :2], generator=generator)
    with pytest.raises(ValueError, match="draft_tokens must lie"):
        verify(torch.tensor([[0, 2]]), rows[:, :2], rows, generator=generator)
    zero_row = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]], dtype=torch.float64)
    with pytest.raises(ValueError, match="zero probability"):
        verify(torch.tensor([[1, 0]]), zero_row, rows, generator=generator)


@pytest.mark.parametrize("method", ["token", "block"])
def test_stateless_rules_refuse_a_state(method):
    rows = _iid_rows([0.5, 0.5], 3)[None]
    with pytest.raises(ValueError, match="stateless"):
        VERIFIERS[method](torch.tensor([[0, 1]]), rows[:, :2], rows, generator=torch.Generator(), state=object())


# --- registry ----------------------------------------------------------------------------


def test_registry_serves_the_single_draft_rules():
    for name, verify in VERIFIERS.items():
        spec = get_verifier(name)
        assert isinstance(spec, VerifierSpec)
        assert spec.name == name and spec.verify is verify and spec.multi_draft is False
        assert spec.stateful is (name == "greedy_block")
    assert {"token", "block", "greedy_block"} <= {spec.name for spec in available_verifiers()}
    assert verifier_names()[:5] == ["token", "block", "greedy_block", "spectr", "spectr_gbv"]


def test_registry_unknown_name_lists_the_valid_ones():
    with pytest.raises(UnknownVerifierError, match="valid methods: token, block, greedy_block, spectr, spectr_gbv"):
        get_verifier("typical")
