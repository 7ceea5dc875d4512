"""A constrained request that ends at end-of-sequence before its grammar's string is complete
(a dead end: no token of the vocabulary fits, so the mask allowed only end-of-sequence) fails
with a GrammarError the ingress answers 400 naming the constraint's field; a complete string, a
stop string or the length limit finish normally."""

from __future__ import annotations

from types import SimpleNamespace

from actors.coordination.results import grammar_dead_end as _grammar_dead_end
from verifiers.grammar import compile_constraint, register_vocabulary

register_vocabulary("tests-dead-end", (b"a", b"b", b"c", b"\xff[EOS]"), 3)


def _request(regex: str, tokens: list[int], finish_reason: str, stop: tuple[str, ...] = ()):
    grammar = compile_constraint("regex", regex, "tests-dead-end", request=f"dead-end-{regex}-{tokens}")
    return SimpleNamespace(grammar=grammar, output=SimpleNamespace(token_ids=tokens, finish_reason=finish_reason,
                                                                   stop=list(stop)))


def test_an_incomplete_string_ended_by_end_of_sequence_is_a_dead_end():
    assert _grammar_dead_end(_request("az", [0], "stop"))  # "a" then only "z" fits: no token spells it


def test_complete_strings_stop_strings_and_length_are_not():
    assert not _grammar_dead_end(_request("a(b|c)", [0, 1], "stop"))
    assert not _grammar_dead_end(_request("az", [0], "stop", stop=("a",)))
    assert not _grammar_dead_end(_request("az", [0], "length"))
    assert not _grammar_dead_end(SimpleNamespace(grammar=None, output=SimpleNamespace(token_ids=[0],
                                                                                      finish_reason="stop", stop=[])))
