"""A step's rows and verifications made together (actors.worker.step.Step._take over
actors.worker.rows.rows_together, verifiers.randomness.categorical_together and verify_together).

The served call takes the logits of every task of a forward, makes all their rows in one transform
per settings group, draws the sampling tasks' tokens in one call and verifies the waiting blocks
in one call per rule and block length. These tests run that very call on requests with different
rules, penalties, masks and seeds over tiny context-dependent models, and prove it is the
per-request calls it replaces: by exact enumeration in float64 (the joint law of the batch is the
product of each request's law alone, TV < 1e-9), and token for token with seeded streams (a
request among 15 others gets the tokens it gets alone). A negative control shows the enumeration
sees a batched call that loses one request's penalties.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from actors.messages import RowSampling
from actors.worker import rows as rows_module
from actors.worker.rows import STEP_TENSOR_BYTES, RowRequest, byte_chunks, rows_together, session_rows
from actors.worker.sessions import Session
from actors.worker.step import Step
from actors.worker.tasks import SampleTask
from actors.worker.verify_tasks import ScoreVerifyTask
from verifiers.machines.needs import Sample, Sampled, ScoreVerify
from verifiers.penalties import NO_PENALTIES, Penalties
from verifiers.randomness import TorchRandomSource
from verifiers.reference.exact import exact_law, total_variation

EXACT_TOLERANCE = 1e-9
VOCAB = 3


def model(seed: int, vocab: int = VOCAB):
    """A tiny context-dependent model: context -> float32 logits ``[V]``."""
    def logits(context: list[int]) -> torch.Tensor:
        mix = sum((j + 1) * (t + 1) for j, t in enumerate(context[-3:]))
        return torch.tensor([2.0 * math.sin(seed * 7 + 3 * i + 1.7 * mix) for i in range(vocab)], dtype=torch.float32)
    return logits


TARGET, DRAFT = model(1), model(2)


def request(rule: str, *, prompt=(1, 2), generated=(), gamma=2, drafts=1, temperature=1.0, top_k=0, top_p=1.0,
            penalties=NO_PENALTIES, vocab=VOCAB) -> dict:
    """One request's settings (a verification block of ``drafts`` chains of ``gamma`` tokens)."""
    return dict(rule=rule, prompt=list(prompt), generated=list(generated), gamma=gamma, drafts=drafts,
                sampling=RowSampling(temperature, top_k, top_p, penalties=penalties), vocab=vocab)


def session_of(spec: dict, source, name: str = "r") -> Session:
    context = spec["prompt"] + spec["generated"]
    return Session(session_id=name, slot=0, context=context, sampling=spec["sampling"],
                   sources={"verify": source, "draft": source}, prompt_length=len(spec["prompt"]), base=len(context))


def verify_task(spec: dict, source) -> tuple[ScoreVerifyTask, torch.Tensor]:
    """A :class:`ScoreVerifyTask` on its proposal (chain ``k`` takes the ``k``-th likeliest token of
    each draft row: positive draft probability) and the target logits of its row ``[1 + K*gamma, V]``."""
    session = session_of(spec, source)
    context, gamma = list(session.context), spec["gamma"]
    target_model, draft_model = model(1, spec["vocab"]), model(2, spec["vocab"])
    chains, draft_logits = [], []
    for k in range(spec["drafts"]):
        chain, chain_logits = [], []
        for _ in range(gamma):
            logits = draft_model(context + chain)
            row = session_rows(session, logits[None], [chain])[0]
            ranked = [int(t) for t in torch.argsort(row, descending=True, stable=True) if row[t] > 0]
            chain.append(ranked[min(k, len(ranked) - 1)])
            chain_logits.append(logits)
        chains.append(chain)
        draft_logits.append(torch.stack(chain_logits))
    target_rows = [target_model(context)] + [target_model(context + chain[: j + 1]) for chain in chains for j in range(gamma)]
    task = ScoreVerifyTask(session, [], ScoreVerify(model="target", append=(), draft_need=0, method=spec["rule"]),
                           Sampled(torch.tensor(chains), torch.stack(draft_logits)))
    return task, torch.stack(target_rows)


def sample_task(spec: dict, source) -> tuple[SampleTask, torch.Tensor]:
    """A :class:`SampleTask` drawing ``drafts`` chains' first token, and its logits ``[1, V]``."""
    session = session_of(spec, source)
    task = SampleTask(session, [session.context[-1]], Sample(model="draft", append=(), count=spec["gamma"],
                                                           num_drafts=spec["drafts"], stream="draft"))
    return task, DRAFT(session.context)[None]


def step_of(tasks: list) -> Step:
    """A :class:`Step` holding ``tasks`` (what ``Step._take`` reads of its engine)."""
    step = Step.__new__(Step)
    step.engine = SimpleNamespace(name="test", sessions=SimpleNamespace(release=lambda session_id: None))
    step.items = [SimpleNamespace(session_id=f"r{i}") for i in range(len(tasks))]
    step.tasks, step.errors, step.lost = list(tasks), {}, set()
    return step


def outcome(task) -> tuple:
    if isinstance(task, SampleTask):
        return tuple(tuple(draft) for draft in task.drafts)
    return tuple(task.result.emitted)


