"""Test oracles: the executable specification the serving code is proven against.

No serving module imports this package. It holds the reference decode loops (:mod:`.loops`,
:mod:`.ensemble`: slow and obviously correct, every row recomputed from the full context), the
local executor that runs the state machines of :mod:`verifiers.machines` on model functions
(:mod:`.executor`), and the exact law of a decode loop by enumeration of every random branch
(:mod:`.exact`).
"""

from verifiers.reference.ensemble import ensemble_generate
from verifiers.reference.loops import autoregressive_generate, speculative_generate

__all__ = ["autoregressive_generate", "ensemble_generate", "speculative_generate"]
