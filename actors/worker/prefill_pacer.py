"""Decode first: the prefill chunks of a step sized from measured step costs.

A step that carries a long prompt's prefill chunk next to the rows of running requests takes
longer than a step of those rows alone, and every running stream's chunk waits for it. The
static budget (``engine.max_tokens_per_step``) bounds a chunk in tokens, whatever a token costs
on this model and device; :class:`PrefillPacer` bounds it in time: while other rows run, a step's
prefill chunks together get the tokens that add about :data:`PREFILL_STRETCH` of a decode step's
measured time, at the measured seconds per prefill token (at least :data:`MIN_PACED_TOKENS`, so
every prompt moves on). A step with no other rows (nothing to stall) keeps the static budget.

Both figures are learned from this worker's own steps, each the median of a recent window (one
step that ran fast or slow on a busy host moves it little): the decode steps' seconds (steps with
other rows and no prefill), and the seconds per prefill token, the seconds of the forwards that
carried prefill chunks divided by the chunks' tokens. With a forward's fixed cost ``a`` and ``b``
a token, chunks of ``n`` tokens measure ``a / n + b`` a token, so the chunk that follows is
``stretch * decode / (a / n + b)``: this converges to the ``n`` with ``a + b n = stretch * decode``
(a forward the stretch affords) whenever ``a`` is below it. Chunking leaves the tokens unchanged
(:mod:`actors.worker.engine`), so pacing changes timings only.
"""

from __future__ import annotations

from collections import deque

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


class PrefillPacer:
    """The prefill tokens a step may feed while other rows run (:meth:`allowed`), learned from the
    steps run (:meth:`observe`)."""

    def __init__(self, stretch: float = PREFILL_STRETCH):
        if stretch <= 0:
            raise ValueError(f"stretch must be > 0, got {stretch}")
        self.stretch = float(stretch)
        self._decode_s: deque[float] = deque(maxlen=WINDOW)  # seconds of recent decode-only steps
        self._token_s: deque[float] = deque(maxlen=WINDOW)  # recent prefill forwards' seconds per chunk token

    @property
    def decode_step_s(self) -> float | None:
        """The median of the recent decode steps' seconds; None before any."""
        return _median(self._decode_s)

    @property
    def token_s(self) -> float | None:
        """The median of the recent prefill forwards' seconds per chunk token; None before any."""
        return _median(self._token_s)

    def allowed(self, other_tokens: int) -> int | None:
        """Prefill tokens a step whose other rows feed ``other_tokens`` may carry; None: no pacing
        (no other rows, or no decode step measured yet)."""
        decode_s = self.decode_step_s
        if other_tokens <= 0 or decode_s is None:
            return None
        token_s = self.token_s
        if token_s is None:
            return FIRST_PACED_TOKENS
        return max(MIN_PACED_TOKENS, int(self.stretch * decode_s / max(token_s, 1e-9)))

    def observe(self, step_s: float, other_tokens: int, prefill_tokens: int = 0, prefill_s: float = 0.0) -> None:
        """A step of ``step_s`` seconds whose other rows fed ``other_tokens`` tokens, and whose
        forwards that carried ``prefill_tokens`` prefill tokens took ``prefill_s`` seconds (steps
        without other rows teach nothing: nothing waited)."""
        if other_tokens <= 0:
            return
        if prefill_tokens <= 0:
            self._decode_s.append(step_s)
        else:
            self._token_s.append(prefill_s / prefill_tokens)


def _median(values: deque[float]) -> float | None:
    """The median (the upper one of an even count) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def paced(grants: list[int], allowed: int | None) -> list[int]:
    """``grants`` (each prompt's chunk, in line order) cut so that together they feed at most
    ``allowed`` tokens, first come first served; None: unchanged."""
    if allowed is None:
        return list(grants)
    out = []
    for grant in grants:
        out.append(min(grant, allowed))
        allowed = max(0, allowed - out[-1])
    return out
