"""logits_to_probs / sample_token: exact values of temperature, top-k, top-p and greedy rows."""

from __future__ import annotations

import math

import pytest
import torch

from verifiers.reference.exact import exact_law
from verifiers.sampling import _nucleus, logits_to_probs, sample_token

INF = float("inf")


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([1.0, 2.0, 4.0])
    probs = logits_to_probs(logits, temperature=2.0)
    assert probs.dtype == torch.float64
    assert probs.tolist() == pytest.approx(_softmax([0.5, 1.0, 2.0]), abs=1e-15)


def test_temperature_zero_is_one_hot_at_argmax_with_ties_to_lowest_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [5.0, -INF, 5.0, 5.0]])
    probs = logits_to_probs(logits, temperature=0.0, top_k=2, top_p=0.3)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_the_k_largest_and_renormalises():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2)
    assert probs.tolist() == pytest.approx([0.0, 0.0] + _softmax([2.0, 3.0]), abs=1e-15)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    probs = logits_to_probs(logits, temperature=1.0, top_k=2)
    assert probs.tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0], abs=1e-15)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs_in = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    logits = probs_in.log()
    # sorted: 0.5, 0.25, 0.15, 0.1 -> mass above each: 0, 0.5, 0.75, 0.9
    assert logits_to_probs(logits, temperature=1.0, top_p=0.5).tolist() == pytest.approx([0, 1, 0, 0], abs=1e-12)
    assert logits_to_probs(logits, temperature=1.0, top_p=0.6).tolist() == pytest.approx(
        [0, 0.5 / 0.75, 0, 0.25 / 0.75], abs=1e-12
    )
    assert logits_to_probs(logits, temperature=1.0, top_p=0.8).tolist() == pytest.approx(
        [0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9], abs=1e-12
    )


def test_top_p_applies_after_top_k_on_the_renormalised_row():
    probs_in = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    # top-k=3 -> [4/9, 3/9, 2/9, 0]; top-p=0.5: mass above 3/9 is 4/9 < 0.5 -> keep 2 tokens.
    probs = logits_to_probs(probs_in.log(), temperature=1.0, top_k=3, top_p=0.5)
    assert probs.tolist() == pytest.approx([4 / 7, 3 / 7, 0, 0], abs=1e-12)


def test_top_p_sorted_path_for_large_vocab_matches_pairwise_definition():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 200, generator=generator, dtype=torch.float64)
    logits[0, 10:20] = 0.5  # a tie group
    probs = logits_to_probs(logits, temperature=1.0, top_p=0.7)
    full = torch.softmax(logits, dim=-1)
    mass_above = ((full.unsqueeze(-2) > full.unsqueeze(-1)) * full.unsqueeze(-2)).sum(-1)
    kept = mass_above < 0.7
    expected = torch.where(kept, full, 0.0)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(probs, expected, atol=1e-14, rtol=0)


def test_negative_infinity_logits_get_zero_probability():
    logits = torch.tensor([-INF, 0.0, -INF, math.log(3.0)], dtype=torch.float64)
    probs = logits_to_probs(logits, temperature=1.0)
    assert probs.tolist() == pytest.approx([0.0, 0.25, 0.0, 0.75], abs=1e-15)
    assert logits_to_probs(logits, temperature=1.0, top_k=3).tolist() == pytest.approx([0.0, 0.25, 0.0, 0.75])


def test_input_is_not_modified():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    before = logits.clone()
    logits_to_probs(logits, temperature=0.5, top_k=2, top_p=0.9)
    logits_to_probs(logits, temperature=0.0)
    assert torch.equal(logits, before)


def out_of_place_rows(logits: torch.Tensor, temperature: float, top_k: int, min_p: float, top_p: float) -> torch.Tensor:
    """The transform as out-of-place float64 operations, each step a new tensor."""
    scaled = logits.to(torch.float64)
    scaled = scaled if temperature == 1 else scaled / temperature
    if 0 < top_k < scaled.shape[-1]:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k, dim=-1).values[..., -1:], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if min_p:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return _nucleus(probs, top_p) if top_p < 1 else probs


@pytest.mark.parametrize("vocab", [3, 4096, 151_936])
@pytest.mark.parametrize(("temperature", "top_k", "min_p", "top_p"), [(1.0, 0, 0.0, 1.0), (0.7, 0, 0.0, 1.0),
                                                                      (1.3, 5, 0.1, 0.9), (1.0, 2, 0.0, 1.0)])
def test_rows_made_in_place_are_the_out_of_place_rows_bit_for_bit(vocab, temperature, top_k, min_p, top_p):
    """Float32 logits (converted: a copy of the call's own) and ``overwrite`` scratch are worked on in
    place; the rows are those of the out-of-place operations, bit for bit."""
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)) * 3  # [4, V] float32
    settings = dict(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    expected = out_of_place_rows(logits, **settings)  # [4, V] float64
    scratch = logits.double()
    assert torch.equal(logits_to_probs(logits, **settings), expected)
    assert torch.equal(logits_to_probs(logits.double(), **settings), expected)
    assert torch.equal(logits_to_probs(scratch, overwrite=True, **settings), expected)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_k": -2}, "top_k"),
        ({"temperature": 1.0, "top_k": 1.5}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        logits_to_probs(torch.zeros(3), **kwargs)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.tensor([0.0, float("nan")]), "NaN"),
        (torch.tensor([0.0, INF]), r"\+inf"),
        (torch.tensor([-INF, -INF]), "-inf everywhere"),
    ],
)
def test_bad_logits_are_rejected(logits, message):
    with pytest.raises(ValueError, match=message):
        logits_to_probs(logits, temperature=1.0)


def test_sample_token_draws_through_the_source_with_the_row_law():
    probs = torch.tensor([[0.2, 0.0, 0.8], [0.0, 1.0, 0.0]], dtype=torch.float64)
    law = exact_law(lambda source: tuple(sample_token(probs, source).tolist()))
    assert law == pytest.approx({(0, 1): 0.2, (2, 1): 0.8}, abs=1e-15)
    drawn = sample_token(probs, torch.Generator().manual_seed(3))
    assert drawn.shape == (2,) and drawn.dtype == torch.int64 and int(drawn[1]) == 1
