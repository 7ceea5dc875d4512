"""A step's post-processing: each request's outcomes go through its machine, and the tokens it
makes final through its output (EOS, stop strings, max_tokens) out as a chunk on its queue
(:class:`RequestResults`); a request that ends sends its final chunk with its statistics."""

from __future__ import annotations

import logging
import time
from typing import Any

from actors.request_schema import GenerationChunk, TokenLogprob
from actors.coordination.metrics import SchedulerMetrics
from actors.coordination.plan import ALTERNATE
from actors.coordination.request_stats import record_outcomes, stats_or_none
from actors.coordination.request_state import RequestState, board_key
from actors.coordination.step_costs import AcceptanceBoard
from actors.messages import ItemOutcome
from verifiers.grammar import GRAMMAR_ERROR_PREFIX, grammar_complete
from verifiers.machines.needs import Sample

logger = logging.getLogger(__name__)

MAX_EMPTY_ITERATIONS = 64  # a machine that makes no progress this many iterations in a row is a bug



def grammar_dead_end(request: RequestState) -> bool:
    """Whether a constrained request ended at end-of-sequence before its grammar's string was
    complete: the mask allowed only end-of-sequence because no token fits (verifiers.grammar)."""
    output = request.output
    if request.grammar is None or output.finish_reason != "stop" or output.stop:
        return False
    return not grammar_complete(request.grammar, output.token_ids)



