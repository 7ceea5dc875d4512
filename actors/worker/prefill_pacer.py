"""Decode first: the prefill chunks of a step sized from measured step costs.

A step that carries a long prompt's prefill chunk next to the rows of running requests takes
longer than a step of those rows alone, and every running stream's chunk waits for it. The
static budget (``engine.max_tokens_per_step``) bounds a chunk in tokens, whatever a token costs
on this model and device; :class:`PrefillPacer` bounds it in time: while other rows run, a step's
prefill chunks together get the tokens that add about :data:`PREFILL_STRETCH` of a decode step's
time (at least :data:`MIN_PACED_TOKENS`, so every prompt moves on). A step with no other rows
(nothing to stall) keeps the static budget.

What a prefill token costs is learned from this worker's own steps, in decode steps: each step
that carries chunks measures its prefill forwards' seconds per token against its own time outside
them (the decode rows' share), so a host or device that slows down or speeds up moves both alike,
and the streams' steps, which grow with their context, are followed as they grow. The cost grows
with the context the chunk attends to (on the embedded target a token at context 650 costs ~1.4x
one at context 0), so it is a line through the recent chunks' (mid-context, cost), its slope the
median of the pairwise slopes (Theil-Sen: the one step a busy host stretched moves it little),
read at the next chunk's own mid-context. With a forward's fixed cost ``a`` and ``b`` a token,
chunks of ``n`` tokens measure ``a / n + b`` a token, so the chunk that follows is ``stretch *
decode / (a / n + b)``: this converges to the ``n`` with ``a + b n = stretch * decode`` (a forward
the stretch affords) whenever ``a`` is below it. A prompt's chunks are evened out
(:func:`paced`): no small last chunk whose fixed cost skews the line. Chunking leaves the tokens
unchanged (:mod:`actors.worker.engine`), so pacing changes timings only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

#: A step carrying prefill chunks may take this much longer than a decode step (a fraction of it),
#: so running streams' gaps stay within 1.5x. It is less than 0.5: the decode rows beside a chunk
#: run ~10% slower (the chunk's forward evicts their caches), and a shared host moves single steps,
#: so a chunk step paced to 0.5 came out 1.4x its neighbours at the median and 1.7x at worst, one
#: paced to 0.35 1.3x and 1.5x (long_prompt_itl, embedded target). The price: smaller chunks, a long
#: prompt's first token later (a quarter fed 828-token prompts in ~30-token chunks, slower than
#: prompts 1.5 s apart arrived: they queued for seconds).
PREFILL_STRETCH = 0.35

#: The least tokens a paced step feeds of the prompts in line (the first prompt's chunk).
MIN_PACED_TOKENS = 16

#: Tokens the first paced chunk feeds, before any prefill step was measured.
FIRST_PACED_TOKENS = 64

#: Recent steps each estimate reads.
WINDOW = 8


#: Recent prefill chunks the token cost line is fitted to.
CHUNK_WINDOW = 16

#: A step that carried chunks teaches their cost when its other rows took at least this share of
#: a decode step (a step giving a newcomer its first token draws fewer tokens: no measure of one).
MIN_DECODE_SHARE = 0.5

#: Chunks whose mid-contexts differ by less than this give no slope (their difference is noise).
MIN_CONTEXT_SPREAD = 32


class PrefillPacer:
    """The prefill tokens a step may feed while other rows run (:meth:`allowed`), learned from the
    steps run (:meth:`observe`)."""

    def __init__(self, stretch: float = PREFILL_STRETCH):
        if stretch <= 0:
            raise ValueError(f"stretch must be > 0, got {stretch}")
        self.stretch = float(stretch)
        self._decode_s: deque[float] = deque(maxlen=WINDOW)  # seconds of recent steps outside prefill forwards
        self._chunks: deque[tuple[float, float]] = deque(maxlen=CHUNK_WINDOW)  # (mid-context, decode steps a token)

    @property
    def decode_step_s(self) -> float | None:
        """The median of the recent steps' seconds outside prefill forwards; None before any."""
        return _median(self._decode_s)

    def token_cost_at(self, mid_context: float) -> float | None:
        """What a prefill token costs, in decode steps, in a chunk whose tokens attend to
        ``mid_context`` earlier positions on average (the context before it plus half its own
        tokens): the line through the recent chunks (:func:`theil_sen`); None before any chunk."""
        line = theil_sen(self._chunks)
        return None if line is None else _cost_on(line, mid_context)

    def allowed(self, other_tokens: int, context: int = 0) -> int | None:
        """Prefill tokens a step whose other rows feed ``other_tokens`` may carry, the first chunk
        in line following ``context`` prompt tokens already fed; None: no pacing (no other rows,
        or no decode step measured yet)."""
        if other_tokens <= 0 or self.decode_step_s is None:
            return None
        line = theil_sen(self._chunks)  # fitted once, read at each round's mid-context
        if line is None:
            return FIRST_PACED_TOKENS
        tokens = self.stretch / _cost_on(line, context)
        for _ in range(3):  # the chunk's own tokens add to its mid-context: a few fixed-point rounds
            tokens = self.stretch / _cost_on(line, context + tokens / 2)
        return max(MIN_PACED_TOKENS, int(tokens))

    def observe(self, step_s: float, other_tokens: int, prefill_tokens: int = 0, prefill_s: float = 0.0,
                prefill_context: float = 0.0) -> None:
        """A step of ``step_s`` seconds whose other rows fed ``other_tokens`` tokens, and whose
        forwards that carried ``prefill_tokens`` prefill tokens (at mid-context ``prefill_context``,
        token-weighted) took ``prefill_s`` seconds. Steps without other rows teach nothing (nothing
        waited); a chunk's cost is learned against a step whose other rows took at least
        :data:`MIN_DECODE_SHARE` of a decode step (not a newcomer's short first step)."""
        decode_s = step_s - prefill_s
        if other_tokens <= 0 or decode_s <= 0:
            return
        typical = self.decode_step_s
        self._decode_s.append(decode_s)
        if prefill_tokens > 0 and decode_s >= MIN_DECODE_SHARE * (typical or decode_s):
            self._chunks.append((float(prefill_context), prefill_s / prefill_tokens / decode_s))


