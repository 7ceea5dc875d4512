"""Pure-math core of specserve (torch only): sampling, verification rules, reference loops.

* :mod:`verifiers.sampling` -- ``logits_to_probs`` / ``sample_token``, the one sampling path;
* :mod:`verifiers.single_draft` -- token, block and greedy block verification;
* :mod:`verifiers.registry` -- ``get_verifier(name) -> VerifierSpec``;
* :mod:`verifiers.reference` -- ``speculative_generate`` and friends, the executable spec;
* :mod:`verifiers.randomness` / :mod:`verifiers.reference.exact` -- random sources and exact laws.

See docs/verifiers.md.
"""
