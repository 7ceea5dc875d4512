"""The request's row transforms: repetition / presence / frequency penalties, logit bias,
``min_tokens`` and ``min_p``: changes of the logits (and rows) that define the law a request
samples from, most of them context-dependent.

The penalized law at a position depends on the tokens generated *before that position*, so
inside a speculative block every position has its own context: draft token ``j`` of draft ``k``
was drawn from the draft's logits penalized with the generated tokens plus draft ``k``'s first
``j`` tokens, and the target row it is verified against is penalized with exactly the same
context. Every maker of rows (the serving workers, the reference executor, the ensemble
machines) goes through :func:`penalized_probs`, so the draft rows, the target rows and the
verification agree position by position, and every strategy stays lossless with respect to the
penalized target (or ensemble) law.

Semantics (as in vLLM / transformers, applied in this order to the logits, in the rows' precision):

1. ``repetition`` (``r``, 1 = off): the logit ``l`` of every token that occurs in the prompt or
   in the generated tokens becomes ``l / r`` if ``l > 0`` else ``l * r``;
2. ``frequency`` and ``presence`` (OpenAI): ``l -= frequency * count + presence * (count > 0)``,
   ``count`` = occurrences among the generated tokens (not the prompt);
3. ``logit_bias``: ``l += bias[token]``;
4. ``min_tokens`` (vLLM): the end-of-sequence ids (``eos_ids``) get ``-inf`` in every row with
   fewer than ``min_tokens`` generated tokens before it (so a row's ban depends on its position);
5. ``min_p`` (vLLM), on the probability row after the temperature and top-k
   (:func:`verifiers.sampling.logits_to_probs`): tokens with probability below
   ``min_p * max probability`` are dropped, then top-p.

Before them, a structured-output constraint (``grammar``, :mod:`verifiers.grammar`) sets every
token its grammar disallows after the row's generated tokens to ``-inf``.

``-inf`` stays ``-inf`` (a token the model rules out stays out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifiers.grammar import GrammarConstraint, mask_logits
from verifiers.sampling import logits_to_probs


@dataclass(frozen=True)
class Penalties:
    """The request's row transforms (every maker of rows applies them); the default changes nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # rows with fewer generated tokens before them cannot be an id of eos_ids
    eos_ids: tuple[int, ...] = ()  # the ids min_tokens bans (the deployment's end-of-sequence ids)
    min_p: float = 0.0  # drop tokens below min_p * the row's largest probability (0 disables it)
    grammar: GrammarConstraint | None = None  # structured outputs: the mask applied first

    @property
    def active(self) -> bool:
        """Whether the logits change (then every row needs its generated context)."""
        return (self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0 or bool(self.logit_bias)
                or self.bans_eos or self.grammar is not None)

    @property
    def bans_eos(self) -> bool:
        return self.min_tokens > 0 and bool(self.eos_ids)


NO_PENALTIES = Penalties()


def penalize(
    logits: torch.Tensor, penalties: Penalties, prompt: Sequence[int], generated: Sequence[Sequence[int]],
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``logits [N, V]`` (row ``i`` after ``prompt + generated[i]``) -> penalized logits ``[N, V]``
    in ``dtype`` (a copy). Ids at or past ``V`` (outside the shared vocabulary) are ignored."""
    logits = logits.to(dtype).clone()  # [N, V]
    vocab = logits.shape[-1]
    if len(generated) != logits.shape[0]:
        raise ValueError(f"{len(generated)} generated contexts for {logits.shape[0]} rows")
    if penalties.grammar is not None:
        mask_logits(logits, penalties.grammar, generated)
    if penalties.repetition != 1.0 or penalties.frequency or penalties.presence:
        logits = _count_penalties(logits, penalties, prompt, generated)
    for token, bias in penalties.logit_bias:
        if 0 <= token < vocab:
            logits[:, token] += bias
    if penalties.bans_eos:
        _ban_eos_before_min_tokens(logits, penalties, generated)
    return logits


def _count_penalties(logits: torch.Tensor, penalties: Penalties, prompt: Sequence[int],
                     generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """Repetition, frequency and presence on ``logits [N, V]`` (steps 1 and 2 of the module docstring)."""
    vocab, dtype = logits.shape[-1], logits.dtype
    counts = _row_counts(generated, vocab, dtype)  # [N, V]
    if penalties.repetition != 1.0:
        seen = (counts > 0) | (_row_counts([prompt], vocab, dtype) > 0)  # [N, V]
        repeated = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
        logits = torch.where(seen, repeated, logits)
    if penalties.frequency or penalties.presence:
        logits -= penalties.frequency * counts + penalties.presence * (counts > 0).to(dtype)
    return logits


def _ban_eos_before_min_tokens(logits: torch.Tensor, penalties: Penalties, generated: Sequence[Sequence[int]]) -> None:
    """``logits [N, V]`` in place: ``-inf`` at the EOS ids of every row with fewer than
    ``min_tokens`` generated tokens before it."""
    vocab = logits.shape[-1]
    eos = [token for token in penalties.eos_ids if 0 <= token < vocab]
    early = torch.tensor([len(tokens) < penalties.min_tokens for tokens in generated], dtype=torch.bool)  # [N]
    if not eos or not bool(early.any()):
        return
    banned = torch.zeros(vocab, dtype=torch.bool)  # [V]
    banned[eos] = True
    logits.masked_fill_(early[:, None] & banned[None, :], float("-inf"))


def penalized_probs(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    penalties: Penalties = NO_PENALTIES,
    prompt: Sequence[int] = (),
    generated: Sequence[Sequence[int]] | None = None,
    dtype: torch.dtype = torch.float64,
    overwrite: bool = False,
    checked: bool = False,
) -> torch.Tensor:
    """``logits [..., V]`` -> the rows sampled from, in ``dtype``: penalties (when active;
    ``generated`` holds one context per row of the flattened leading dimensions), then
    :func:`verifiers.sampling.logits_to_probs` (with the penalties' ``min_p``; ``overwrite``: the
    logits are the caller's scratch, as there; ``checked``: the caller checked the logits
    (:func:`verifiers.sampling.check_logits`), which penalties, when active, are checked after)."""
    if penalties.active:
        shape = logits.shape
        if generated is None:
            raise ValueError("penalties need the generated context of every row")
        logits = penalize(logits.reshape(-1, shape[-1]), penalties, prompt, generated, dtype).reshape(shape)
        overwrite, checked = True, False  # the penalized logits are a copy of this call's own
    return logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=penalties.min_p, dtype=dtype,
                           overwrite=overwrite, checked=checked)


def _row_counts(contexts: Sequence[Sequence[int]], vocab: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Occurrences of each id ``< vocab`` in each context -> ``[N, V]`` in ``dtype`` (one scatter
    for all rows)."""
    lengths = torch.tensor([len(tokens) for tokens in contexts], dtype=torch.int64)  # [N]
    ids = torch.tensor([token for tokens in contexts for token in tokens], dtype=torch.int64)  # [sum]
    rows = torch.repeat_interleave(torch.arange(len(contexts)), lengths)  # [sum]
    keep = (ids >= 0) & (ids < vocab)  # [sum]
    counts = torch.zeros(len(contexts), vocab, dtype=dtype)  # [N, V]
    counts.index_put_((rows[keep], ids[keep]), torch.ones(int(keep.sum()), dtype=dtype), accumulate=True)
    return counts
