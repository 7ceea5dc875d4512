"""A draft's rows carried to a verifier in the same process (``Sampled.rows``): the verifying task
reads the rows the draft tokens were drawn from instead of making them again from the logits
(actors.worker.verify_tasks.ScoreVerifyTask.carried_rows). They are the rows the recompute gives,
bit for bit, so every rule's seeded tokens are the same either way; a payload that leaves the
process (pickled) carries its logits only, and rows of another precision are not read."""

from __future__ import annotations

import pickle

import pytest
import torch

import actors.messages  # noqa: F401 - registers the payloads' pickling

from actors.coordination.coordinator import Coordinator
from actors.request_schema import GenerationRequest
from actors.worker.rows import session_rows
from actors.worker import verify_tasks
from actors.worker.verify_tasks import ScoreVerifyTask
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FunctionModelWorker, fake_group_config, run_in_process
from tests.actors.worker.test_rows_together import request, verify_task
from verifiers.machines.needs import Sampled
from verifiers.penalties import Penalties

SPECULATIONS = {
    "token": {"strategy": "sd", "method": "token", "gamma": 3},
    "block": {"strategy": "sd", "method": "block", "gamma": 3},
    "greedy_block": {"strategy": "sd", "method": "greedy_block", "gamma": 3},
    "spectr": {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 2},
    "spectr_gbv": {"strategy": "multi_draft", "method": "spectr_gbv", "gamma": 2, "num_drafts": 2},
    "se": {"strategy": "se", "method": "block", "ensemble": "weighted", "members": ["target", "partner"],
           "gammas": [2, 2]},
}


def served_tokens(monkeypatch, speculation: dict, carried: bool, penalties: dict) -> tuple[list[list[int]], list[int]]:
    """Three seeded requests through the in-process Coordinator and WorkerEngines over the fake
    models -> (each request's tokens, [blocks that read carried draft rows, verifier calls that put
    carried rows of several blocks together]); ``carried=False``
    makes every verifier recompute the draft's rows from its logits."""
    config = fake_group_config(overlap=False)
    coordinator = Coordinator({m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}, config,
                              export_to_ray=False)
    used = [0, 0]  # blocks that read carried rows, verifier calls that put them together
    original = ScoreVerifyTask.carried_rows

    def counted(task):
        rows = original(task) if carried else None
        used[0] += rows is not None
        return rows

    monkeypatch.setattr(ScoreVerifyTask, "carried_rows", counted)
    original_together = verify_tasks.draft_rows_together

    def together(tasks):
        used[1] += 1
        original_together(tasks)

    monkeypatch.setattr(verify_tasks, "draft_rows_together", together)
    requests = [GenerationRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3 + i], speculation=speculation,
                                  sampling={"max_tokens": 12, "seed": 5 + i, "temperature": 1.0, **penalties})
                for i in range(3)]
    results = run_in_process(coordinator, requests)
    for chunks in results:
        assert chunks[-1].finished and chunks[-1].error is None, chunks[-1]
    return [[t for chunk in chunks for t in chunk.token_ids] for chunks in results], used


@pytest.mark.parametrize("penalties", [{}, {"repetition_penalty": 1.4, "presence_penalty": 0.5}], ids=["plain", "penalized"])
@pytest.mark.parametrize("rule", sorted(SPECULATIONS))
def test_every_rule_has_the_same_seeded_tokens_with_carried_rows(monkeypatch, rule, penalties):
    """Carried rows (where a draft proposes) or recomputed ones: the same tokens, for every rule."""
    carried, used = served_tokens(monkeypatch, SPECULATIONS[rule], True, penalties)
    recomputed, unused = served_tokens(monkeypatch, SPECULATIONS[rule], False, penalties)
    assert carried == recomputed
    assert unused == [0, 0]
    if rule != "se":  # an ensemble's members propose to the coordinator's machine, not to a worker's verifier
        assert used[0] > 0
    if rule in ("token", "block"):  # the rules verified for many requests in one call
        assert used[1] > 0


def test_carried_rows_are_the_recomputed_rows_bit_for_bit():
    """A proposal's rows as the draft drew from them equal :func:`session_rows` of its logits,
    under penalties (each position's own context)."""
    spec = request("block", penalties=Penalties(repetition=1.6, presence=0.4), generated=(1, 2), gamma=3)
    task, _ = verify_task(spec, torch.Generator().manual_seed(0))
    drafts = task.proposal.tokens.tolist()
    made = session_rows(task.session, task.proposal.logits, [draft[:j] for draft in drafts for j in range(3)])  # [1, 3, V]
    task.proposal = Sampled(task.proposal.tokens, task.proposal.logits, rows=tuple(made.clone().unbind(1)))
    requests = task.row_requests(torch.zeros(4, 3))
    assert len(requests) == 1  # the target's rows only
    task.rows_taken([requests[0].alone()])  # a batched rule: the carried rows wait for verify_together
    assert task.inputs[1] is None
    assert torch.equal(task.stacked_draft_rows(), made)


def test_rows_of_another_precision_or_vocabulary_are_not_read():
    spec = request("block", gamma=2)
    task, _ = verify_task(spec, torch.Generator().manual_seed(0))
    tokens, logits = task.proposal.tokens, task.proposal.logits  # [1, 2], [1, 2, V]
    row = torch.full((1, 3), 1 / 3, dtype=torch.float64)  # [K, V]
    task.proposal = Sampled(tokens, logits, rows=(row, row))
    assert task.carried_rows() is not None
    task.proposal = Sampled(tokens, logits, rows=(row.float(), row.float()))
    assert task.carried_rows() is None
    task.proposal = Sampled(tokens, logits, rows=(row[:, :2], row[:, :2]))
    assert task.carried_rows() is None
    task.proposal = Sampled(tokens, logits, rows=(row,))
    assert task.carried_rows() is None
    task.proposal = Sampled(tokens, None, rows=(row, row))
    assert task.carried_rows() is None


def test_a_pickled_payload_carries_its_logits_only():
    """Between processes (the wire's pickling of a payload) the rows stay behind."""
    payload = Sampled(torch.tensor([[1, 2]]), torch.zeros(1, 2, 3), rows=(torch.ones(1, 3, dtype=torch.float64),) * 2)
    copy = pickle.loads(pickle.dumps(payload))
    assert copy.rows is None and torch.equal(copy.logits, payload.logits) and torch.equal(copy.tokens, payload.tokens)