class RequestResults:
    """Hands requests their outcomes and ends them: :meth:`advance` after a step, :meth:`finish`
    and :meth:`fail` (which every part of the scheduler calls to end a request). Verifications
    count in ``metrics`` and in the pair's ``acceptance_board``."""

    def __init__(self, metrics: SchedulerMetrics, acceptance_board: AcceptanceBoard):
        self.metrics = metrics
        self.acceptance_board = acceptance_board

    def advance(self, request: RequestState, outcomes: list[ItemOutcome]) -> None:
        if request.cancelled or request.finished:
            return
        failed = [o for o in outcomes if o.error is not None]
        if failed:
            self.fail(request, failed[0].error, retryable=any(o.retryable for o in failed))
            return
        if request.prefilling:
            self.advance_prefill(request, outcomes)
            return
        logged = len(request.machine.token_logprobs)
        verified_before = len(request.machine.accepted_lengths)
        try:
            tokens = request.machine.consume([o.value for o in outcomes])
        except Exception as error:
            logger.exception("request %s: strategy iteration failed", request.session_id)
            self.fail(request, f"{type(error).__name__}: {error}")
            return
        record_outcomes(request, outcomes)
        self.record_verifications(request, verified_before)
        delta = request.output.add(tokens)
        if delta.token_ids:
            self.metrics.tokens(request.labels, request.clock, len(delta.token_ids), time.perf_counter(),
                                request.submitted)
        logprobs = self.chunk_logprobs(request, logged, len(delta.token_ids))
        if request.output.finished or request.machine.done:
            self.finish(request, delta, logprobs)
            return
        if not delta.token_ids:
            request.empty_iterations = request.empty_iterations + 1 if not tokens else 0
            if request.empty_iterations > MAX_EMPTY_ITERATIONS:
                self.fail(request, f"strategy {request.plan.strategy} made no progress in "
                                    f"{MAX_EMPTY_ITERATIONS} iterations")
            return
        request.empty_iterations = 0
        request.chunks.put_nowait(GenerationChunk(request_id=request.request_id, token_ids=delta.token_ids,
                                                  text=delta.text, logprobs=logprobs,
                                                  prompt_tokens=len(request.prompt_ids)))

    @staticmethod
    def advance_prefill(request: RequestState, outcomes: list[ItemOutcome]) -> None:
        """A prefill step's results: the models whose session now holds the whole prompt (but
        its last token, which the machine's first need feeds) leave ``prefilling``. Their time
        counts as the model's; the chunks are not decoding calls (``model_calls``)."""
        for need, outcome in zip(request.last_needs, outcomes):
            if need.model == request.plan.target:
                request.stats.time_target_s += outcome.timing.forward_s
            else:
                request.stats.time_draft_s += outcome.timing.forward_s
            if outcome.value.remaining == 0:
                request.prefilling.discard(need.model)

    @staticmethod
    def chunk_logprobs(request: RequestState, start: int, count: int) -> list[TokenLogprob] | None:
        """The log-probabilities of the chunk's tokens (the output keeps a prefix of the step's
        tokens: EOS, a stop string or max_tokens can cut it)."""
        if request.machine.logprobs is None:
            return None
        entries = request.machine.token_logprobs[start: start + count]
        return [TokenLogprob(token_id=t, logprob=lp, top=list(top)) for t, lp, top in entries]

    def record_verifications(self, request: RequestState, first_new: int) -> None:
        """The speculation counters of the verifications this step made (``accepted_lengths``
        entries from ``first_new`` on): sd / multi_draft one per step, K drafts of the Sample
        need's ``count`` tokens; se one per verified segment (its length in draft tokens)."""
        machine = request.machine
        accepted = machine.accepted_lengths[first_new:]
        if not accepted:
            return
        if request.plan.strategy == "se" and request.plan.proposer == ALTERNATE:
            lengths, producers = machine.segment_lengths[first_new:], machine.proposers[first_new:]
            for length, count, producer in zip(lengths, accepted, producers):
                self.metrics.verified(request.labels, 1, length, count)
                self.acceptance_board.observe((board_key(request), producer), length, count)  # per proposing member
            return
        sample = next((need for need in request.last_needs if isinstance(need, Sample)), None)
        drafts = 1 if sample is None else sample.num_drafts
        for count in accepted:  # a pre-drafted block (no Sample this step) is draft_lengths[-1] long
            self.metrics.verified(request.labels, drafts, drafts * machine.draft_lengths[-1], count)
            self.acceptance_board.observe(board_key(request), machine.draft_lengths[-1], count)

    def finish(self, request: RequestState, delta: Any, logprobs: list[TokenLogprob] | None = None) -> None:
        if grammar_dead_end(request):
            self.fail(request, GRAMMAR_ERROR_PREFIX + "the constraint allows no token of the vocabulary after "
                       f"{len(request.output.token_ids)} tokens (a string the tokenizer cannot spell)")
            return
        request.finished = True
        self.metrics.ended(request.labels, request.clock, request.output.finish_reason or "length",
                           time.perf_counter(), request.submitted)
        request.chunks.put_nowait(
            GenerationChunk(
                request_id=request.request_id,
                token_ids=delta.token_ids,
                text=delta.text,
                logprobs=logprobs,
                prompt_tokens=len(request.prompt_ids),
                finished=True,
                finish_reason=request.output.finish_reason or "length",
                stats=stats_or_none(request),
            )
        )

    def fail(self, request: RequestState, message: str, retryable: bool = False, timed_out: bool = False) -> None:
        if request.finished:
            return
        request.finished = True
        status = "timed_out" if timed_out else "unavailable" if retryable else "error"
        self.metrics.ended(request.labels, request.clock, status, time.perf_counter(), request.submitted,
                           admitted=bool(request.started))
        logger.error("request %s failed: %s", request.session_id, message)
        request.chunks.put_nowait(
            GenerationChunk(
                request_id=request.request_id,
                finished=True,
                finish_reason="error",
                error=message,
                retryable=retryable,
                timed_out=timed_out,
                stats=stats_or_none(request),
            )
        )

    def plan_iteration(self, request: RequestState) -> bool:
        """``request.last_needs`` from its machine; False (the request failed) when it raises."""
        try:
            request.last_needs = request.machine.needs()
            return True
        except Exception as error:
            logger.exception("request %s: strategy failed to plan its iteration", request.session_id)
            self.fail(request, f"{type(error).__name__}: {error}")
            return False
