"""Decode first: the prefill chunks of a step sized from measured step costs.

A step that carries a long prompt's prefill chunk next to the rows of running requests takes
longer than a step of those rows alone, and every running stream's chunk waits for it. The
static budget (``engine.max_tokens_per_step``) bounds a chunk in tokens, whatever a token costs
on this model and device; :class:`PrefillPacer` bounds it in time: while other rows run, a step's
prefill chunks together get the tokens that add about :data:`PREFILL_STRETCH` of a decode step's
measured time, at the measured seconds per prefill token (at least :data:`MIN_PACED_TOKENS`, so
every prompt moves on). A step with no other rows (nothing to stall) keeps the static budget.

Both figures are learned from this worker's own steps, robust to the one step a busy host
stretched: the decode steps' seconds, the median of a recent window (steps with other rows; those
that carried chunks count their time outside the chunks' forwards, so the figure follows the
streams' growing context while chunks run back to back), and the seconds per prefill token as a
function of the context the chunk attends to (a chunk's attention grows with the prompt fed
before it: on the embedded target a token at context 650 costs ~1.4x one at context 0): a line
through the recent chunks' (mid-context, seconds per token), its slope the median of the pairwise
slopes (Theil-Sen), read at the next chunk's own mid-context. With a forward's fixed cost ``a``
and ``b`` a token, chunks of ``n`` tokens measure ``a / n + b`` a token, so the chunk that follows
is ``stretch * decode / (a / n + b)``: this converges to the ``n`` with ``a + b n = stretch *
decode`` (a forward the stretch affords) whenever ``a`` is below it. A prompt's chunks are evened
out (:func:`paced`): no small last chunk whose fixed cost skews the line. Chunking leaves the
tokens unchanged (:mod:`actors.worker.engine`), so pacing changes timings only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable

#: A step carrying prefill chunks may take this much longer than a decode step (a fraction of it):
#: running streams' gaps within 1.5x. A quarter fed 828-token prompts on the embedded target in
#: ~30-token chunks, slower than prompts 1.5 s apart arrived: they queued for seconds.
PREFILL_STRETCH = 0.5

#: The least tokens a paced step feeds of the prompts in line (the first prompt's chunk).
MIN_PACED_TOKENS = 16

#: Tokens the first paced chunk feeds, before any prefill step was measured.
FIRST_PACED_TOKENS = 64

#: Recent steps each estimate reads.
WINDOW = 8


#: Recent prefill chunks the token cost line is fitted to.
CHUNK_WINDOW = 16

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
        self._chunks: deque[tuple[float, float]] = deque(maxlen=CHUNK_WINDOW)  # (mid-context, seconds per token)

    @property
    def decode_step_s(self) -> float | None:
        """The median of the recent decode steps' seconds; None before any."""
        return _median(self._decode_s)

    @property
    def token_s(self) -> float | None:
        """The seconds per prefill token of a chunk at context 0 (:meth:`token_s_at`); None before any."""
        return self.token_s_at(0.0)

    def token_s_at(self, mid_context: float) -> float | None:
        """The seconds per token of a prefill chunk whose tokens attend to ``mid_context`` earlier
        positions on average (the context before it plus half its own tokens): the line through
        the recent chunks (:func:`theil_sen`); None before any chunk was measured."""
        line = theil_sen(self._chunks)
        if line is None:
            return None
        intercept, slope = line
        return max(intercept + slope * mid_context, 1e-9)

    def allowed(self, other_tokens: int, context: int = 0) -> int | None:
        """Prefill tokens a step whose other rows feed ``other_tokens`` may carry, the first chunk
        in line following ``context`` prompt tokens already fed; None: no pacing (no other rows,
        or no decode step measured yet)."""
        decode_s = self.decode_step_s
        if other_tokens <= 0 or decode_s is None:
            return None
        if not self._chunks:
            return FIRST_PACED_TOKENS
        budget_s = self.stretch * decode_s
        tokens = budget_s / self.token_s_at(context)
        for _ in range(3):  # the chunk's own tokens add to its mid-context: a few fixed-point rounds
            tokens = budget_s / self.token_s_at(context + tokens / 2)
        return max(MIN_PACED_TOKENS, int(tokens))

    def observe(self, step_s: float, other_tokens: int, prefill_tokens: int = 0, prefill_s: float = 0.0,
                prefill_context: float = 0.0) -> None:
        """A step of ``step_s`` seconds whose other rows fed ``other_tokens`` tokens, and whose
        forwards that carried ``prefill_tokens`` prefill tokens (at mid-context ``prefill_context``,
        token-weighted) took ``prefill_s`` seconds (steps without other rows teach nothing:
        nothing waited)."""
        if other_tokens <= 0:
            return
        if step_s - prefill_s > 0:
            self._decode_s.append(step_s - prefill_s)
        if prefill_tokens > 0:
            self._chunks.append((float(prefill_context), prefill_s / prefill_tokens))


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
    ``allowed`` tokens, first come first served; None: unchanged. With ``remaining`` (the tokens
    each prompt has left to feed), a prompt cut short gets an even share of what it has left
    over the chunks it still needs, so its last chunk is no small remainder."""
    if allowed is None:
        return list(grants)
    out = []
    for index, grant in enumerate(grants):
        grant = min(grant, allowed)
        if remaining is not None and 0 < grant < remaining[index]:
            chunks = -(-remaining[index] // grant)  # the chunks it needs at this size
            grant = -(-remaining[index] // chunks)
        out.append(grant)
        allowed = max(0, allowed - grant)
    return out
