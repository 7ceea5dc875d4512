"""Prompt log-probabilities: the engine's prompt logits against a transformers forward of the
embedded target, and the law (target / ensemble) built from them (actors.coordination.prompt_scoring)."""

from __future__ import annotations

import pytest
import torch

from actors.messages import OpenSession, RowSampling, WorkItem
from actors.worker.model_worker import ModelWorker
from actors.coordination.plan import DecodingPlan
from actors.coordination.prompt_scoring import law_models, prompt_log_rows, prompt_logprobs
from cluster.config import ModelSpec
from models import EMBEDDED_ROOT
from verifiers.machines.needs import Sample

TOLERANCE = 1e-4  # float32: the engine's batched forward vs one transformers forward


@pytest.fixture(scope="module")
def target():
    threads = torch.get_num_threads()
    spec = ModelSpec(name="target", path=str(EMBEDDED_ROOT / "target"), role="target",
                     num_gpus=0, num_cpus=0.25, torch_threads=1, resources={})
    yield ModelWorker(spec, idle_timeout_s=600, max_sessions=8)
    torch.set_num_threads(threads)


def _reference(worker: ModelWorker, prompt: list[int]) -> torch.Tensor:
    """log_softmax of one transformers forward over the whole prompt: ``[P - 1, V]``."""
    with torch.inference_mode():
        logits = worker.backend.model(torch.tensor([prompt])).logits[0, :-1].float()  # [P-1, V]
    return torch.log_softmax(logits, dim=-1)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, 4000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logits_equal_a_full_forward_even_when_a_prefix_is_cached(target):
    prompt = _prompt(40, seed=1)
    cache = target.engine.prefix_cache
    # A finished request with the same first 30 tokens leaves them parked in the cache.
    outcomes, _ = target.run_step([WorkItem("donor", Sample("target", (), 1), open=OpenSession(tuple(prompt[:30] + [7] * 5),
                                                                                       RowSampling(), {"sample": 1}))])
    assert outcomes[0].error is None
    target.release("donor")
    reused = cache.reused_tokens_total
    logits = target.prompt_logits("score", prompt)  # [P-1, V]
    assert cache.reused_tokens_total == reused  # every position computed fresh
    assert logits.shape == (len(prompt) - 1, target.backend.vocab_size)
    diff = (torch.log_softmax(logits, dim=-1) - _reference(target, prompt)).abs().max().item()
    assert diff < TOLERANCE
    assert target.num_sessions() == 0  # the scoring session is released


def test_a_decode_session_after_scoring_reuses_the_scored_prompt(target):
    prompt = _prompt(30, seed=2)
    target.prompt_logits("score2", prompt)
    cache = target.engine.prefix_cache
    reused = cache.reused_tokens_total
    open_spec = OpenSession(tuple(prompt), RowSampling(), {"sample": 3})
    outcomes, _ = target.run_step([WorkItem("decode", Sample("target", (), 1), open=open_spec)])
    assert outcomes[0].error is None and outcomes[0].prompt_logits is None
    assert cache.reused_tokens_total - reused == len(prompt) - 1
    target.release("decode")


def test_prompt_logits_in_a_batched_step_leave_the_neighbour_rows_alone(target):
    """A scoring row and a plain prefill share one step: each row's logits are its own."""
    scored, plain = _prompt(12, seed=3), _prompt(9, seed=4)
    items = [
        WorkItem("s1", Sample("target", (), 1), open=OpenSession(tuple(scored), RowSampling(), {"sample": 1},
                                                                 prompt_logits=True)),
        WorkItem("s2", Sample("target", (), 1, return_logits=True),
                 open=OpenSession(tuple(plain), RowSampling(), {"sample": 2})),
    ]
    outcomes, payloads = target.run_step(items)
    try:
        assert [o.error for o in outcomes] == [None, None]
        diff = (torch.log_softmax(outcomes[0].prompt_logits, -1) - _reference(target, scored)).abs().max().item()
        assert diff < TOLERANCE
        assert outcomes[1].prompt_logits is None
        with torch.inference_mode():
            last = target.backend.model(torch.tensor([plain])).logits[0, -1].float()  # [V]
        torch.testing.assert_close(payloads[1].logits[0, 0], last, atol=TOLERANCE, rtol=0)
    finally:
        target.release("s1")
        target.release("s2")


def test_a_one_token_prompt_has_nothing_to_score(target):
    assert target.prompt_logits("one", [5]).shape == (0, target.backend.vocab_size)


def _plan(strategy: str, **overrides) -> DecodingPlan:
    fields = dict(strategy=strategy, method=None, target="t", draft=None, gamma=1, num_drafts=1, ensemble=None,
                  members=(), weights=None, mu=0.0, gammas=())
    fields.update(overrides)
    return DecodingPlan(**fields)


def test_the_law_is_the_target_or_the_ensemble():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 6, generator=generator), torch.randn(3, 6, generator=generator)  # [P-1, V]
    target = prompt_log_rows(_plan("sd", draft="d"), {"t": a, "d": b})
    torch.testing.assert_close(target, torch.log_softmax(a.double(), -1))
    weighted = prompt_log_rows(_plan("ensemble", target=None, ensemble="weighted", members=("a", "b"),
                                     weights=(0.25, 0.75)), {"a": a, "b": b})
    mixture = 0.25 * torch.softmax(a.double(), -1) + 0.75 * torch.softmax(b.double(), -1)
    torch.testing.assert_close(weighted, torch.log(mixture))
    contrastive = prompt_log_rows(_plan("se", target=None, ensemble="contrastive", members=("a", "b"), mu=0.5),
                                  {"a": a, "b": b})
    torch.testing.assert_close(contrastive, torch.log_softmax(a.double() - 0.5 * b.double(), -1))
    assert law_models(_plan("multi_draft", draft="d")) == ("t",)
    assert law_models(_plan("se", target=None, members=("a", "b"))) == ("a", "b")


def test_entries_carry_logprob_rank_and_the_most_likely():
    rows = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]], dtype=torch.float64))  # [P-1, V]
    entries = prompt_logprobs(rows, [9, 1, 0], top=2)
    assert [(e.token_id, e.rank) for e in entries] == [(1, 2), (0, 3)]
    assert entries[0].logprob == pytest.approx(torch.log(torch.tensor(0.3)).item())
    assert [token for token, _ in entries[1].top] == [2, 1]
    assert prompt_logprobs(rows, [9, 1, 0], top=0)[0].top == []
