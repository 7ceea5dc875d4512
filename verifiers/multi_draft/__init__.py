"""Multi-draft verification rules: SpecTr K-SEQ, SpecTr-GBV, and sequential greedy block
verification.

Vocabulary: see :mod:`verifiers.types` (draft / accepted / recovered / bonus tokens). Papers:
Lin et al., "SpecTr-GBV: Multi-Draft Block Verification Accelerating Speculative Decoding"
(arXiv:2604.25925), cited below as SpecTr-GBV; Sun et al., "SpecTr: Fast Speculative Decoding via
Optimal Transport" (arXiv:2310.15141); Sun et al., "Block Verification Accelerates Speculative
Decoding" (arXiv:2403.10444), cited as Block Verification. SpecTr-GBV writes ``p`` for the draft
and ``q`` for the target; here they are always ``draft_probs`` / ``target_probs``.

Every rule has one signature, batched over a leading batch dim ``B``, with ``K`` i.i.d. drafts
of ``gamma`` tokens per batch row::

    verify_X(draft_tokens   [B, K, gamma]        int64,
             draft_probs    [B, K, gamma, V]     rows draft k's tokens were sampled from,
             target_probs   [B, K, gamma+1, V]   target rows after each prefix of draft k,
             *, generator, state=None) -> VerifyResult

``draft_probs[b, k, i]`` is the draft's law of ``draft_tokens[b, k, i]`` given the context plus
``draft_tokens[b, k, :i]``; ``target_probs[b, k, i]`` is the target's law at the same context
and ``target_probs[b, k, gamma]`` the target's law after all of draft k (bonus row). Drafts
that share a prefix share those rows (same context). The result carries ``tokens [B, gamma+1]``,
``num_accepted [B]`` and ``draft_index [B]``: a draft whose first ``num_accepted`` tokens are
the accepted prefix (the one whose cache the caller keeps).

The rules:

* :func:`~verifiers.multi_draft.spectr.verify_spectr` -- SpecTr K-SEQ (SpecTr-GBV Sec. 3.2; SpecTr) applied position by
  position: the candidates at position ``i`` are the drafts whose first ``i`` tokens equal the
  accepted prefix; their tokens at ``i`` are i.i.d. draft samples given that prefix, and K-SEQ
  selects one of them or rejects all. Lossless; stateless.
* :func:`~verifiers.multi_draft.spectr_gbv.verify_spectr_gbv` -- SpecTr-GBV exactly as published (SpecTr-GBV Alg. 1 + Eq. (2)-(4),
  distribution modification Alg. 2, loop Alg. 3). **Experimental: not lossless for K >= 2**
  (exact enumeration finds counterexamples, see ``docs/multi-draft.md``); for K = 1 it is
  greedy block verification and is lossless. Stateful.
* :func:`~verifiers.multi_draft.sequential_gbv.verify_sequential_gbv` -- the lossless multi-draft variant derived in
  ``docs/multi-draft.md``: greedy block verification (Block Verification, App. C, Alg. 4) of draft 1
  against the target, then of every later draft that still carries the accepted prefix against
  the law that greedy block verification leaves behind (its residual plus distribution
  modification, Alg. 5), and so on. For K = 1 it is greedy block verification. Stateful.

State of the stateful rules: a tuple with one :class:`GreedyModificationState` (or None) per
batch row (:mod:`verifiers.multi_draft.modification`). A greedy rule emits ``tau`` accepted tokens plus one token drawn from a residual and
promises that the *next* tokens follow a modified target law (Alg. 5 of Block Verification / Alg. 2 of SpecTr-GBV),
not the raw target. That promise is the state: a stack of :class:`ModificationLevel` s, each
"rows at these positions are ``norm(L(path, x) * relu(1 - draft(path, x)/L(path, x))^power)``
where ``L`` is the law below this level and ``path`` starts where the level's block started".
The verifier applies the stack to the next call's raw ``target_probs`` along each draft's own
tokens (using the next call's ``draft_probs``); the caller only passes the value back.

All arithmetic is float64, products of ratios are formed in log space, no epsilon is added
anywhere; every random choice goes through the :class:`~verifiers.randomness.RandomSource`
(``generator`` may be a ``torch.Generator``), so :func:`verifiers.reference.exact.exact_law` enumerates
these very functions. Inputs are never modified.

Modules: :mod:`~verifiers.multi_draft.block` (validated inputs, the result, the row arithmetic
every rule shares), one module per rule (:mod:`~verifiers.multi_draft.spectr`,
:mod:`~verifiers.multi_draft.sequential_gbv`, :mod:`~verifiers.multi_draft.spectr_gbv`), and
:mod:`~verifiers.multi_draft.modification` (the greedy rules' state).
"""

from __future__ import annotations

#: Registered multi-draft methods that are known not to be lossless in general.
EXPERIMENTAL_METHODS = frozenset({"spectr_gbv"})