def run_together(built: list[tuple]) -> tuple:
    """The served call over every task: ONE ``Step._take``."""
    step = step_of([task for task, _ in built])
    step._take({i: logits for i, (_, logits) in enumerate(built)}, {i: logits for i, (_, logits) in enumerate(built)})
    assert not step.errors, step.errors
    return tuple(outcome(task) for task in step.tasks)


def build(spec: dict, source):
    return (sample_task if spec["rule"] == "sample" else verify_task)(spec, source)


def law_together(specs: list[dict]) -> dict:
    return exact_law(lambda source: run_together([build(spec, source) for spec in specs]))


def law_alone(spec: dict) -> dict:
    return exact_law(lambda source: run_together([build(spec, source)])[0])


def product(laws: list[dict]) -> dict:
    joint = {}
    for parts in itertools.product(*(law.items() for law in laws)):
        joint[tuple(key for key, _ in parts)] = math.prod(p for _, p in parts)
    return joint


REPEAT = Penalties(repetition=1.6)
BIASED = Penalties(presence=0.7, frequency=0.3, logit_bias=((2, -1.5),))
EARLY_EOS = Penalties(min_tokens=3, eos_ids=(0,))
BATCHES = {
    # two requests share the settings (one transform, one block verification), a third is penalized
    "block-shared-and-penalized": [request("block"), request("block", prompt=(2, 0, 1)),
                                   request("block", penalties=REPEAT, generated=(1,))],
    "token-masks": [request("token", top_k=2), request("token", top_k=2, prompt=(0,)),
                    request("token", top_p=0.7, temperature=0.8, penalties=EARLY_EOS)],
    "mixed-rules": [request("greedy_block", penalties=BIASED, generated=(2, 2)),
                    request("spectr", drafts=2, gamma=1, penalties=Penalties(min_p=0.2)),
                    request("block", temperature=0.7)],
    "draws-and-blocks": [request("sample", drafts=2), request("sample", prompt=(0, 1)),
                         request("block", prompt=(0, 1)), request("token", penalties=REPEAT)],
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_the_law_of_the_batched_call_is_the_product_of_each_requests_law_alone(batch):
    specs = BATCHES[batch]
    together = law_together(specs)
    assert total_variation(together, product([law_alone(spec) for spec in specs])) < EXACT_TOLERANCE


def test_negative_control_a_batched_call_that_drops_penalties_is_seen(monkeypatch):
    """Grouping a penalized request with unpenalized ones (its penalties lost) moves its law."""
    specs = BATCHES["block-shared-and-penalized"]
    expected = product([law_alone(spec) for spec in specs])
    real_key = rows_module._group_key

    def careless(request):  # the settings key, penalties ignored: the penalized rows made without them
        sampling = request.session.sampling
        return real_key(RowRequest(SimpleNamespace(sampling=RowSampling(sampling.temperature, sampling.top_k,
                                                                        sampling.top_p)), request.logits, request.after,
                                   request.dtype))

    monkeypatch.setattr(rows_module, "_group_key", careless)
    assert total_variation(law_together(specs), expected) > 1e-3


def seeded(spec: dict, seed: int):
    return build(spec, TorchRandomSource(torch.Generator().manual_seed(seed)))


def sixteen() -> list[dict]:
    """16 requests: different rules, penalties, masks, prompts and a vocabulary of 64."""
    kinds = [dict(rule="block"), dict(rule="token", top_k=5), dict(rule="sample", drafts=2),
             dict(rule="block", penalties=REPEAT, generated=(3, 9)), dict(rule="greedy_block", top_p=0.8),
             dict(rule="spectr", drafts=2, penalties=Penalties(min_p=0.05)), dict(rule="block", temperature=0.6),
             dict(rule="token", penalties=BIASED, generated=(4,))]
    return [request(vocab=64, gamma=3 if i % 3 else 2, prompt=(i % 7, 11, i % 5), **kinds[i % len(kinds)])
            for i in range(16)]


def test_seeded_outputs_are_the_same_alone_and_among_15_others():
    specs = sixteen()
    together = run_together([seeded(spec, 100 + i) for i, spec in enumerate(specs)])
    alone = [run_together([seeded(spec, 100 + i)])[0] for i, spec in enumerate(specs)]
    assert list(together) == alone
    # negative control: other seeds give other tokens somewhere (the comparison can fail)
    assert list(run_together([seeded(spec, 200 + i) for i, spec in enumerate(specs)])) != alone


def test_rows_together_are_each_requests_own_rows_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    specs = sixteen()
    requests = [RowRequest(session_of(spec, None), torch.randn(1 + i % 4, 64, generator=generator), [[i % 3]] * (1 + i % 4))
                for i, spec in enumerate(specs)]
    for together, request in zip(rows_together(requests), requests):
        assert torch.equal(together, request.alone())


def test_byte_chunks_cut_runs_below_the_budget():
    assert byte_chunks("abcde", [6, 6, 6, 20, 1], budget=12) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert byte_chunks([], [], budget=STEP_TENSOR_BYTES) == []
