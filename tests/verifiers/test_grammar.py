"""Structured outputs keep every strategy exact: the law is the masked target (or ensemble) law.

Exact enumeration (float64, TV < 1e-9) on tiny context-dependent models whose tokens are byte
strings the grammar engine reads (``a``, ``b``, ``c`` / ``[``, ``]``, ``1``, ``,``, and an
end-of-sequence). The expected law is built from an independent oracle (the constraint's
language written out, or valid JSON checked by ``json`` and the schema's rules), not from the
engine. Controls that must fail: the verifier given the draft's unmasked row while the draft
sampled from its masked row, and a matcher that is not rolled back after a rejection. Masking
only the target (the drafts unmasked) stays exact: any proposal law is lossless.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from tests.verifiers.tiny_models import TinyModel, model_pair
from verifiers.reference import executor as executor_module
from verifiers import grammar as grammar_module
from verifiers.reference.exact import exact_law, sequence_law, total_variation
from verifiers.grammar import GrammarError, allowed_tokens, compile_constraint, register_vocabulary
from verifiers.penalties import Penalties, penalized_probs
from verifiers.reference import autoregressive_generate, speculative_generate
from verifiers.reference.ensemble import (
    ensemble_autoregressive_generate,
    ensemble_draft_generate,
    ensemble_generate,
    ensemble_next_token_probs,
)
from verifiers.sampling import logits_to_probs

EXACT_TOLERANCE = 1e-9
PROMPT = (1, 0)

REGEX_TOKENS = (b"a", b"b", b"c", b"\xff[EOS]")
REGEX_EOS = 3
REGEX = "(a|bc)(a|c)?"
REGEX_LANGUAGE = ("a", "bc", "aa", "ac", "bca", "bcc")  # the regex written out

JSON_TOKENS = (b"[", b"]", b"1", b",", b"\xff[EOS]")
JSON_EOS = 4
JSON_SCHEMA = {"type": "array", "items": {"type": "integer"}, "maxItems": 2}

register_vocabulary("tests-regex", REGEX_TOKENS, REGEX_EOS)
register_vocabulary("tests-json", JSON_TOKENS, JSON_EOS)


def _regex_viable(text: str, complete: bool) -> bool:
    return text in REGEX_LANGUAGE if complete else any(word.startswith(text) for word in REGEX_LANGUAGE)


def _json_valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, list) and len(value) <= 2 and text == json.dumps(value, separators=(",", ":"))
            and all(isinstance(item, int) for item in value))


def _json_viable(text: str, complete: bool) -> bool:
    """Complete: valid; else some completion of at most 3 tokens is valid (enough for this schema)."""
    if complete:
        return _json_valid(text)
    pieces = [token.decode() for token in JSON_TOKENS[:JSON_EOS]]
    return any(_json_valid(text + "".join(tail)) for n in range(4) for tail in itertools.product(pieces, repeat=n))


CASES = {
    "regex": ("regex", REGEX, "tests-regex", REGEX_TOKENS, REGEX_EOS, _regex_viable),
    "json": ("json_schema", JSON_SCHEMA, "tests-json", JSON_TOKENS, JSON_EOS, _json_viable),
}


def _constraint(case: str):
    kind, spec, vocabulary, *_ = CASES[case]
    return compile_constraint(kind, spec, vocabulary, request=f"tests-{case}")


def _oracle_allowed(case: str, generated: tuple[int, ...]) -> torch.Tensor:
    """bool ``[V]``: the tokens the language allows after ``generated`` (end-of-sequence where it
    may end; after an end-of-sequence the request has ended and nothing is masked)."""
    _, _, _, tokens, eos, viable = CASES[case]
    if eos in generated:
        return torch.ones(len(tokens), dtype=torch.bool)
    text = "".join(tokens[t].decode() for t in generated)
    return torch.tensor([viable(text, True) if t == eos else viable(text + tokens[t].decode(), False)
                         for t in range(len(tokens))])


def _masked_law(case: str, next_logits, length: int, **sampling):
    """The exact law of ``length`` tokens from the oracle-masked rows of ``next_logits``."""

    def next_token_probs(context):
        logits = torch.as_tensor(next_logits(context)).double()
        logits = logits.masked_fill(~_oracle_allowed(case, tuple(context)[len(PROMPT):]), float("-inf"))
        return logits_to_probs(logits, temperature=sampling.get("temperature", 1.0), top_k=sampling.get("top_k", 0),
                               top_p=sampling.get("top_p", 1.0))

    return sequence_law(next_token_probs, PROMPT, length)


def _vocab(case: str) -> int:
    return len(CASES[case][3])


@pytest.mark.parametrize("case", ["regex", "json"])
def test_the_engine_mask_equals_the_oracle_on_every_short_context(case):
    constraint = _constraint(case)
    vocab = _vocab(case)
    contexts = [c for n in range(4) for c in itertools.product(range(vocab), repeat=n)
                if all(_oracle_allowed(case, c[:i])[c[i]] for i in range(len(c)))]
    masks = allowed_tokens(constraint, contexts, vocab)  # [N, V], one call: the matcher moves between contexts
    for context, mask in zip(contexts, masks):
        assert mask.tolist() == _oracle_allowed(case, context).tolist(), context


def test_the_mask_really_changes_the_law():
    _, target_fn = model_pair(4, 5)
    plain = sequence_law(lambda c: torch.softmax(torch.as_tensor(target_fn(c)).double(), -1), PROMPT, 3)
    masked = _masked_law("regex", target_fn, 3)
    assert total_variation(plain, masked) > 0.3
    for sequence in masked:  # the text before the first end-of-sequence is in the language (or a prefix of it)
        ended = REGEX_EOS in sequence
        body = sequence[: sequence.index(REGEX_EOS)] if ended else sequence
        assert _regex_viable("".join(REGEX_TOKENS[t].decode() for t in body), ended), sequence


def _speculative_law(case, draft_fn, target_fn, length, *, method, gamma, num_drafts=1, **sampling):
    penalties = Penalties(grammar=_constraint(case))
    return exact_law(lambda source: tuple(speculative_generate(
        draft_fn, target_fn, PROMPT, length, gamma=gamma, method=method, num_drafts=num_drafts,
        generator=source, penalties=penalties, **sampling,
    )[0]))


@pytest.mark.parametrize("case", ["regex", "json"])
def test_autoregressive_samples_the_masked_law(case):
    _, target_fn = model_pair(_vocab(case), 29)
    penalties = Penalties(grammar=_constraint(case))
    law = exact_law(lambda s: tuple(autoregressive_generate(target_fn, PROMPT, 4, generator=s, penalties=penalties)[0]))
    assert total_variation(law, _masked_law(case, target_fn, 4)) < EXACT_TOLERANCE


@pytest.mark.parametrize("case", ["regex", "json"])
@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
def test_single_draft_rules_are_exact_under_a_grammar(case, method):
    draft_fn, target_fn = model_pair(_vocab(case), 3)
    law = _speculative_law(case, draft_fn, target_fn, 3, method=method, gamma=2)
    assert total_variation(law, _masked_law(case, target_fn, 3)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", ["spectr", "sequential_gbv"])
def test_multi_draft_rules_are_exact_under_a_grammar(method):
    draft_fn, target_fn = model_pair(_vocab("regex"), 17)
    law = _speculative_law("regex", draft_fn, target_fn, 2, method=method, gamma=2, num_drafts=2)
    assert total_variation(law, _masked_law("regex", target_fn, 2)) < EXACT_TOLERANCE


def test_exact_with_temperature_top_k_top_p_and_penalties_after_the_mask():
    draft_fn, target_fn = model_pair(_vocab("json"), 23)
    sampling = {"temperature": 0.8, "top_k": 2, "top_p": 0.9}
    law = _speculative_law("json", draft_fn, target_fn, 3, method="block", gamma=2, **sampling)
    assert total_variation(law, _masked_law("json", target_fn, 3, **sampling)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", ["token", "block", "greedy_block"])
def test_greedy_is_the_argmax_of_the_masked_logits(method):
    draft_fn, target_fn = model_pair(_vocab("regex"), 31)
    law = _speculative_law("regex", draft_fn, target_fn, 4, method=method, gamma=3, temperature=0.0)
    expected = _masked_law("regex", target_fn, 4, temperature=0.0)
    assert len(expected) == 1 and total_variation(law, expected) < EXACT_TOLERANCE
    unmasked_first = int(torch.argmax(torch.as_tensor(target_fn(PROMPT))))
    masked_first = next(iter(expected))[0]
    assert _oracle_allowed("regex", ())[masked_first]
    assert unmasked_first == masked_first or not _oracle_allowed("regex", ())[unmasked_first]


ENSEMBLE_CASES = [{"ensemble": "weighted", "weights": [0.6, 0.4]}, {"ensemble": "contrastive", "mu": 0.4}]


@pytest.mark.parametrize("ensemble_args", ENSEMBLE_CASES, ids=["weighted", "contrastive"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_speculative_ensemble_is_exact_under_a_grammar(ensemble_args, method):
    model_fns = [TinyModel(4, 41), TinyModel(4, 42)]
    penalties = Penalties(grammar=_constraint("regex"))
    law = exact_law(lambda s: tuple(ensemble_generate(
        model_fns, PROMPT, 3, gammas=(2, 1), method=method, generator=s, penalties=penalties, **ensemble_args
    )[0]))
    ensemble_logits = ensemble_next_token_probs(model_fns, temperature=1.0, **ensemble_args)
    expected = _masked_law("regex", lambda c: torch.log(ensemble_logits(c)), 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


@pytest.mark.parametrize(("ensemble_args", "proposer"), [(ENSEMBLE_CASES[0], "draft"),
                                                         pytest.param(ENSEMBLE_CASES[1], "member", marks=pytest.mark.slow)],
                         ids=["weighted-draft", "contrastive-member"])
def test_ensemble_with_a_draft_proposer_is_exact_under_a_grammar(ensemble_args, proposer):
    """se's other proposer (Speculative Ensemble, arXiv:2502.01662, Sec. 3.2): a draft (a member, or a separate model)
    proposes from its masked rows, verified against the masked ensemble law."""
    model_fns = [TinyModel(4, 45), TinyModel(4, 46)]
    penalties = Penalties(grammar=_constraint("regex"))
    draft = 0 if proposer == "member" else TinyModel(4, 47)
    law = exact_law(lambda s: tuple(ensemble_draft_generate(
        model_fns, PROMPT, 3, proposer=draft, gamma=2, method="block", generator=s, penalties=penalties,
        **ensemble_args)[0]))
    ensemble_probs = ensemble_next_token_probs(model_fns, **ensemble_args)
    expected = _masked_law("regex", lambda c: torch.log(ensemble_probs(c)), 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


def test_standard_ensemble_samples_the_masked_ensemble_law():
    model_fns = [TinyModel(4, 43), TinyModel(4, 44)]
    penalties = Penalties(grammar=_constraint("regex"))
    law = exact_law(lambda s: tuple(ensemble_autoregressive_generate(model_fns, PROMPT, 3, generator=s,
                                                                     penalties=penalties)[0]))
    ensemble_probs = ensemble_next_token_probs(model_fns)
    expected = _masked_law("regex", lambda c: torch.log(ensemble_probs(c)), 3)
    assert total_variation(law, expected) < EXACT_TOLERANCE


def _drop_grammar(penalties: Penalties) -> Penalties:
    return dataclasses.replace(penalties, grammar=None)


def _patch_draft_rows(monkeypatch, *, sampled_masked: bool, verified_masked: bool):
    """The draft's rows without the grammar where asked: when it samples (``Sample`` needs) and/or
    in the rows handed to the verifier (the ``[K, gamma, V]`` logits of ``_score_verify``)."""
    original_rows = executor_module.LocalExecutor._rows
    original_sample = executor_module.LocalExecutor._sample

    def rows(self, logits, contexts, dtype=None):
        unmasked = (getattr(self, "_sampling_draft", False) and not sampled_masked) or (
            logits.dim() == 3 and not verified_masked)
        if unmasked:
            saved, self.penalties = self.penalties, _drop_grammar(self.penalties)
            try:
                return original_rows(self, logits, contexts, dtype)
            finally:
                self.penalties = saved
        return original_rows(self, logits, contexts, dtype)

    def sample(self, need):
        self._sampling_draft = need.model != "target"
        try:
            return original_sample(self, need)
        finally:
            self._sampling_draft = False

    monkeypatch.setattr(executor_module.LocalExecutor, "_rows", rows)
    monkeypatch.setattr(executor_module.LocalExecutor, "_sample", sample)


@pytest.mark.parametrize("method", ["token", "block"])
def test_masking_only_the_target_stays_exact(monkeypatch, method):
    """Positive case: unmasked drafts (sampled and verified unmasked) are just another proposal law."""
    _patch_draft_rows(monkeypatch, sampled_masked=False, verified_masked=False)
    draft_fn, target_fn = model_pair(_vocab("regex"), 3)
    law = _speculative_law("regex", draft_fn, target_fn, 2, method=method, gamma=2)
    assert total_variation(law, _masked_law("regex", target_fn, 2)) < EXACT_TOLERANCE


def test_verifying_against_the_unmasked_draft_row_is_caught(monkeypatch):
    """Control: the draft samples from its masked row but the verifier sees its unmasked row."""
    _patch_draft_rows(monkeypatch, sampled_masked=True, verified_masked=False)
    draft_fn, target_fn = model_pair(_vocab("regex"), 3)
    law = _speculative_law("regex", draft_fn, target_fn, 3, method="token", gamma=2)
    assert total_variation(law, _masked_law("regex", target_fn, 3)) > 1e-3


def test_a_matcher_not_rolled_back_after_a_rejection_is_caught(monkeypatch):
    """Control: the matcher only moves forward (consumes the new tail, never rolls back)."""

    def forward_only(self, context):
        rest = [int(t) for t in context[len(self.consumed):]]
        taken = self.matcher.try_consume_tokens(rest) if rest else 0
        self.consumed.extend(rest[:taken])
        return taken == len(rest)

    monkeypatch.setattr(grammar_module._Matcher, "move_to", forward_only)
    draft_fn, target_fn = model_pair(_vocab("regex"), 3)
    try:
        law = _speculative_law("regex", draft_fn, target_fn, 3, method="token", gamma=2)
    except ValueError as error:  # or the stale rows contradict the draws the verifier is handed
        assert "zero probability" in str(error)
    else:
        assert total_variation(law, _masked_law("regex", target_fn, 3)) > 1e-3


def test_a_dead_end_allows_only_end_of_sequence():
    """A live prefix after which no token of the vocabulary fits ends the request there."""
    constraint = compile_constraint("regex", "a(b|z)", "tests-regex", request="dead-end")
    mask = allowed_tokens(constraint, [(0,), (0, 1)], _vocab("regex"))
    assert mask.tolist() == [[False, True, False, False], [False, False, False, True]]
    constraint = compile_constraint("regex", "az", "tests-regex", request="dead-end-2")
    assert allowed_tokens(constraint, [(0,)], _vocab("regex"))[0].tolist() == [False, False, False, True]


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("regex", "(", "regex"),
    ("json_schema", {"type": "nonsense"}, "type"),
    ("json_schema", {"type": "string", "format": "no-such-format"}, "format"),
    ("grammar", "start: missing_rule", "missing_rule"),
    ("choice", [], "choice"),
    ("json_schema", "not an object", "object"),
    ("grammar", "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1} | \"x\"" for i in range(400)) + "\nr400: \"y\"",
     "rules"),  # a chain of thousands of rules overflows the engine's stack: refused long before
    ("choice", [f"word{i:08d}" for i in range(10_000)], "characters"),
])
def test_bad_constraints_are_refused_with_the_engine_message(kind, spec, message):
    with pytest.raises(GrammarError, match=message):
        compile_constraint(kind, spec, "tests-regex")


def test_penalized_rows_apply_the_mask_first():
    constraint = _constraint("regex")
    logits = torch.tensor([[0.5, 2.0, 1.0, 3.0]], dtype=torch.float64)  # [1, V]
    rows = penalized_probs(logits, temperature=1.0, penalties=Penalties(grammar=constraint, logit_bias=((1, 5.0),)),
                           generated=[(1,)])  # after "b" only "c" fits
    assert rows.tolist() == [[0.0, 0.0, 1.0, 0.0]]