def _cost_on(line: tuple[float, float], mid_context: float) -> float:
    """The (intercept, slope) ``line`` read at ``mid_context``, above 0."""
    intercept, slope = line
    return max(intercept + slope * mid_context, 1e-9)


def theil_sen(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the line through ``points`` ((x, y) each): the slope the median of
    the slopes between points at least :data:`MIN_CONTEXT_SPREAD` apart in x (0 without such
    pairs; never below 0: attention does not get cheaper with context), the intercept the median
    of ``y - slope x``; None without points. One outlying point moves neither much."""
    points = list(points)
    if not points:
        return None
    slopes = [max(0.0, (y2 - y1) / (x2 - x1)) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:]
              if abs(x2 - x1) >= MIN_CONTEXT_SPREAD]
    slope = _median(slopes) or 0.0
    return _median([y - slope * x for x, y in points]), slope


def _median(values: Collection[float]) -> float | None:
    """The median (the upper one of an even count) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def paced(grants: list[int], allowed: int | None, remaining: list[int] | None = None) -> list[int]:
    """``grants`` (each prompt's chunk, in line order) cut so that together they feed at most
    ``allowed`` tokens, first come first served; a prompt after the first gets nothing from a
    leftover below :data:`MIN_PACED_TOKENS` (a few tokens cost a forward's fixed cost, or pad the
    decode rows' forward); None: unchanged. With ``remaining`` (the tokens each prompt has left to
    feed), a prompt cut short gets an even share of what it has left over the chunks it still
    needs, so its last chunk is no small remainder."""
    if allowed is None:
        return list(grants)
    out = []
    for index, grant in enumerate(grants):
        grant = min(grant, allowed) if index == 0 or allowed >= MIN_PACED_TOKENS else 0
        if remaining is not None and 0 < grant < remaining[index]:
            chunks = -(-remaining[index] // grant)  # the chunks it needs at this size
            grant = -(-remaining[index] // chunks)
        out.append(grant)
        allowed = max(0, allowed - grant)
    return out
