"""Log-probabilities are those of the law each token was sampled from: the target's (after
temperature, top-k / top-p and penalties) for ar / sd / multi_draft, the ensemble's for
ensemble / se -- never the draft's, whatever was accepted or corrected. Checked against the
(fake, exact) models themselves, through the batched coordinator."""

from __future__ import annotations

import math

import pytest
import torch

from actors.request_schema import GenerationRequest
from tests.actors.coordination.test_coordinator_reference import M, PROMPT, _tokens, fake_group, run_requests  # noqa: F401
from verifiers.ensemble import make_ensemble
from verifiers.penalties import Penalties, penalized_probs

TOP = 3
CASES = [
    ({"strategy": "ar"}, {}),
    ({"strategy": "sd", "method": "block", "gamma": 3}, {}),
    ({"strategy": "sd", "method": "greedy_block", "gamma": 2}, {"temperature": 0.8, "top_k": 4}),
    ({"strategy": "multi_draft", "method": "spectr", "gamma": 2, "num_drafts": 3}, {}),
    ({"strategy": "sd", "method": "token", "gamma": 3}, {"presence_penalty": 0.6, "repetition_penalty": 1.5}),
    ({"strategy": "ensemble", "members": ["target", "partner"]}, {}),
    ({"strategy": "se", "method": "block", "members": ["target", "partner"], "gammas": [2, 3]}, {"frequency_penalty": 0.5}),
]


def _law_row(speculation: dict, sampling: dict, context: tuple[int, ...]) -> torch.Tensor:
    """The row the token after ``context`` is sampled from, straight from the models."""
    penalties = Penalties(presence=sampling.get("presence_penalty", 0.0), frequency=sampling.get("frequency_penalty", 0.0),
                          repetition=sampling.get("repetition_penalty", 1.0))
    if speculation["strategy"] in ("ensemble", "se"):
        members = speculation["members"]
        member_logits = torch.stack([torch.as_tensor(M[m](context)).double() for m in members])  # [n, V]
        logits = make_ensemble("weighted", len(members)).logits(member_logits)  # [V]
    else:
        logits = torch.as_tensor(M["target"](context)).double()
    return penalized_probs(logits[None], temperature=sampling.get("temperature", 1.0), top_k=sampling.get("top_k", 0),
                           penalties=penalties, prompt=PROMPT, generated=[context[len(PROMPT):]])[0]


@pytest.mark.parametrize(("speculation", "sampling"), CASES, ids=[c[0]["strategy"] + str(i) for i, c in enumerate(CASES)])
def test_logprobs_are_the_sampled_law(fake_group, speculation, sampling):  # noqa: F811 (the imported fixture)
    def request(seed: int, logprobs: int | None) -> GenerationRequest:
        return GenerationRequest(request_id=f"lp-{seed}", prompt_ids=list(PROMPT), speculation=speculation,
                                 sampling={"max_tokens": 12, "seed": seed, "logprobs": logprobs, **sampling})

    with_logprobs = run_requests(fake_group, [request(seed, TOP) for seed in (1, 2)])
    without = run_requests(fake_group, [request(seed, None) for seed in (1, 2)])
    for chunks, plain in zip(with_logprobs, without):
        tokens = _tokens(chunks)
        assert tokens == _tokens(plain)  # asking for logprobs changes no draw
        entries = [entry for chunk in chunks for entry in (chunk.logprobs or [])]
        assert [e.token_id for e in entries] == tokens
        for position, entry in enumerate(entries):
            row = _law_row(speculation, sampling, PROMPT + tuple(tokens[:position]))
            assert entry.logprob == pytest.approx(math.log(row[entry.token_id]), abs=1e-9)
            expected_top = torch.topk(torch.log(row), TOP)
            assert [t for t, _ in entry.top] == expected_top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(expected_top.values.tolist(), abs=1e-9)
