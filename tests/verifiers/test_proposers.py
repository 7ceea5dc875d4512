"""Model-free proposers (verifiers/proposers.py): predicted outputs and prompt lookup.

Their drafts are one-hot rows verified by the request's rule, so the output law must be the
target's whatever the proposal: exact enumeration (float64, TV < 1e-9) on tiny
context-dependent models for token and block verification, with the draft model or plain steps
as the fallback, with a prediction that diverges from the output and realigns; a control with
wrong draft rows is caught. The alignment itself is checked on fixed token sequences.
"""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import model_pair, target_law
from verifiers.reference import executor as executor_module
from verifiers.reference.exact import exact_law, total_variation
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.penalties import Penalties
from verifiers.proposers import PredictionProposer, PromptLookupProposer, one_hot_rows
from verifiers.reference import speculative_generate

PROMPT = (1, 0, 2, 1)
EXACT_TOLERANCE = 1e-9


def _law(draft_fn, target_fn, length, *, method, gamma, make_proposers, **sampling):
    return exact_law(lambda source: tuple(speculative_generate(
        draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method, generator=source,
        proposers=make_proposers(), **sampling,
    )[0]))


# ------------------------------------------------------------------ alignment


def test_prediction_proposes_the_predicted_tokens_after_the_output():
    proposer = PredictionProposer([5, 6, 7, 8, 9])
    assert proposer.propose([], 3) == [5, 6, 7]
    assert proposer.propose([5, 6], 4) == [7, 8, 9]
    assert proposer.propose([5, 6, 7, 8, 9], 4) == []  # used up


def test_prediction_realigns_on_the_last_ngram_after_a_divergence():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    proposer = PredictionProposer(prediction, ngram_max=3, ngram_min=2)
    assert proposer.propose([10, 11], 2) == [12, 13]
    # The output changed 12 into 40 and then went on as predicted from 13, 14.
    assert proposer.propose([10, 11, 40], 3) == []  # nothing to align on yet
    assert proposer.propose([10, 11, 40, 13, 14], 3) == [15, 16, 17]
    # A repeated n-gram: the match closest to where the output would be wins.
    repeated = PredictionProposer([1, 2, 3, 9, 1, 2, 3, 8, 7], ngram_max=2, ngram_min=2)
    assert repeated.propose([1, 2, 3, 9, 5, 2, 3], 2) == [8, 7]


def test_prompt_lookup_copies_what_followed_the_latest_occurrence():
    proposer = PromptLookupProposer([1, 2, 3, 4, 9, 2, 3, 5, 6], ngram_max=3, ngram_min=1)
    assert proposer.propose([2, 3], 3) == [5, 6, 2]  # latest "2 3": at index 5, then 5 6 + output
    assert proposer.propose([7], 2) == []  # 7 never occurred before
    assert PromptLookupProposer([4, 4, 4], ngram_min=2).propose([], 2) == [4]


def test_one_hot_rows_put_all_mass_on_the_proposed_tokens():
    rows = one_hot_rows(torch.tensor([[2, 0]]), 3)
    assert rows.tolist() == [[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]] and rows.dtype == torch.float64


def test_greedy_block_is_refused_with_model_free_proposals():
    with pytest.raises(ValueError, match="token or block"):
        SpeculativeMachine(None, "t", method="greedy_block", gamma=2, num_drafts=1, max_new_tokens=4,
                           proposers=[PromptLookupProposer([1])])


# ------------------------------------------------------------------ exact enumeration

PREDICTION = (2, 1, 2, 0, 1, 2)  # a prediction the tiny target follows only in part


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft-fallback", "plain-fallback"])
def test_prediction_proposer_is_exact(method, with_draft):
    draft_fn, target_fn = model_pair(3, 7)
    law = _law(draft_fn if with_draft else None, target_fn, 4, method=method, gamma=3,
               make_proposers=lambda: [PredictionProposer(PREDICTION, ngram_max=2, ngram_min=1)])
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", ["token", "block"])
def test_prompt_lookup_proposer_is_exact(method):
    draft_fn, target_fn = model_pair(3, 11)
    law = _law(None, target_fn, 4, method=method, gamma=2,
               make_proposers=lambda: [PromptLookupProposer(PROMPT, ngram_max=2, ngram_min=1)])
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) < EXACT_TOLERANCE


def test_prediction_then_prompt_lookup_then_draft_under_transforms_is_exact():
    draft_fn, target_fn = model_pair(3, 19)
    transforms = Penalties(presence=0.4, min_p=0.1, min_tokens=2, eos_ids=(0,))
    law = _law(draft_fn, target_fn, 4, method="block", gamma=2, temperature=0.9, penalties=transforms,
               make_proposers=lambda: [PredictionProposer(PREDICTION), PromptLookupProposer(PROMPT, ngram_min=1)])
    expected = exact_law(lambda source: tuple(speculative_generate(
        None, target_fn, PROMPT, 4, gamma=1, method="token", generator=source, temperature=0.9, penalties=transforms,
    )[0]))  # plain steps only: the target's transformed law
    assert total_variation(law, expected) < EXACT_TOLERANCE


def _greedy_output(target_fn, length):
    context = list(PROMPT)
    for _ in range(length):
        context.append(int(torch.argmax(torch.as_tensor(target_fn(tuple(context))))))
    return context[len(PROMPT):]


@pytest.mark.slow  # the fast tier keeps test_prediction_proposer_is_exact
@pytest.mark.parametrize("method", ["token", "block"])
def test_a_prediction_that_diverges_and_realigns_is_exact_and_realigns(method):
    """The target's own greedy output with one token changed: at temperature 0 the rejection at
    the change is followed by accepted predicted tokens (realigned), and at temperature 1 the law
    is the target's."""
    _, target_fn = model_pair(4, 31)
    greedy = _greedy_output(target_fn, 8)
    prediction = list(greedy)
    prediction[3] = (prediction[3] + 1) % 4  # diverges at output position 3
    tokens, stats = speculative_generate(None, target_fn, PROMPT, 8, gamma=3, method=method, temperature=0.0,
                                         generator=torch.Generator().manual_seed(0),
                                         proposers=[PredictionProposer(prediction, ngram_max=2, ngram_min=1)])
    assert tokens == greedy
    # 3 accepted before the change; realigned after it, so more predicted tokens are accepted.
    assert stats["accepted_proposed"][0] > 3 and stats["proposed"][0] > stats["accepted_proposed"][0]
    law = _law(None, target_fn, 5, method=method, gamma=3,
               make_proposers=lambda: [PredictionProposer(prediction, ngram_max=2, ngram_min=1)])
    assert total_variation(law, target_law(target_fn, PROMPT, 5)) < EXACT_TOLERANCE


def test_wrong_draft_rows_for_a_proposal_are_caught(monkeypatch):
    """Control: verifying a proposal as if it had been drawn from the uniform law (instead of
    one-hot rows) changes the output law."""
    def uniform(tokens, vocab, dtype=torch.float64):
        return torch.full((*tokens.shape, vocab), 1.0 / vocab, dtype=dtype)

    monkeypatch.setattr(executor_module, "one_hot_rows", uniform)
    _, target_fn = model_pair(3, 7)
    law = _law(None, target_fn, 4, method="token", gamma=3,
               make_proposers=lambda: [PredictionProposer(PREDICTION, ngram_max=2, ngram_min=1)])
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) > 1e-3
