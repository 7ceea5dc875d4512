"""Decode first: the prefill chunks of a step sized from measured step costs.

A step that carries a long prompt's prefill chunk next to the rows of running requests takes
longer than a step of those rows alone, and every running stream's chunk waits for it. The
static budget (``engine.max_tokens_per_step``) bounds a chunk in tokens, whatever a token costs
on this model and device; :class:`PrefillPacer` bounds it in time: while other rows run, a step's
prefill chunks together get the tokens that add about :data:`PREFILL_STRETCH` of a decode step's
measured time, at the measured seconds per prefill token (at least :data:`MIN_PACED_TOKENS`, so
every prompt moves on). A step with no other rows (nothing to stall) keeps the static budget.

Both figures are learned from this worker's own steps: the recent decode steps' seconds (steps
with other rows and no prefill), and the seconds per prefill token, the extra time of recent steps
that carried prefill over the decode steps' time, divided by the tokens they fed (a ratio over a
window, so one step that ran fast or slow on a busy host moves it little). Chunking leaves the
tokens unchanged (:mod:`actors.worker.engine`), so pacing changes timings only.
"""

from __future__ import annotations

from collections import deque

#: A step carrying prefill chunks may take this much longer than a decode step (a fraction of it).
PREFILL_STRETCH = 0.25

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
        self._prefill: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens fed, extra seconds)

    @property
    def decode_step_s(self) -> float | None:
        """The median of the recent decode steps' seconds; None before any."""
        if not self._decode_s:
            return None
        ordered = sorted(self._decode_s)
        return ordered[len(ordered) // 2]

    @property
    def token_s(self) -> float | None:
        """Seconds one prefill token adds to a step (recent steps that carried prefill); None before any."""
        tokens = sum(fed for fed, _ in self._prefill)
        if not tokens:
            return None
        return sum(extra for _, extra in self._prefill) / tokens

    def allowed(self, other_tokens: int) -> int | None:
        """Prefill tokens a step whose other rows feed ``other_tokens`` may carry; None: no pacing
        (no other rows, or no decode step measured yet)."""
        decode_s = self.decode_step_s
        if other_tokens <= 0 or decode_s is None:
            return None
        token_s = self.token_s
        if token_s is None:
            return FIRST_PACED_TOKENS
        if token_s <= 0:  # prefill measured free (a noisy host): twice the largest recent chunk
            return 2 * max(fed for fed, _ in self._prefill)
        return max(MIN_PACED_TOKENS, int(self.stretch * decode_s / token_s))

    def observe(self, step_s: float, prefill_tokens: int, other_tokens: int) -> None:
        """A step of ``step_s`` seconds fed ``prefill_tokens`` prefill tokens next to other rows of
        ``other_tokens`` tokens (steps without other rows teach nothing)."""
        if other_tokens <= 0:
            return
        if prefill_tokens <= 0:
            self._decode_s.append(step_s)
            return
        decode_s = self.decode_step_s
        if decode_s is not None:
            self._prefill.append((prefill_tokens, max(0.0, step_s - decode_s)))


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
