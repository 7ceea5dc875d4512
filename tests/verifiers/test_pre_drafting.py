"""Pre-drafting (verifiers.machines.needs.PreDraft) keeps every single-draft rule exact.

While the target verifies a block, the draft drafts the next block after each of K candidate
bonus tokens; the next step verifies that chain when the block was accepted in full and the bonus
is a candidate. Exact enumeration of the output law (float64, TV < 1e-9) on tiny
context-dependent models, for the token, block and greedy block rules, fixed gamma, adaptive
gamma, a block length that depends on the committed tokens and penalties (against the penalized
law of plain speculative decoding, itself proven exact in test_penalties.py); each case checks
that pre-drafted chains were really verified on some branches (the test is not vacuous).
Controls: a chain chosen by its own draws, and under penalties a chain used after a bonus it
was not drafted for, each change the law.
"""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import model_pair, target_law
from verifiers.adaptive import AdaptiveGammaSettings
from verifiers.reference.exact import exact_law, total_variation
from verifiers.reference.executor import LocalExecutor, layout_sources, run_machine
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.penalties import NO_PENALTIES, Penalties
from verifiers.randomness import split_sources
from verifiers.reference import speculative_generate

PROMPT = (1,)
EXACT_TOLERANCE = 1e-9
PENALTIES = Penalties(presence=0.7, frequency=0.4, repetition=1.8)


def _law(method: str, vocab: int, length: int, seed: int, *, gamma: int = 2, guesses: int = 1,
         adaptive: AdaptiveGammaSettings | None = None, temperature: float = 1.0,
         penalties: Penalties = NO_PENALTIES):
    """(exact law, how many branches verified a pre-drafted chain) of speculative_generate."""
    draft_fn, target_fn = model_pair(vocab, seed)
    reused = []

    def procedure(source):
        tokens, stats = speculative_generate(draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method,
                                             generator=source, adaptive=adaptive, pre_drafting=guesses,
                                             temperature=temperature, penalties=penalties)
        reused.append(stats["pre_drafted"])
        return tuple(tokens)

    return exact_law(procedure), sum(1 for count in reused if count), (draft_fn, target_fn)


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
@pytest.mark.parametrize(("vocab", "length", "seed", "gamma", "guesses"),
                         [(2, 4, 3, 1, 1), pytest.param(2, 4, 5, 2, 2, marks=pytest.mark.slow), (3, 3, 11, 1, 2)])
def test_pre_drafting_keeps_the_target_law(method, vocab, length, seed, gamma, guesses):
    law, reused, (_, target_fn) = _law(method, vocab, length, seed, gamma=gamma, guesses=guesses)
    assert reused > 0
    assert total_variation(law, target_law(target_fn, PROMPT, length)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", [pytest.param("token", marks=pytest.mark.slow), "block",
                                    pytest.param("greedy_block", marks=pytest.mark.slow)])
def test_pre_drafting_under_penalties_keeps_the_penalized_law(method):
    _, target_fn = model_pair(3, 11)
    plain, _, _ = _law(method, 3, 3, 11, gamma=1, guesses=0, penalties=PENALTIES)
    law, reused, _ = _law(method, 3, 3, 11, gamma=1, guesses=2, penalties=PENALTIES)
    assert reused > 0
    assert total_variation(plain, target_law(target_fn, PROMPT, 3)) > 1e-3  # the penalties matter
    assert total_variation(law, plain) < EXACT_TOLERANCE


@pytest.mark.slow  # minutes: the adaptive chooser multiplies the enumerated branches
@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
def test_pre_drafting_with_adaptive_gamma_keeps_the_target_law(method):
    settings = AdaptiveGammaSettings(gamma_max=2, prior_acceptance=0.8)
    law, reused, (_, target_fn) = _law(method, 2, 4, 7, guesses=2, adaptive=settings)
    assert reused > 0
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) < EXACT_TOLERANCE


