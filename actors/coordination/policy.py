"""The step policy: what the gamma-auto requests of a step do, decided once for the whole step.

A step of several requests steps in one mode (:attr:`StepDecision.mode`): a step whose requests
split pays the draft's forwards AND the plain forwards, worse than either. Speculative steps
draft one block for all (:attr:`StepDecision.block`): a step's draft call runs as many forwards
as its longest block and its verifying forward is padded to its longest row. The choice reads
the measured step costs (:class:`actors.coordination.step_costs.StepCostModel`), the tokens per
second whole steps of each mode reached (:class:`~actors.coordination.step_costs.ModeRates`) and
the pair's recent acceptance (:class:`~actors.coordination.step_costs.AcceptanceBoard`): the
goodput rule of SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput", arXiv 2406.14066, Sec. 4).

Every input is in the past of the step, and the decision is made before any draft is sampled,
so each request's output law stays its target's (:mod:`verifiers.adaptive`).

The machines read the decision through their ``step_costs`` callable, bound by :meth:`StepPolicy.bind`
to the step's :class:`StepDecision` (:meth:`StepPolicy.costs`).

``se`` with the alternate proposer and gamma "auto" has a mode of its own
(:attr:`StepDecision.alternate`), decided at every batch, one request included: the kind of
step (the members' proposals, or the plain ensemble's steps) whose whole steps measured more
tokens per second at this batch, the other probed now and then (measured on steps whose
requests are all such requests). The machine follows it, a plain step dropping unverified
proposals (:class:`verifiers.machines.ensemble.SpeculativeEnsembleMachine`). Proposing, the
machine chooses each member's proposal length from the member calls' measured seconds
(:class:`actors.coordination.alternate_costs.AlternateCallCosts`, learnt from the steps whose
needs are all member calls) and its members' acceptance (:mod:`verifiers.alternate_gammas`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

from actors.coordination.alternate_costs import AlternateCallCosts, PooledRates
from actors.coordination.cohorts import Cohort
from actors.coordination.request_state import RequestState, board_key
from actors.coordination.step_costs import AcceptanceBoard, CallReport, ModeRates, StepCostModel, board_prior_weight
from verifiers.adaptive import StepCosts, best_block
from verifiers.machines.autoregressive import AutoregressiveMachine
from verifiers.machines.base import AR_TOKENS_PER_ITERATION
from verifiers.machines.ensemble import SpeculativeEnsembleMachine
from verifiers.machines.ensemble_draft import EnsembleDraftMachine
from verifiers.machines.needs import Extend, NextLogits, Sample, ScoreBlock, ScoreVerify
from verifiers.machines.speculative import SpeculativeMachine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDecision:
    """What a step's gamma-auto requests do (:class:`verifiers.adaptive.StepCosts`' ``mode`` and
    ``block``), and the number of requests in the step the costs are read at."""

    mode: str = "any"  # any: each request weighs the costs itself; plain; speculative
    block: int = 0  # with mode speculative: the block every request drafts; 0: each chooses its own
    batch: int = 1
    #: The alternating ensembles' mode (gamma auto): plain, speculative (they propose), any (they propose).
    alternate: str = "any"
    #: Every request of the step alternates with gamma auto: the step measures ``alternate``'s rate.
    alternate_only: bool = False
    #: The first step in ``alternate`` after the other mode: it stands for neither (a proposal into
    #: an empty queue commits nothing), so it is not measured.
    alternate_switched: bool = False
    #: Whether the step's yield stands for its mode (:meth:`StepPolicy.observe_mode`): not a
    #: speculative step right after a plain one, whose draft first feeds the plain steps' tokens.
    representative: bool = True


#: The alternating ensembles' gamma auto: steps in a row a mode is tried (probed), and steps the
#: faster one runs before the slower is probed again.
ALTERNATE_PROBE_STEPS = 6
ALTERNATE_EXPLOIT_STEPS = 96

#: A step of one request alone (each request's own choice; a burst's iterations).
ALONE = StepDecision()

#: Steps a probe of each mode runs (gamma auto, a cohort of two or more): a speculative probe
#: after plain steps runs two, the first of which feeds the draft every token the plain steps
#: made (its yield is not the mode's), the second measures the mode. Charged to the speculative
#: mode, that catch-up made every probe of it after plain steps look slower than speculative
#: steps are, and a cohort that once went plain stayed plain where speculative steps were faster.
PROBE_STEPS = {"plain": 1, "speculative": 2}

#: Steps in a row a cohort runs in the faster mode (gamma auto) before it probes the other one for
#: :data:`PROBE_STEPS`. A speculative probe after plain steps costs a catch-up step (the draft is fed
#: every token the plain steps made, 8 a request each): probed every 4 steps, a cohort at 16 clients
#: spent a third of its steps probing. Each probe that leaves the faster mode as it was doubles the
#: steps before the next, up to :data:`COHORT_PROBE_EVERY_MAX`; a change of the faster mode starts over.
COHORT_PROBE_EVERY = 16
COHORT_PROBE_EVERY_MAX = 128

#: Tokens a plain iteration draws in a step of two or more requests (``ar``; ``sd``'s plain steps
#: with gamma "auto" weighing step costs, :func:`set_plain_tokens`). Every step is a round trip
#: from the coordinator to the workers and a chunk per request through Serve; at 4 tokens a step,
#: 16 clients on 2 CPU cores left the target's worker idle a fifth of the time, and the chunks kept
#: the serving processes on about a third of the cores (docs/design.md, "Tokens per step"). A
#: request alone keeps :data:`~verifiers.machines.base.AR_TOKENS_PER_ITERATION` (its burst streams each
#: iteration as it ends). The default of ``engine.step_tokens``.
COHORT_PLAIN_TOKENS = 8


def plain_tokens(batch: int, tokens: int = COHORT_PLAIN_TOKENS) -> int:
    """Tokens a plain iteration draws in a step of ``batch`` requests (``tokens``: a step of
    several's, ``engine.step_tokens``)."""
    return AR_TOKENS_PER_ITERATION if batch < 2 else tokens


def first_token_due(request: RequestState) -> bool:
    """Whether ``request``'s next step gives it its first token (its prompt is in every session)."""
    return not request.prefilling and not request.machine.committed


def set_plain_tokens(machine: Any, batch: int, tokens: int = COHORT_PLAIN_TOKENS) -> None:
    """Set a machine's plain draws for a step of ``batch`` requests where that cannot change a seeded
    request's tokens: an ``ar`` machine's (its tokens do not depend on the count), and the plain
    steps of ``sd`` with gamma "auto" weighing measured costs (its tokens already depend on
    timings); every other machine keeps :data:`~verifiers.machines.base.AR_TOKENS_PER_ITERATION`. An
    ``ar`` request alone draws its first token on its own (a first iteration of several draws
    delayed its first chunk by their forwards); in a step of several it would lose the step's
    other draws, so there it draws as many as the rest."""
    if isinstance(machine, AutoregressiveMachine) or (
            type(machine) is SpeculativeMachine and machine.step_costs is not None):
        machine.plain_tokens = plain_tokens(batch, tokens)
    if isinstance(machine, AutoregressiveMachine):  # alone, the first token streams after one draw
        machine.first_tokens = 1 if batch < 2 else None


#: Every this many speculative steps of a cohort draft a neighbour of the best block (the next
#: longer, then the next shorter, in turn): the costs of the token counts the choice avoids are
#: measured again, so a count measured only when it was slow (the first forwards of a shape, or
#: a moment the machine was busy) is not avoided for good.
EXPLORE_EVERY = 8


def target_verifies(machine: Any) -> bool:
    """Whether ``machine`` is sd's: a draft / target pair whose target verifies (pre-drafting and
    the pair's measured step costs apply)."""
    return isinstance(machine, SpeculativeMachine) and machine.target_verifies


def costed_step(needs: list) -> bool | None:
    """Whether a step of ``needs`` is speculative (a draft call, then verifying or scoring calls:
    sd's ScoreVerify, a drafted ensemble's ScoreBlock) or plain (a target's Samples, the members'
    NextLogits); None for steps of other shapes, which the cost model does not learn from."""
    if not needs or not all(isinstance(need, (Sample, ScoreVerify, ScoreBlock, NextLogits)) for need in needs):
        return None
    return any(isinstance(need, (ScoreVerify, ScoreBlock)) for need in needs)


def costed_models(machine: Any, forwards: dict) -> tuple[str, str] | None:
    """``(draft, verifier)`` whose measured forwards price ``machine``'s steps: sd's pair; for a
    drafted ensemble the proposer and its slowest measured scoring member (the members score in
    parallel); None before any is measured."""
    if not isinstance(machine, EnsembleDraftMachine):
        return machine.draft, machine.target
    measured = [name for name in machine.scorers if name in forwards]
    if not measured:
        return None
    return machine.draft, max(measured, key=lambda name: forwards[name].estimate(1) or 0.0)


def alternates_by_goodput(request: RequestState) -> bool:
    """Whether ``request`` is se with the alternate proposer and gamma auto, following the measured
    goodput (``goodput_gamma``)."""
    machine = request.machine
    return isinstance(machine, SpeculativeEnsembleMachine) and machine.step_costs is not None


def chooses_by_costs(request: RequestState) -> bool:
    """Whether ``request`` chooses its blocks by measured costs (gamma auto with ``goodput_gamma``)."""
    return getattr(request.machine, "step_costs", None) is not None and not alternates_by_goodput(request)


class StepPolicy:
    """Decides each step's :class:`StepDecision` from what was measured, and learns from the steps
    run (:meth:`observe_step`, :meth:`observe_mode`, the results' verifications on
    :attr:`acceptance_board`). ``goodput``: gamma-auto requests weigh measured costs (else
    their acceptance alone). ``step_tokens``: a plain iteration's draws in a step of several."""

    def __init__(self, *, goodput: bool = True, step_tokens: int = COHORT_PLAIN_TOKENS):
        self.goodput = goodput
        self.step_tokens = int(step_tokens)  # a plain iteration's draws in a step of several (engine.step_tokens)
        self.cost_model = StepCostModel(plain_tokens=AR_TOKENS_PER_ITERATION)
        self.acceptance_board = AcceptanceBoard()
        self.mode_rates = ModeRates()
        self.alternate_rates = PooledRates()  # the alternating ensembles' steps, by mode
        self.alternate_calls = AlternateCallCosts()  # their member calls' seconds
        self._alternate_step: tuple[int, dict[str, int], list[CallReport]] | None = None  # the last, until timed
        self._opened = False  # the last step opened a session (a prefill)

    # ------------------------------------------------------------------ requests
    def admit(self, request: RequestState) -> None:
        """A gamma-auto sd request with goodput on reads the step costs, and starts from its pair's
        recent acceptance."""
        machine = request.machine
        drafted = isinstance(machine, EnsembleDraftMachine)
        if self.goodput and (target_verifies(machine) or drafted) and getattr(machine, "chooser", None) is not None:
            self.bind(request, ALONE)
            self.start_from_group_acceptance(request)
        elif self.goodput and isinstance(machine, SpeculativeEnsembleMachine) and machine.adaptive is not None:
            self.bind(request, ALONE)
            for member, chooser in enumerate(machine.acceptance):  # each member's recent acceptance as proposer
                alpha = self.acceptance_board.acceptance((board_key(request), member))
                if alpha is not None:
                    chooser.settings = dataclasses.replace(chooser.settings, prior_acceptance=alpha,
                                                           prior_weight=board_prior_weight(alpha))

    def start_from_group_acceptance(self, request: RequestState) -> None:
        """A gamma-auto request starts from the acceptance its pair met recently
        (:class:`actors.coordination.step_costs.AcceptanceBoard`), when there is one, instead of the fixed prior."""
        chooser = request.machine.chooser
        alpha = self.acceptance_board.acceptance(board_key(request))
        if alpha is not None:
            chooser.settings = dataclasses.replace(chooser.settings, prior_acceptance=alpha,
                                                   prior_weight=board_prior_weight(alpha))

    def bind(self, request: RequestState, decision: StepDecision) -> None:
        """Point ``request``'s machine at the costs of a step decided as ``decision``."""
        if isinstance(request.machine, SpeculativeEnsembleMachine):
            request.machine.step_costs = functools.partial(self.alternate_costs, request.machine, decision)
        else:
            request.machine.step_costs = functools.partial(self.costs, request.machine, decision)

    # ------------------------------------------------------------------ deciding
    def decide(self, cohort: Cohort) -> StepDecision:
        """The decision for the cohort's next step (binding every gamma-auto request to it)."""
        previous = cohort.mode
        mode = self._cohort_mode(cohort)
        alternating = [request for request in cohort.stepping() if alternates_by_goodput(request)]
        previous_alternate = cohort.alternate_mode
        alternate = self._alternate_mode(cohort, alternating)
        decision = StepDecision(mode, self._cohort_block(cohort) if mode == "speculative" else 0,
                                len(cohort.running), alternate,
                                bool(alternating) and len(alternating) == len(cohort.running),
                                alternate_switched=alternate != previous_alternate,
                                representative=not (mode == "speculative" and previous == "plain"))
        logger.debug("cohort %d, %d requests: %s", cohort.index, len(cohort.running), decision)
        for request in cohort.running:
            if chooses_by_costs(request) or alternates_by_goodput(request):
                self.bind(request, decision)
        return decision

    def _alternate_mode(self, cohort: Cohort, alternating: list[RequestState]) -> str:
        """The alternating ensembles' mode for the step: each mode is tried for
        ``ALTERNATE_PROBE_STEPS`` steps in a row (a proposal's tokens are committed only steps
        later), then the faster measured at this batch runs ``ALTERNATE_EXPLOIT_STEPS`` steps
        before the slower is probed again. A probe measures afresh (the probed mode's earlier steps
        are forgotten): measured while the machine was slower, they kept a cohort in plain steps
        for hundreds of steps after proposals had become 1.5x faster again."""
        if not alternating:
            return "any"
        batch = len(cohort.running)
        plain, speculative = self.alternate_rates.rate("plain", batch), self.alternate_rates.rate("speculative", batch)
        current, steps = cohort.alternate_mode, cohort.alternate_steps
        if plain is None or speculative is None:
            unmeasured = "speculative" if speculative is None else "plain"
            mode = current if current == unmeasured and steps < ALTERNATE_PROBE_STEPS else unmeasured
            if current == unmeasured and steps >= ALTERNATE_PROBE_STEPS:
                mode = "plain" if unmeasured == "speculative" else "speculative"
        else:
            faster = "plain" if plain > speculative else "speculative"
            slower = "speculative" if faster == "plain" else "plain"
            if current == slower:  # probing
                mode = slower if steps < ALTERNATE_PROBE_STEPS else faster
            else:
                mode = faster if steps < ALTERNATE_EXPLOIT_STEPS else slower
                if mode == slower:
                    self.alternate_rates.forget(slower, batch)
        if mode != current:
            machine = alternating[0].machine
            logger.info("cohort %d, %d requests: alternating ensembles step %s (measured tokens/s: plain %s, proposals "
                        "%s; lengths %s at acceptance %s)", cohort.index, batch, mode, _rate(plain), _rate(speculative),
                        machine.chosen_gammas, [round(member.acceptance, 2) for member in machine.acceptance])
        cohort.alternate_steps = steps + 1 if mode == current else 1
        cohort.alternate_mode = mode
        return mode

    def costs(self, machine: Any, decision: StepDecision) -> StepCosts | None:
        """The measured costs of a step of ``decision.batch`` requests for ``machine``'s models, with
        the step's mode and block."""
        costs = self._measured(machine, decision.batch)
        if costs is None:
            return None
        block = decision.block if decision.mode == "speculative" else 0
        return dataclasses.replace(costs, mode=decision.mode, block=min(block, machine.chooser.settings.gamma_max))

    def _cohort_mode(self, cohort: Cohort) -> str:
        """Plain or speculative for every gamma-auto request of a step of two or more requests,
        decided once (a step whose requests split pays the draft's forwards AND the plain
        forwards): speculative when a fixed block drafts anyway; else the mode whose whole steps
        measured more tokens per second at this batch (:class:`actors.coordination.step_costs.ModeRates`), the
        other probed after ``cohort.probe_every`` steps in a row (for :data:`PROBE_STEPS`; from
        :data:`COHORT_PROBE_EVERY`, doubled by each probe that confirms the faster mode); before
        both are measured, what the cost model and the pair's recent acceptance favour. ``any``:
        alone, or nothing measured yet; each request weighs the costs itself."""
        stepping = cohort.stepping()
        autos = [request for request in stepping if chooses_by_costs(request)]
        if len(stepping) < 2 or not autos:
            return "any"
        if any(isinstance(r.machine, SpeculativeMachine) and r.machine.chooser is None for r in stepping):
            return "speculative"
        if cohort.probe_steps_left > 0:  # a probe goes on
            cohort.probe_steps_left -= 1
            mode = cohort.mode
        else:
            mode = self._faster_mode(autos, len(stepping))
            if mode is None:
                return "any"
            if cohort.probed_from is not None:  # a probe just ended: back off while probes confirm
                confirmed = mode == cohort.probed_from
                cohort.probe_every = min(2 * cohort.probe_every, COHORT_PROBE_EVERY_MAX) if confirmed else COHORT_PROBE_EVERY
                cohort.probed_from = None
            elif mode != cohort.mode:  # the faster mode changed between probes: start over
                cohort.probe_every = COHORT_PROBE_EVERY
            if mode == cohort.mode and cohort.mode_steps >= cohort.probe_every:  # probe the other mode
                cohort.probed_from = mode
                mode = "plain" if mode == "speculative" else "speculative"
                cohort.probe_steps_left = PROBE_STEPS[mode] - 1
        cohort.mode_steps = cohort.mode_steps + 1 if mode == cohort.mode else 1
        cohort.mode = mode
        return mode

    def _cohort_block(self, cohort: Cohort) -> int:
        """The block every gamma-auto request of a speculative step drafts: the one with the most
        expected tokens per second at the pair's recent acceptance and the measured costs (a
        step's draft call runs as many forwards as its longest block, its verifying forward is
        padded to its longest row), but every :data:`EXPLORE_EVERY`-th a neighbour of it; 0 (each
        chooses) while nothing is measured."""
        stepping = cohort.stepping()
        autos = [request for request in stepping if chooses_by_costs(request)]
        costs = self._pair_costs(autos, len(stepping)) if len(autos) >= 2 else None
        if costs is None:
            return 0
        gamma_max = len(costs.verify_s)
        block = best_block(self._group_acceptance(autos), gamma_max, costs, allow_plain=False,
                           tokens_by_block=self._group_tokens_by_block(autos, gamma_max))
        cohort.blocks_chosen += 1
        if cohort.blocks_chosen % EXPLORE_EVERY == 0:
            longer = cohort.blocks_chosen % (2 * EXPLORE_EVERY) == EXPLORE_EVERY
            neighbour = block + 1 if longer else block - 1
            block = neighbour if 1 <= neighbour <= gamma_max else block
        return block

    def _faster_mode(self, autos: list[RequestState], batch: int) -> str | None:
        """The mode whose steps of ``batch`` requests measured faster; the unmeasured one while
        only one is; None while neither is and the cost model has nothing."""
        plain, speculative = self.mode_rates.rate("plain", batch), self.mode_rates.rate("speculative", batch)
        if plain is not None and speculative is not None:
            return "plain" if plain > speculative else "speculative"
        if plain is not None or speculative is not None:
            return "speculative" if plain is not None else "plain"
        costs = self._pair_costs(autos, batch)
        if costs is None:
            return None
        tokens_by_block = self._group_tokens_by_block(autos, len(costs.verify_s))
        block = best_block(self._group_acceptance(autos), len(costs.verify_s), costs, tokens_by_block=tokens_by_block)
        return "speculative" if block > 0 else "plain"

    def _pair_costs(self, autos: list[RequestState], batch: int) -> StepCosts | None:
        """The measured costs of a step of ``batch`` requests for the first gamma-auto request's pair."""
        return self._measured(autos[0].machine, batch)

    def _measured(self, machine: Any, batch: int) -> StepCosts | None:
        """The measured costs of a step of ``batch`` requests for ``machine``'s models (a drafted
        ensemble's plain step is the plain ensemble's: one token per request)."""
        forwards = self.cost_model.forwards if isinstance(machine, EnsembleDraftMachine) else {}
        models = costed_models(machine, forwards)
        if models is None:
            return None
        costs = self.cost_model.costs(*models, batch=batch, gamma_max=machine.chooser.settings.gamma_max,
                                      num_drafts=machine.num_drafts)
        if costs is not None and isinstance(machine, EnsembleDraftMachine):
            costs = dataclasses.replace(costs, plain_tokens=1)
        elif costs is not None:  # what a plain step of this batch draws (set_plain_tokens)
            costs = dataclasses.replace(costs, plain_tokens=plain_tokens(batch, self.step_tokens))
        return costs

    def _group_acceptance(self, autos: list[RequestState]) -> float:
        """The pair's recent per-token acceptance (the board), else the requests' own mean."""
        alpha = self.acceptance_board.acceptance(board_key(autos[0]))
        return alpha if alpha is not None else sum(r.machine.chooser.acceptance for r in autos) / len(autos)

    def _group_tokens_by_block(self, autos: list[RequestState], gamma_max: int) -> tuple[float, ...] | None:
        """The tokens an iteration of the pair emits by block, measured over the group's recent
        verifications (:meth:`actors.coordination.step_costs.AcceptanceBoard.expected_tokens`); None before."""
        return self.acceptance_board.expected_tokens(board_key(autos[0]), gamma_max)

    # ------------------------------------------------------------------ learning
    def observe_step(self, batch: int, needs: list, reports: list[CallReport], wall_s: float) -> None:
        """Feed a step's timings to the cost model (:func:`costed_step`: steps of other shapes, the
        alternating ensemble's, are left out)."""
        speculative = costed_step(needs)
        if speculative is not None:
            self.cost_model.observe_step(batch, reports, wall_s, speculative=speculative)
        self._alternate_step = None
        self._opened = not all(report.uniform for report in reports)  # a prefill's step stands for no mode
        if needs and all(isinstance(need, Extend) for need in needs):  # timed whole in observe_mode
            items: dict[str, int] = {}
            for need in needs:
                items[need.model] = items.get(need.model, 0) + 1
            self._alternate_step = (batch, items, list(reports))

    def observe_mode(self, decision: StepDecision, batch: int, tokens: int, seconds: float) -> None:
        """What a whole step of the decided mode yielded (steps whose mode was decided and whose
        yield stands for it only)."""
        if decision.mode != "any" and decision.representative:
            self.mode_rates.observe(decision.mode, batch, tokens, seconds)
        if decision.alternate_only and decision.alternate != "any" and not self._opened and not decision.alternate_switched:
            self.alternate_rates.observe(decision.alternate, batch, tokens, seconds)
        if self._alternate_step is not None:
            step_batch, items, reports = self._alternate_step
            self.alternate_calls.observe_step(step_batch, items, reports, seconds)
            self._alternate_step = None

    def alternate_costs(self, machine: SpeculativeEnsembleMachine, decision: StepDecision) -> StepCosts:
        """What an alternating ensemble with gamma auto reads: the step's mode for it (the policy
        compared whole steps) and its members' measured calls (it chooses their lengths)."""
        calls = self.alternate_calls.member_call_s(machine.members, decision.batch, machine.adaptive.gamma_max)
        return StepCosts(draft_s=0.0, verify_s=(0.0,), overhead_s=0.0, plain_s=0.0, plain_overhead_s=0.0,
                         plain_tokens=1, mode=decision.alternate, member_call_s=calls)


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"
