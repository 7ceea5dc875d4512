"""The speculative ensemble with a draft proposer (``se`` with ``speculation.proposer`` a model):
speculative decoding with the ensemble law as the target (Speculative Ensemble, arXiv:2502.01662, Sec. 3.2, "WE-SD" / "CD-SD").

Exact enumeration (float64, TV < 1e-9) of :func:`verifiers.reference.ensemble.ensemble_draft_generate`
(the production :class:`verifiers.machines.ensemble_draft.EnsembleDraftMachine` on the reference executor)
against the ensemble law: weighted and contrastive, 2 and 3 members, a separate draft or a member
proposing, token / block / greedy block and a multi-draft rule, temperature, top-k and a penalty,
gamma "auto" with a scripted choice sequence (plain ensemble steps included); a negative control
that must fail; a sampled chi-square through the same code.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from tests.verifiers.test_ensemble import _ensemble_law, _members
from tests.verifiers.tiny_models import TinyModel, chi_square_pvalue
from verifiers.adaptive import AdaptiveGammaSettings, StepCosts
from verifiers.reference.exact import exact_law, total_variation
from verifiers.machines.ensemble import EnsembleLaw
from verifiers.machines.ensemble_draft import EnsembleDraftMachine
from verifiers.penalties import Penalties
from verifiers.reference.ensemble import ensemble_draft_generate

EXACT_TV = 1e-9
PROMPT = (1,)


def _draft_for(members, seed: int) -> TinyModel:
    """A separate draft resembling member 0 (acceptance neither ~0 nor ~1)."""
    return TinyModel(members[0].vocab, seed + 977, base=members[0], noise=0.9)


def _law(model_fns, length: int, **kwargs) -> dict[Hashable, float]:
    def procedure(source) -> Hashable:
        tokens, _ = ensemble_draft_generate(model_fns, PROMPT, length, generator=source, **kwargs)
        assert len(tokens) == length
        return tuple(tokens)

    return exact_law(procedure, max_leaves=200_000)


def _ensemble_args(kwargs: dict) -> dict:
    keys = ("ensemble", "weights", "mu", "temperature", "top_k", "top_p", "penalties", "prompt")
    return {key: value for key, value in kwargs.items() if key in keys}


# id, member vocabs, model seed, proposer ("draft" or a member index), length, ensemble kwargs
CASES = [
    ("weighted-2-draft", (2, 2), 31, "draft", 3, {"ensemble": "weighted", "weights": (0.4, 0.6)}),
    ("weighted-3-draft", (2, 2, 2), 32, "draft", 3, {"ensemble": "weighted", "weights": (0.5, 0.2, 0.3)}),
    ("weighted-3-member-proposes", (2, 2, 2), 33, 2, 3, {"ensemble": "weighted"}),
    ("contrastive-2-draft", (2, 2), 34, "draft", 3, {"ensemble": "contrastive", "mu": 0.5}),
    ("contrastive-2-amateur-proposes", (2, 2), 35, 1, 3, {"ensemble": "contrastive", "mu": 0.3}),
]


def _proposer(members, seed: int, proposer):
    return _draft_for(members, seed) if proposer == "draft" else proposer


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=[pytest.mark.slow] if c[0] == "contrastive-2-amateur-proposes" else [])
                                  for c in CASES])
def test_draft_proposer_keeps_the_ensemble_law(case, method):
    _, vocabs, seed, proposer, length, ensemble_args = case
    members = _members(vocabs, seed=seed)
    expected = _ensemble_law(members, length, **ensemble_args)
    law = _law(members, length, proposer=_proposer(members, seed, proposer), gamma=2, method=method, **ensemble_args)
    assert total_variation(law, expected) < EXACT_TV


# A member proposer draws one more token per chain (its row after the block): 2 tokens keep the tree small.
@pytest.mark.parametrize("proposer,length", [("draft", 3), pytest.param(0, 2, marks=pytest.mark.slow)], ids=["draft", "member"])
@pytest.mark.parametrize("method", ["sequential_gbv", pytest.param("spectr", marks=pytest.mark.slow)])
def test_a_multi_draft_rule_keeps_the_ensemble_law(method, proposer, length):
    members = _members((2, 2), seed=36)
    args = {"ensemble": "weighted", "weights": (0.3, 0.7)}
    expected = _ensemble_law(members, length, **args)
    law = _law(members, length, proposer=_proposer(members, 36, proposer), gamma=2, method=method, num_drafts=2,
               **args)
    assert total_variation(law, expected) < EXACT_TV


PENALTIES = Penalties(presence=0.4, frequency=0.2, repetition=1.3)


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
@pytest.mark.parametrize("ensemble_args", [
    {"ensemble": "weighted", "weights": (0.5, 0.3, 0.2)},
    {"ensemble": "contrastive", "mu": 0.6},
], ids=["weighted-3", "contrastive-2"])
def test_temperature_top_k_and_a_penalty_keep_the_ensemble_law(method, ensemble_args):
    vocabs = (3, 3, 3) if ensemble_args["ensemble"] == "weighted" else (3, 3)
    members = _members(vocabs, seed=37, mask_prob=0.2)
    sampling = {"temperature": 0.7, "top_k": 2, "penalties": PENALTIES}
    expected = _ensemble_law(members, 3, prompt=PROMPT, **ensemble_args, **sampling)
    law = _law(members, 3, proposer=_draft_for(members, 37), gamma=2, method=method, **ensemble_args, **sampling)
    assert total_variation(law, expected) < EXACT_TV


def _costs(mode: str, block: int = 0) -> StepCosts:
    """Step costs that name the step's mode (and block): the scheduler's cohort decision."""
    return StepCosts(draft_s=0.001, verify_s=(0.01, 0.011, 0.012), overhead_s=0.002, plain_s=0.01,
                     plain_overhead_s=0.001, plain_tokens=1, mode=mode, block=block)


#: The scripted choices: a plain ensemble step, a block of 3, a block of 1, then the request's own
#: choice from its acceptance (mode "any" with plain steps on the table).
SCRIPT = (_costs("plain"), _costs("speculative", 3), _costs("speculative", 1),
          StepCosts(draft_s=0.001, verify_s=(0.002, 0.003, 0.004), overhead_s=0.0, plain_s=0.05,
                    plain_overhead_s=0.0, plain_tokens=1))


class _Script:
    """The choice at each step from the script, indexed by the step count and the tokens so far:
    it depends only on the past, differently on different branches."""

    def __init__(self, machine: EnsembleDraftMachine):
        self.machine = machine

    def __call__(self) -> StepCosts:
        return SCRIPT[(len(self.machine.draft_lengths) + sum(self.machine.committed)) % len(SCRIPT)]


@pytest.mark.parametrize("method", ["block", "greedy_block"])
@pytest.mark.parametrize("proposer", ["draft", 1])
def test_gamma_auto_with_a_scripted_choice_sequence_keeps_the_ensemble_law(method, proposer):
    members = _members((2, 2), seed=38)
    args = {"ensemble": "weighted", "weights": (0.6, 0.4)}
    histories: set[tuple[int, ...]] = set()

    def procedure(source) -> Hashable:
        tokens, stats = ensemble_draft_generate(
            members, PROMPT, 4, generator=source, proposer=_proposer(members, 38, proposer), gamma=1, method=method,
            adaptive=AdaptiveGammaSettings(gamma_max=3, draft_cost_ratio=0.3, prior_weight=1.0, decay=1.0),
            step_costs=_Script, **args)
        histories.add(tuple(stats["draft_lengths"]))
        return tuple(tokens)

    law = exact_law(procedure, max_leaves=200_000)
    used = {block for history in histories for block in history}
    assert {0, 1, 3} <= used, f"the script never chose a plain step and blocks 1 and 3: {histories}"
    assert total_variation(law, _ensemble_law(members, 4, **args)) < EXACT_TV


def test_negative_control_proposal_rows_without_the_temperature_fail(monkeypatch):
    """Verifying against proposal rows that are not the ones the draft sampled from (here: the
    temperature left out) must change the law: the enumeration can fail."""
    members = _members((2, 2), seed=39)
    args = {"ensemble": "weighted", "weights": (0.5, 0.5), "temperature": 0.5}
    original = EnsembleLaw.proposal_rows

    def without_temperature(self, logits, generated):
        sampling = dict(self.sampling)
        self.sampling = {**sampling, "temperature": 1.0}
        try:
            return original(self, logits, generated)
        finally:
            self.sampling = sampling

    monkeypatch.setattr(EnsembleLaw, "proposal_rows", without_temperature)
    law = _law(members, 3, proposer=_draft_for(members, 39), gamma=2, method="block", **args)
    assert total_variation(law, _ensemble_law(members, 3, **args)) > 1e-3


def test_the_bonus_row_is_the_ensembles_not_the_proposers(monkeypatch):
    """Negative control: the machine's rows taken from the proposer member alone (as if it were
    the target) give the member's law, not the ensemble's."""
    members = _members((2, 2), seed=40)
    args = {"ensemble": "weighted", "weights": (0.5, 0.5)}

    def proposer_only(self, member_logits, generated):
        return self.proposal_rows(member_logits[0], generated)

    monkeypatch.setattr(EnsembleLaw, "ensemble_rows", proposer_only)
    law = _law(members, 3, proposer=0, gamma=2, method="block", **args)
    assert total_variation(law, _ensemble_law(members, 3, **args)) > 1e-3


def test_samples_pass_chi_square_and_report_blocks():
    members = _members((2, 2), seed=41)
    args = {"ensemble": "contrastive", "mu": 0.4}
    expected = _ensemble_law(members, 3, **args)
    import torch

    generator = torch.Generator().manual_seed(5)
    samples, drafted = [], []
    for _ in range(600):
        tokens, stats = ensemble_draft_generate(members, PROMPT, 3, generator=generator, proposer=_draft_for(members, 41),
                                                gamma=2, method="block", **args)
        samples.append(tuple(tokens))
        drafted.extend(stats["draft_lengths"])
    assert set(drafted) == {2}
    assert chi_square_pvalue(samples, expected) > 1e-3


def test_the_member_proposer_draws_one_more_token_and_no_member_scores_twice():
    """WE-SD: the proposing member's Sample draws gamma + 1 (its row after the block), the other
    members score the block with one ScoreBlock each; a separate draft draws gamma."""
    machine = EnsembleDraftMachine("m1", ["m0", "m1", "m2"], method="block", gamma=3, num_drafts=1,
                                   ensemble="weighted", weights=None, mu=0.1, temperature=1.0, top_k=0, top_p=1.0,
                                   own_source=None, max_new_tokens=8)
    needs = machine.needs()
    assert [type(n).__name__ for n in needs] == ["Sample", "ScoreBlock", "ScoreBlock"]
    assert needs[0].model == "m1" and needs[0].count == 4 and needs[0].report_logits
    assert [(n.model, n.gamma) for n in needs[1:]] == [("m0", 3), ("m2", 3)]
    assert machine.streams() == {"m0": {}, "m1": {"sample": 1}, "m2": {}}
    draft = EnsembleDraftMachine("d", ["m0", "m1"], method="block", gamma=3, num_drafts=1, ensemble="weighted",
                                 weights=None, mu=0.1, temperature=1.0, top_k=0, top_p=1.0, own_source=None,
                                 max_new_tokens=8)
    assert draft.needs()[0].count == 3 and draft.streams()["d"] == {"sample": 3}
