"""Execute a machine's needs by recomputing every row from the full context (no caches).

:class:`LocalExecutor` is the executor of the reference loops: slow and obviously correct.
Each model has its own committed context (the ``append`` tokens of a need are committed before
the need is done, as on a serving worker), its own random streams and, for stateful
verification rules, its own verifier state. The rows come from the one sampling path,
:func:`verifiers.sampling.logits_to_probs`, exactly as on the serving workers; a block's
verification, from its rows on, is the serving engine's own (:mod:`verifiers.blocks`), and the
draws of a Sample are the engine's batched draw (:func:`verifiers.randomness.categorical_together`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verifiers.blocks import block_inputs, verified_row, verify_blocks
from verifiers.machines.base import DecodeMachine
from verifiers.machines.needs import (
    MODEL_FREE,
    PRE_DRAFTED,
    Extend,
    MemberBlock,
    Need,
    NextLogits,
    PreDraft,
    PreDrafted,
    Sample,
    Sampled,
    ScoreBlock,
    ScoreVerify,
    Verified,
    bonus_guesses,
)
from verifiers.penalties import NO_PENALTIES, Penalties, penalized_probs
from verifiers.proposers import one_hot_rows
from verifiers.randomness import RandomSource, categorical_together
from verifiers.registry import get_verifier
from verifiers.sampling import token_logprob

ModelFn = Callable[[tuple[int, ...]], torch.Tensor]


class LocalExecutor:
    """Runs needs on plain functions ``context tuple -> logits [V]``.

    model_fns: model name -> function. prompt: every model's starting context.
    sources: model name -> {stream name: RandomSource} (a machine's ``streams()`` layout).
    vocab_limit: logits are truncated to this many entries (the shared vocabulary; None keeps
    them whole). Sampling parameters and penalties are the request's, identical for every model;
    each row is penalized with the tokens generated before its own position. ``dtype``: the rows'
    precision (``verifiers.sampling.ROW_DTYPES``), as a worker's ``RowSampling.precision``; an
    :class:`Extend`'s draws stay float64 as on the workers (the ensemble's rows are float64).
    """

    def __init__(
        self,
        model_fns: Mapping[str, ModelFn],
        prompt: Sequence[int],
        sources: Mapping[str, Mapping[str, RandomSource]],
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        vocab_limit: int | None = None,
        penalties: Penalties = NO_PENALTIES,
        dtype: torch.dtype = torch.float64,
    ):
        self.model_fns = dict(model_fns)
        self.dtype = dtype
        self.prompt = tuple(int(t) for t in prompt)
        self.penalties = penalties
        self.contexts = {name: self.prompt for name in self.model_fns}
        self.sources = {name: dict(streams) for name, streams in sources.items()}
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        self.vocab_limit = vocab_limit
        self.verify_states: dict[str, Any] = {}
        self.pre_drafted: PreDrafted | None = None  # the last PreDraft's result (a later iteration verifies a chain)
        self.model_calls = {name: 0 for name in self.model_fns}

    def run_iteration(self, needs: Sequence[Need]) -> list[object]:
        """Execute one iteration's needs in order (a ScoreVerify reads an earlier need's result)."""
        results: list[object] = []
        for need in needs:
            self.contexts[need.model] += tuple(int(t) for t in need.append)
            if isinstance(need, Sample):
                results.append(self._sample(need))
            elif isinstance(need, ScoreVerify):
                results.append(self._score_verify(need, self._proposal(need, results)))
            elif isinstance(need, PreDraft):
                block = need.block if need.block is not None else tuple(results[need.block_from].tokens[0].tolist())
                self.pre_drafted = self._pre_draft(need, block)
                results.append(self.pre_drafted)
            elif isinstance(need, ScoreBlock):
                results.append(self._score_block(need, results[need.draft_need]))
            elif isinstance(need, Extend):
                results.append(self._extend(need))
            elif isinstance(need, NextLogits):
                self.model_calls[need.model] += 1
                results.append(self._logits(need.model, self.contexts[need.model]))
            else:
                raise TypeError(f"unknown need {need!r}")
        return results

    def _proposal(self, need: ScoreVerify, results: list[object]) -> Sampled:
        """The block ``need`` verifies: model-free (logits None), pre-drafted, or an earlier need's."""
        if need.draft_need == MODEL_FREE:
            return Sampled(tokens=torch.tensor([need.proposed], dtype=torch.int64))
        if need.draft_need == PRE_DRAFTED:
            return self.pre_drafted.chain(need.chain)
        return results[need.draft_need]

    def _logits(self, model: str, context: tuple[int, ...]) -> torch.Tensor:
        logits = torch.as_tensor(self.model_fns[model](context)).to(torch.float64)  # [V_model]
        return logits if self.vocab_limit is None else logits[: self.vocab_limit]

    def _rows(self, logits: torch.Tensor, contexts: list[tuple[int, ...]], dtype: torch.dtype | None = None
              ) -> torch.Tensor:
        """``logits [..., V]``, row ``i`` after ``contexts[i]`` (full contexts) -> rows in ``dtype``
        (default: the executor's)."""
        generated = [context[len(self.prompt):] for context in contexts]
        return penalized_probs(logits, **self.sampling, penalties=self.penalties, prompt=self.prompt, generated=generated,
                               dtype=dtype or self.dtype)

    def _source(self, model: str, stream: str) -> RandomSource:
        try:
            return self.sources[model][stream]
        except KeyError:
            raise ValueError(f"model {model!r} owns no random stream {stream!r}") from None

    def _sample(self, need: Sample) -> Sampled:
        source = self._source(need.model, need.stream)
        context = self.contexts[need.model]
        drafts: list[list[int]] = [[] for _ in range(need.num_drafts)]
        position_logits: list[torch.Tensor] = []
        logprobs = []
        for _ in range(need.count):
            contexts = [context + tuple(draft) for draft in drafts]
            logits = torch.stack([self._logits(need.model, c) for c in contexts])  # [K, V]
            # A machine that verifies the block itself recomputes the rows in float64 (as a worker draws them).
            rows = self._rows(logits, contexts, torch.float64 if need.report_logits else None)  # [K, V]
            tokens = categorical_together([(source, rows)])[0]  # [K]
            if need.logprobs is not None:
                logprobs.append(token_logprob(rows[0], int(tokens[0]), need.logprobs))
            for draft, token in zip(drafts, tokens.tolist()):
                draft.append(int(token))
            position_logits.append(logits)
        self.model_calls[need.model] += need.count
        logits = torch.stack(position_logits, dim=1) if need.return_logits or need.report_logits else None  # [K, n, V]
        return Sampled(tokens=torch.tensor(drafts, dtype=torch.int64), logits=logits,
                       logprobs=logprobs if need.logprobs is not None else None)

    def _pre_draft(self, need: PreDraft, block: tuple[int, ...]) -> PreDrafted:
        source = self._source(need.model, need.stream)
        context = self.contexts[need.model] + tuple(int(t) for t in block)
        row = self._rows(self._logits(need.model, context)[None], [context])[0]  # [V]
        guesses = bonus_guesses(row, need.guesses)
        chains: list[list[int]] = [[] for _ in guesses]
        position_logits: list[torch.Tensor] = []
        for _ in range(need.count):
            contexts = [context + (guess,) + tuple(chain) for guess, chain in zip(guesses, chains)]
            logits = torch.stack([self._logits(need.model, c) for c in contexts])  # [K, V]
            tokens = source.categorical(self._rows(logits, contexts))  # [K]
            for chain, token in zip(chains, tokens.tolist()):
                chain.append(int(token))
            position_logits.append(logits)
        self.model_calls[need.model] += need.count + 1
        return PreDrafted(guesses, torch.tensor(chains, dtype=torch.int64), torch.stack(position_logits, dim=1))

    def _score_verify(self, need: ScoreVerify, proposal: Sampled) -> Verified:
        spec = get_verifier(need.method)
        context = self.contexts[need.model]
        draft_tokens = proposal.tokens  # [K, gamma]
        gamma = draft_tokens.shape[1]
        drafts = draft_tokens.tolist()
        target_contexts = [context + tuple(draft[:i]) for draft in drafts for i in range(gamma + 1)]
        target_logits = torch.stack([self._logits(need.model, c) for c in target_contexts])  # [K*(gamma+1), V]
        target_probs = self._rows(target_logits, target_contexts).reshape(len(drafts), gamma + 1, -1)  # [K, gamma+1, V]
        if proposal.logits is None:  # model-free: one-hot rows
            draft_probs = one_hot_rows(draft_tokens, target_probs.shape[-1], target_probs.dtype)  # [K, gamma, V]
        else:
            draft_contexts = [context + tuple(draft[:i]) for draft in drafts for i in range(gamma)]
            draft_probs = self._rows(proposal.logits, draft_contexts)  # [K, gamma, V]
        # From the rows on, the serving engine's own steps (verifiers.blocks).
        inputs = block_inputs(spec, draft_tokens, draft_probs, target_probs)
        result = verify_blocks(spec, [inputs], [self._source(need.model, need.stream)],
                               state=self.verify_states.get(need.model))
        self.verify_states[need.model] = result.state
        verified = verified_row(spec, inputs, result, 0, need.logprobs)
        self.contexts[need.model] = context + tuple(verified.emitted)
        self.model_calls[need.model] += 1
        return verified

    def _score_block(self, need: ScoreBlock, proposal: Sampled) -> torch.Tensor:
        """The member's logits ``[K, gamma+1, V]`` at every position of each draft's first ``gamma`` tokens."""
        context = self.contexts[need.model]
        drafts = proposal.tokens[:, : need.gamma].tolist()  # [K][gamma]
        contexts = [context + tuple(draft[:j]) for draft in drafts for j in range(need.gamma + 1)]
        logits = torch.stack([self._logits(need.model, c) for c in contexts])  # [K*(gamma+1), V]
        self.model_calls[need.model] += 1
        return logits.reshape(len(drafts), need.gamma + 1, -1)

    def _extend(self, need: Extend) -> MemberBlock:
        context = self.contexts[need.model]
        queued = tuple(need.queued)
        queued_logits = [self._logits(need.model, context + queued[:j]) for j in range(len(queued))]
        tokens: list[int] = []
        token_logits: list[torch.Tensor] = []
        for _ in range(need.count):
            row_context = context + queued + tuple(tokens)
            logits = self._logits(need.model, row_context)  # [V]
            row = self._rows(logits[None], [row_context], torch.float64)[0]  # [V]
            tokens.append(int(self._source(need.model, need.stream).categorical(row)))
            token_logits.append(logits)
        # One scoring call covers the queue and the first draw; each further draw is a call.
        self.model_calls[need.model] += max(1, need.count) if queued else need.count
        vocab = self.vocab_limit or (token_logits[0].shape[-1] if token_logits else 0)
        return MemberBlock(
            queued_logits=torch.stack(queued_logits) if queued_logits else torch.empty(0, vocab, dtype=torch.float64),
            tokens=torch.tensor(tokens, dtype=torch.int64),
            token_logits=torch.stack(token_logits) if token_logits else torch.empty(0, vocab, dtype=torch.float64),
        )


def run_machine(machine: DecodeMachine, executor: LocalExecutor) -> list[int]:
    """Drive ``machine`` to its end with ``executor``; returns the committed tokens."""
    while not machine.done:
        machine.consume(executor.run_iteration(machine.needs()))
    return list(machine.committed)


def layout_sources(
    streams: Mapping[str, Mapping[str, int]], sources: Sequence[RandomSource]
) -> dict[str, dict[str, RandomSource]]:
    """A machine's ``streams()`` (model -> {stream name: index}) with the indices replaced by
    ``sources[index]`` (``verifiers.randomness.split_sources`` of the request's generator)."""
    return {model: {name: sources[index] for name, index in named.items()} for model, named in streams.items()}
