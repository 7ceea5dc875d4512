"""Reference ensemble loops: the standard ensemble and the speculative ensemble (SE).

Paper: Fu et al., "Speculative Ensemble" (2025), paper file 001: Sec. 3.2 (verification against
the ensemble law), Sec. 3.3 + App. B.1 Alg. 1 (alternate proposal framework), Sec. 3.4 + App.
B.2 Alg. 2 (n models). Slow and obviously correct: every row is recomputed from the full
context (no caches). The distributed coordinator must reproduce :func:`ensemble_generate`
token for token (same seed, same streams, same calls in the same order) and the tests prove
its law exact by enumeration.

Both loops take ``model_fns``: one function per member mapping the full context (prompt
included) as a tuple of token ids to logits ``[V_i]``. The vocabularies are truncated to the
shared one (``V = min_i V_i``, read from each member's logits on the prompt: the prefill every
member does anyway, not counted in ``model_calls``). Rows come from
:mod:`verifiers.ensemble`: member rows ``member_probs`` and ensemble rows ``EnsembleFunction.probs``,
both with the same ``temperature`` / ``top_k`` / ``top_p``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from verifiers.ensemble import (
    SEGMENT_METHODS,
    EnsembleFunction,
    EnsembleKind,
    VerifyMethod,
    default_proposer,
    make_ensemble,
    member_probs,
    next_scorer,
    shared_vocab_logits,
    verify_segment,
)
from verifiers.randomness import RandomSource, split_sources
from verifiers.types import PAD_TOKEN

logger = logging.getLogger(__name__)

ModelFn = Callable[[tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: int
    top_p: float


class _Members:
    """Member logits on the shared vocabulary and the rows derived from them."""

    def __init__(self, model_fns: Sequence[ModelFn], prompt: tuple[int, ...], function: EnsembleFunction, sampling: _Sampling):
        self.model_fns = list(model_fns)
        self.function = function
        self.sampling = sampling
        self.vocab = shared_vocab_logits([torch.as_tensor(fn(prompt)) for fn in self.model_fns]).shape[-1]

    def logits(self, member: int, context: tuple[int, ...]) -> torch.Tensor:
        """Member ``member``'s logits ``[V]`` after ``context``, on the shared vocabulary."""
        logits = torch.as_tensor(self.model_fns[member](context)).to(torch.float64)  # [V_member]
        if logits.dim() != 1 or logits.shape[0] < self.vocab:
            raise ValueError(f"member {member} returned logits of shape {tuple(logits.shape)}; expected [>= {self.vocab}]")
        return logits[: self.vocab]

    def proposal_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [..., V]`` of one member -> the rows that member samples from ``[..., V]``."""
        s = self.sampling
        return member_probs(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

    def ensemble_rows(self, member_logits: torch.Tensor) -> torch.Tensor:
        """``member_logits [n, ..., V]`` -> ensemble rows ``[..., V]``."""
        s = self.sampling
        return self.function.probs(member_logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def ensemble_next_token_probs(
    model_fns: Sequence[ModelFn],
    *,
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """The ensemble law as a function of the context: ``context -> row [V]`` (what every
    ensemble loop must reproduce; feed it to :func:`verifiers.exact.sequence_law`)."""
    function = make_ensemble(ensemble, len(model_fns), weights=weights, mu=mu)
    sampling = _Sampling(temperature, top_k, top_p)

    def next_token_probs(context: tuple[int, ...]) -> torch.Tensor:
        member_logits = shared_vocab_logits([torch.as_tensor(fn(tuple(context))) for fn in model_fns])  # [n, V]
        return function.probs(member_logits, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)

    return next_token_probs


def ensemble_autoregressive_generate(
    model_fns: Sequence[ModelFn],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[int], dict]:
    """The standard (non-speculative) ensemble: every member scores every token.

    Returns ``(tokens, stats)``: exactly ``max_new_tokens`` ids and ``stats["model_calls"] =
    [max_new_tokens] * n``.

    Random-stream contract: ``sources = split_sources(generator, n + 1)`` (the SE layout of
    ``verifiers.randomness.stream_seeds``); every token is ONE ``sources[n].categorical(row)``
    with ``row [V]`` the ensemble row after the current context. Streams 0..n-1 are unused.
    """
    _check_count(max_new_tokens)
    function = make_ensemble(ensemble, len(model_fns), weights=weights, mu=mu)
    context = tuple(int(t) for t in prompt)
    members = _Members(model_fns, context, function, _Sampling(temperature, top_k, top_p))
    sources = split_sources(generator, len(model_fns) + 1)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        member_logits = torch.stack([members.logits(i, context) for i in range(len(model_fns))])  # [n, V]
        row = members.ensemble_rows(member_logits)  # [V]
        token = int(sources[-1].categorical(row))
        generated.append(token)
        context = context + (token,)
    return generated, {"model_calls": [max_new_tokens] * len(model_fns)}


@dataclass
class _Segment:
    """Consecutive queued tokens drawn by one member (its bonus token first, if any)."""

    producer: int
    tokens: list[int]


@dataclass
class _Queue:
    """The unverified tokens (Alg. 2's ``S_c``) and each member's logits for them (``C_i``).

    ``member_logits[i]`` holds member i's logits ``[V]`` for queued positions ``0 ..
    coverage(i) - 1`` (its coverage always ends at a segment boundary)."""

    num_members: int
    segments: list[_Segment] = field(default_factory=list)
    member_logits: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.member_logits = [[] for _ in range(self.num_members)]

    def tokens(self) -> list[int]:
        return [t for segment in self.segments for t in segment.tokens]

    def coverage(self) -> list[int]:
        return [len(rows) for rows in self.member_logits]

    def start_segment(self, member: int) -> None:
        # Invariant of the loop (docs/ensembles.md): a member never holds two segments.
        if any(segment.producer == member for segment in self.segments):
            raise RuntimeError(f"member {member} starts a second queued segment")
        self.segments.append(_Segment(member, []))

    def append(self, member: int, token: int, logits: torch.Tensor) -> None:
        """Queue ``token`` drawn by ``member`` (the last segment's producer) from the row of
        ``logits``."""
        if not self.segments or self.segments[-1].producer != member:
            raise RuntimeError(f"member {member} appends to a segment it did not start")
        self.segments[-1].tokens.append(token)
        self.member_logits[member].append(logits)

    def first_segment_verifiable(self) -> bool:
        return bool(self.segments) and min(self.coverage()) >= len(self.segments[0].tokens)

    def pop_first(self) -> None:
        length = len(self.segments.pop(0).tokens)
        self.member_logits = [rows[length:] for rows in self.member_logits]

    def clear(self) -> None:
        self.segments = []
        self.member_logits = [[] for _ in range(self.num_members)]


def ensemble_generate(
    model_fns: Sequence[ModelFn],
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    gammas: Sequence[int],
    ensemble: EnsembleKind = "weighted",
    weights: Sequence[float] | None = None,
    mu: float = 0.1,
    method: VerifyMethod = "token",
    temperature: float = 1.0,
    generator: torch.Generator | RandomSource,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[int], dict]:
    """Speculative ensemble (paper 001): lossless sampling from the ensemble law.

    ``gammas[i]`` is member i's proposal length (>= 1). ``ensemble``: "weighted" (``weights``,
    default uniform) or "contrastive" (two members: ``model_fns[0]`` expert, ``model_fns[1]``
    amateur, strength ``mu``). ``method``: "token" or "block" verification of each segment
    against the ensemble rows (:func:`verifiers.ensemble.verify_segment`).

    Returns ``(tokens, stats)``: exactly ``max_new_tokens`` generated ids and a dict with
    ``model_calls`` (per member: one per scoring call, one per proposed token; a bonus token
    comes with its scoring call), ``accepted`` (accepted tokens per verification),
    ``segment_lengths`` (length of each verified segment), ``proposers`` (the member whose
    segment each verification checked) and ``verifications``.

    The loop (Alg. 2 with n members; n = 2 is Alg. 1's alternate proposal framework). State:
    the committed context, and a queue of unverified segments, each drawn by one member; every
    member holds rows for a prefix of the queue (its *coverage*). ``d`` = the default proposer
    = the member with the largest gamma, the first on ties. ``room`` = ``max_new_tokens`` -
    committed - queued: no token is ever drawn past the requested length.

    1. Queue empty (start, or after a rejection): member ``d`` PROPOSES ``min(gamma_d, room)``
       tokens one at a time; each step computes its row after context + queued tokens and draws
       the token with ONE ``sources[d].categorical(row)`` (``row [V]``). One call per token.
    2. Otherwise member ``i`` = the member with the smallest coverage (the first on ties; it is
       always a member with coverage 0, i.e. none of whose rows is queued) SCORES: one call
       computing its rows at every queued position plus the row after the queue. If ``room >=
       1`` it then draws its bonus token from that last row with ONE ``sources[i].categorical``
       and PROPOSES ``min(gamma_i, room) - 1`` more tokens as in step 1 with ``sources[i]``
       (one call each); the bonus plus these are member i's segment.
    3. While every member covers the first segment: VERIFY it with ONE call
       ``verify_segment(tokens [1, g], proposal_probs [1, g, V], ensemble_probs [1, g, V],
       next_tokens [1], method=method, generator=sources[n])``: proposal rows are the
       producer's own rows, ensemble rows combine every member's rows at those positions,
       ``next_tokens`` is the head of the second segment (PAD_TOKEN if none). Fully accepted:
       commit the g tokens and drop the segment and everyone's rows for it (the member that
       drew it now covers nothing and scores next). Otherwise commit the accepted prefix and
       the correction token and clear the queue and every member's rows.
    4. Repeat until ``max_new_tokens`` tokens are committed.

    Random-stream contract: ``sources = split_sources(generator, n + 1)``; member i's draws
    (proposals and bonus tokens, in the order above) use ``sources[i]``; every verification uses
    ``sources[n]`` through :func:`verify_segment` (the registry verifier's own draw order).

    Deviation from Alg. 2 as printed: after a rejection the printed pseudocode lets the scoring
    member propose ``gamma_i - 1`` tokens; the text (Sec. 3.4 / App. B.2, step 6) and this loop
    restart from the default proposer. Both are exact; see docs/ensembles.md.
    """
    _check_count(max_new_tokens)
    num_members = len(model_fns)
    gammas = _checked_gammas(gammas, num_members)
    if method not in SEGMENT_METHODS:
        raise ValueError(f"method must be one of {list(SEGMENT_METHODS)}, got {method!r}")
    function = make_ensemble(ensemble, num_members, weights=weights, mu=mu)
    prompt = tuple(int(t) for t in prompt)
    members = _Members(model_fns, prompt, function, _Sampling(temperature, top_k, top_p))
    sources = split_sources(generator, num_members + 1)
    proposer = default_proposer(gammas)

    generated: list[int] = []
    queue = _Queue(num_members)
    stats: dict = {
        "model_calls": [0] * num_members,
        "accepted": [],
        "segment_lengths": [],
        "proposers": [],
        "verifications": 0,
    }
    while len(generated) < max_new_tokens:
        room = max_new_tokens - len(generated) - len(queue.tokens())
        if not queue.segments:
            queue.start_segment(proposer)
            _propose(members, queue, prompt + tuple(generated), proposer, min(gammas[proposer], room), sources, stats)
        else:
            scorer = next_scorer(queue.coverage())
            _score(members, queue, prompt + tuple(generated), scorer, gammas[scorer], room, sources, stats)
        while queue.first_segment_verifiable():
            generated.extend(_verify_first_segment(members, queue, method, sources[-1], stats))
    logger.debug("ensemble_generate(%s, %s): %s", ensemble, method, stats)
    return generated, stats


def _propose(
    members: _Members,
    queue: _Queue,
    context: tuple[int, ...],
    member: int,
    count: int,
    sources: list[RandomSource],
    stats: dict,
) -> None:
    """Member ``member`` extends its (last) segment by ``count`` tokens drawn after context +
    queue, one call each."""
    for _ in range(count):
        logits = members.logits(member, context + tuple(queue.tokens()))  # [V]
        token = int(sources[member].categorical(members.proposal_rows(logits)))
        queue.append(member, token, logits)
        stats["model_calls"][member] += 1


def _score(
    members: _Members,
    queue: _Queue,
    context: tuple[int, ...],
    member: int,
    gamma: int,
    room: int,
    sources: list[RandomSource],
    stats: dict,
) -> None:
    """One scoring call of ``member`` over the queue (+ the row after it), then its bonus token
    and ``min(gamma, room) - 1`` proposals when there is room."""
    queued = queue.tokens()
    if queue.member_logits[member]:
        raise RuntimeError(f"member {member} scores while already covering queued positions")
    for position in range(len(queued)):
        queue.member_logits[member].append(members.logits(member, context + tuple(queued[:position])))
    stats["model_calls"][member] += 1
    if room < 1:
        return
    bonus_logits = members.logits(member, context + tuple(queued))  # [V], same scoring call
    bonus = int(sources[member].categorical(members.proposal_rows(bonus_logits)))
    queue.start_segment(member)
    queue.append(member, bonus, bonus_logits)
    _propose(members, queue, context, member, min(gamma, room) - 1, sources, stats)


def _verify_first_segment(
    members: _Members, queue: _Queue, method: VerifyMethod, verify_source: RandomSource, stats: dict
) -> list[int]:
    """Verify the oldest segment against the ensemble rows; update the queue; return the
    committed tokens."""
    segment = queue.segments[0]
    length = len(segment.tokens)
    member_logits = torch.stack([torch.stack(rows[:length]) for rows in queue.member_logits])  # [n, g, V]
    proposal_probs = members.proposal_rows(member_logits[segment.producer])  # [g, V]
    ensemble_probs = members.ensemble_rows(member_logits)  # [g, V]
    next_token = queue.segments[1].tokens[0] if len(queue.segments) > 1 else PAD_TOKEN
    verdict = verify_segment(
        torch.tensor([segment.tokens], dtype=torch.int64),  # [1, g]
        proposal_probs.unsqueeze(0),  # [1, g, V]
        ensemble_probs.unsqueeze(0),  # [1, g, V]
        torch.tensor([next_token], dtype=torch.int64),  # [1]
        method=method,
        generator=verify_source,
    )
    stats["accepted"].append(int(verdict.num_accepted[0]))
    stats["segment_lengths"].append(length)
    stats["proposers"].append(segment.producer)
    stats["verifications"] += 1
    if bool(verdict.fully_accepted[0]):
        queue.pop_first()
    else:
        queue.clear()
    return verdict.emitted(0)


def _check_count(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")


def _checked_gammas(gammas: Sequence[int], num_members: int) -> tuple[int, ...]:
    gammas = tuple(gammas)
    if len(gammas) != num_members:
        raise ValueError(f"expected {num_members} gammas (one per member), got {len(gammas)}: {list(gammas)}")
    for gamma in gammas:
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ValueError(f"every gamma must be an int >= 1, got {list(gammas)}")
    return gammas