class _CommittedChooser:
    """Not the production rule: a block length read from the committed tokens (anything fixed
    before the block is drafted is allowed; a pre-drafted block is fixed a step earlier)."""

    def __init__(self, machine: SpeculativeMachine):
        self.machine = machine

    def choose(self, *args, **kwargs) -> int:
        return 1 + sum(self.machine.committed) % 2

    def observe(self, gamma: int, num_accepted: int) -> None:
        pass


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
def test_pre_drafting_with_a_history_dependent_block_keeps_the_target_law(method):
    draft_fn, target_fn = model_pair(2, 13)
    reused = []

    def procedure(source):
        machine = SpeculativeMachine("draft", "target", method=method, gamma=1, num_drafts=1, max_new_tokens=4,
                                     adaptive=AdaptiveGammaSettings(gamma_max=2), pre_drafting=2)
        machine.chooser = _CommittedChooser(machine)
        executor = LocalExecutor({"draft": draft_fn, "target": target_fn}, PROMPT,
                                 layout_sources(machine.streams(), split_sources(source, 2)),
                                 temperature=1.0, top_k=0, top_p=1.0)
        tokens = run_machine(machine, executor)
        reused.append(machine.pre_drafted_iterations)
        return tuple(tokens[:4])

    law = exact_law(procedure)
    assert any(reused)
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) < EXACT_TOLERANCE


def test_greedy_output_is_unchanged_by_pre_drafting():
    draft_fn, target_fn = model_pair(5, 2, noise=0.2)

    outputs = {guesses: speculative_generate(draft_fn, target_fn, PROMPT, 12, gamma=3, method="block",
                                             generator=torch.Generator().manual_seed(0), temperature=0.0,
                                             pre_drafting=guesses) for guesses in (0, 1, 3)}
    assert outputs[0][0] == outputs[1][0] == outputs[3][0]
    assert outputs[3][1]["pre_drafted"] > 0 and outputs[0][1]["pre_drafted"] == 0


def test_a_chain_used_after_the_wrong_bonus_under_penalties_changes_the_law(monkeypatch):
    """Control: with penalties the rows a chain is verified against are penalized with the real
    context; a chain drafted after another bonus was drawn from other rows. (Without penalties
    that chain is still drawn from the rows it reports, and verifying it is exact: any proposal
    is, so long as its tokens follow the rows given to the verifier.)"""
    original = SpeculativeMachine._carry

    def carry_first_chain(self, pre_drafted, verified, gamma):
        original(self, pre_drafted, verified, gamma)
        if pre_drafted is not None and verified.num_accepted == gamma and self.carried is None:
            self.carried_chain, self.carried = 0, pre_drafted.tokens[0].tolist()

    exact, _, _ = _law("block", 3, 3, 11, gamma=1, guesses=1, penalties=PENALTIES)
    monkeypatch.setattr(SpeculativeMachine, "_carry", carry_first_chain)
    law, reused, (_, target_fn) = _law("block", 3, 3, 11, gamma=1, guesses=1, penalties=PENALTIES)
    assert reused > 0
    assert total_variation(law, exact) > 1e-3


@pytest.mark.slow
def test_a_chain_chosen_by_its_own_draws_changes_the_law(monkeypatch):
    """Control: choosing among the chains by their tokens (the lowest first token) makes the
    verified proposal follow another law than the rows it reports."""
    original = SpeculativeMachine._carry

    def carry_lowest_chain(self, pre_drafted, verified, gamma):
        original(self, pre_drafted, verified, gamma)
        if self.carried is not None:
            self.carried_chain = int(pre_drafted.tokens[:, 0].argmin())
            self.carried = pre_drafted.tokens[self.carried_chain].tolist()

    monkeypatch.setattr(SpeculativeMachine, "_carry", carry_lowest_chain)
    law, reused, (_, target_fn) = _law("token", 2, 4, 5, gamma=2, guesses=2)
    assert reused > 0
    assert total_variation(law, target_law(target_fn, PROMPT, 4)) > 1e-3
