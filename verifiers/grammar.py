"""Structured outputs: a grammar's mask on the logits, the first of the request's row transforms.

A request with a constraint (a JSON schema, a regular expression, a choice of strings or a
Lark grammar) samples at every position from

    softmax(logits with every token the grammar disallows after the row's generated prefix at -inf)

followed by the other row transforms (penalties, temperature / top-k / top-p) exactly as without a
constraint: the served law is the model's (or the ensemble's) law restricted to the strings the
grammar allows and renormalised position by position. End-of-sequence is allowed only where the
grammar may end.

Like a penalty, the mask of a row depends on the tokens generated before the row's position
(:mod:`verifiers.penalties`), so every maker of rows applies it with the row's own context: the
target's rows of a verified block (each position at the grammar state after the draft tokens
before it), the bonus row, each draft's proposal rows (a draft samples from its masked law, so
its tokens stay acceptable), every chain of a multi-draft block (its own state), and the ensemble's
rows (the mask is applied to the ensemble's logits, as the penalties are: the ensemble law
restricted to the grammar, weighted and contrastive alike, and to each member's proposal rows).
Rejected positions need no undo: the state of a row is a function of its context, and the matcher
of a request rolls back to the longest prefix it shares with the next context it is asked for.

Engine: llguidance (``LLMatcher``: JSON schema, regex and Lark grammars over a tokenizer's byte
strings, a one-bit-per-token mask and ``rollback``), measured in ``benchmarks/micro/grammar_masks.py``.
The mask is filled as an int32 bitmask ``[N, ceil(V / 32)]`` and applied with tensor operations
(no loop over the vocabulary).

Two special states:

* a **dead context** (a token before the row that the grammar does not allow: only possible when
  the row follows a proposal that was not masked, e.g. an unmasked draft) leaves the row
  unmasked; such a row follows a token of probability zero under the masked law, so no accepted
  token is ever drawn from it (rows must still be valid distributions); so does a context with
  an end-of-sequence in it (the request ended there);
* a **dead end** (a live context after which the grammar allows no token of the vocabulary,
  not even end-of-sequence) allows only end-of-sequence: the request ends there, and the
  scheduler reports it as an error naming the constraint (:func:`grammar_complete` tells a
  complete string from a dead end).
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: Engine limits on one grammar (llguidance ``LLParserLimits``): a pathological grammar is
#: refused when compiled, and a mask that would exceed them ends in an error, never a hang.
GRAMMAR_LIMITS = {"step_lexer_fuel": 200_000, "max_items_in_row": 2_000, "initial_lexer_fuel": 100_000,
                  "step_max_items": 50_000, "max_lexer_states": 100_000, "max_grammar_size": 500_000}

_VOCABULARIES: dict[str, object] = {}
_VOCABULARY_LOCK = threading.Lock()


#: Longest constraint (a schema's JSON text, a regex, a grammar, the choices together), and most
#: rules of a Lark grammar: the engine recurses along a chain of rules (a chain of thousands
#: overflows its stack), so grammars are refused well before that.
MAX_SPEC_CHARS = 100_000
MAX_GRAMMAR_RULES = 300
#: Masks computed when a constraint is compiled over the tokenizer (:func:`_probe`).
PROBE_STEPS = 8
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w]*(?:\.\d+)?\s*:", re.MULTILINE)


class GrammarError(ValueError):
    """A constraint the engine refuses (invalid, unsupported, or over its limits)."""


#: How a worker's report of a GrammarError begins (the ingress answers it 400 naming the field).
GRAMMAR_ERROR_PREFIX = "GrammarError: "


@dataclass(frozen=True)
class GrammarConstraint:
    """A request's compiled grammar, as it travels to every maker of rows (picklable, small).

    ``grammar``: the engine's grammar (llguidance's JSON form, from :func:`compile_constraint`);
    ``vocabulary``: the key of the token vocabulary (a tokenizer path, or a name given to
    :func:`register_vocabulary`); ``request``: an id that gives each request its own matcher
    (two requests with equal grammars would otherwise share one and roll it back and forth).
    """

    grammar: str
    vocabulary: str
    request: str = ""

    def __repr__(self) -> str:  # the grammar can be long
        return f"GrammarConstraint(vocabulary={self.vocabulary!r}, request={self.request!r}, {len(self.grammar)} chars)"


def register_vocabulary(name: str, tokens: Sequence[bytes], eos_token_id: int) -> None:
    """Make ``tokens`` (token id -> its bytes; special tokens as ``b"\\xff" + name``) the
    vocabulary ``name`` in this process (tests and benchmarks; a served model's vocabulary is
    its tokenizer path)."""
    import llguidance

    class _Tokens:
        def __init__(self):
            self.tokens = list(tokens)
            self.eos_token_id = eos_token_id
            self.bos_token_id = None
            self.special_token_ids = [eos_token_id]
            self._ids = {token: index for index, token in enumerate(self.tokens)}

        def __call__(self, text):  # greedy, longest match first: only used for the engine's own checks
            data = text.encode() if isinstance(text, str) else bytes(text)
            ids, start = [], 0
            while start < len(data):
                for end in range(len(data), start, -1):
                    if data[start:end] in self._ids:
                        ids.append(self._ids[data[start:end]])
                        start = end
                        break
                else:  # a byte no token spells: skipped (the engine then finds no token for it)
                    start += 1
            return ids

    with _VOCABULARY_LOCK:
        _VOCABULARIES[name] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()))


def engine_vocabulary(name: str):
    """The engine's tokenizer for ``name`` (registered, or a tokenizer path loaded once per process)."""
    with _VOCABULARY_LOCK:
        found = _VOCABULARIES.get(name)
    return found if found is not None else _tokenizer_vocabulary(name)


@functools.lru_cache(maxsize=8)
def _tokenizer_vocabulary(path: str):
    import llguidance.hf

    from actors.tokenizer import load_tokenizer

    return llguidance.hf.from_tokenizer(load_tokenizer(path))


def _limits():
    import llguidance

    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def compile_constraint(kind: str, spec: object, vocabulary: str | None, request: str = "") -> GrammarConstraint:
    """``kind`` (one of :data:`KINDS`) and its ``spec`` -> a checked :class:`GrammarConstraint`
    over ``vocabulary`` (None: check the grammar alone, as the ingress does before any model
    work); raises :class:`GrammarError` with the engine's message for anything it refuses."""
    import json

    try:
        key = json.dumps(spec)  # key order kept: a schema's property order is the output's
    except (TypeError, ValueError, RecursionError):
        raise GrammarError("must be JSON (and not nested too deeply)") from None
    if len(key) > MAX_SPEC_CHARS:
        raise GrammarError(f"at most {MAX_SPEC_CHARS} characters (got {len(key)})")
    grammar = _checked_grammar(kind, key, vocabulary)
    return GrammarConstraint(grammar, vocabulary or "", request)


@functools.lru_cache(maxsize=256)
def _checked_grammar(kind: str, spec_json: str, vocabulary: str | None) -> str:
    import json

    from llguidance import LLMatcher

    grammar = _engine_grammar(kind, json.loads(spec_json))
    tokenizer = engine_vocabulary(vocabulary) if vocabulary else None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=_limits())
    if is_error:
        raise GrammarError(_first_line(messages[0] if messages else "invalid grammar"))
    unsupported = [m for m in messages if "unsupported" in m.lower() or "unknown" in m.lower()]
    if unsupported:
        raise GrammarError(_first_line(unsupported[0]))
    if tokenizer is not None:
        _probe(tokenizer, grammar)
    return grammar


def _probe(tokenizer, grammar: str, steps: int = PROBE_STEPS) -> None:
    """The first ``steps`` masks along the first allowed token of each: a grammar over the
    engine's limits usually fails here, before any model work (one that fails later ends its
    request with a 400 naming the field)."""
    from llguidance import LLMatcher

    probe = LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
    bitmask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)  # [W]
    for _ in range(steps):
        if probe.is_error() or probe.is_stopped():
            break
        probe.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
        words = torch.nonzero(bitmask).flatten()
        if probe.is_error() or words.numel() == 0:
            break
        word = int(words[0])
        bits = int(bitmask[word]) & 0xFFFFFFFF
        probe.consume_token(32 * word + (bits & -bits).bit_length() - 1)
    if probe.is_error() and _first_line(probe.get_error()) not in ("NoExtension", "NoExtensionBias"):
        raise GrammarError("over the grammar engine's limits: " + _first_line(probe.get_error()))


def _engine_grammar(kind: str, spec: object) -> str:
    import json

    from llguidance import LLMatcher

    if kind == "json_object":
        spec = {"type": "object"}
        kind = "json_schema"
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise GrammarError("a JSON schema must be an object")
        try:
            return LLMatcher.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False})
        except (ValueError, TypeError) as error:
            raise GrammarError(_first_line(str(error))) from None
    if kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise GrammarError("a regex must be a non-empty string")
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(s, str) and s for s in spec):
            raise GrammarError("a choice must be a non-empty list of non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in dict.fromkeys(spec)))
    if kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise GrammarError("a grammar must be a non-empty Lark grammar")
        rules = len(_LARK_RULE.findall(spec))
        if rules > MAX_GRAMMAR_RULES:  # the engine's analysis recurses along chains of rules
            raise GrammarError(f"at most {MAX_GRAMMAR_RULES} rules (got {rules})")
        return LLMatcher.grammar_from_lark(spec)
    raise GrammarError(f"unknown constraint kind {kind!r}")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "invalid grammar"


@dataclass
class _Matcher:
    """One request's matcher and the tokens it has consumed (always a live prefix)."""

    matcher: object
    consumed: list[int] = field(default_factory=list)

    def move_to(self, context: Sequence[int]) -> bool:
        """Roll back to the longest prefix shared with ``context``, then consume the rest; False
        (and the matcher left at the longest live prefix) when a token is not allowed."""
        common = _common_prefix_length(self.consumed, context)
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        rest = [int(token) for token in context[common:]]
        if not rest:
            return True
        taken = self.matcher.try_consume_tokens(rest)
        self.consumed.extend(rest[:taken])
        return taken == len(rest)


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = min(len(a), len(b))
    if list(a[:length]) == list(b[:length]):
        return length
    low, high = 0, length  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if list(a[:middle]) == list(b[:middle]):
            low = middle
        else:
            high = middle
    return low


_MATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MATCHERS_LOCK = threading.Lock()


def _matcher_of(constraint: GrammarConstraint) -> _Matcher:
    with _MATCHERS_LOCK:
        found = _MATCHERS.get(constraint)
        if found is None:
            from llguidance import LLMatcher

            matcher = LLMatcher(engine_vocabulary(constraint.vocabulary), constraint.grammar, log_level=0,
                                limits=_limits())
            if matcher.is_error():
                raise GrammarError(_first_line(matcher.get_error()))
            found = _MATCHERS[constraint] = _Matcher(matcher)
        return found


def _after_error(state: _Matcher, constraint: GrammarConstraint, row_bitmask: torch.Tensor) -> None:
    """A matcher that errs while computing a mask: a dead end (the engine found no extension)
    leaves the row empty (:func:`allowed_tokens` then allows end-of-sequence) and starts a fresh
    matcher (an engine error is final); anything else (a limit hit) fails the request."""
    from llguidance import LLMatcher

    if _first_line(state.matcher.get_error()) not in ("NoExtension", "NoExtensionBias"):
        raise GrammarError(_first_line(state.matcher.get_error()))
    row_bitmask.zero_()
    state.matcher = LLMatcher(engine_vocabulary(constraint.vocabulary), constraint.grammar, log_level=0,
                              limits=_limits())
    state.consumed = []


def grammar_bitmask(constraint: GrammarConstraint, generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """The engine's masks: int32 ``[N, W]`` (bit ``b`` of word ``w`` allows token ``32 w + b``),
    row ``i`` after ``generated[i]``; dead contexts (and contexts past an end-of-sequence) are all
    ones, a dead end is all zeros (:func:`grammar_bias` then allows end-of-sequence)."""
    state = _matcher_of(constraint)
    tokenizer = engine_vocabulary(constraint.vocabulary)
    eos = tokenizer.eos_token
    bitmask = torch.full((len(generated), (tokenizer.vocab_size + 31) // 32), -1, dtype=torch.int32)  # [N, W]
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    with _MATCHERS_LOCK:
        for row, context in enumerate(generated):
            if eos in context or not state.move_to(context):
                continue
            state.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
            if state.matcher.is_error():
                _after_error(state, constraint, bitmask[row])
    return bitmask


@functools.lru_cache(maxsize=8)
def _byte_table(dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: for each byte of a bitmask, the additive bias of its 8 tokens (0 allowed,
    ``-inf`` disallowed; bit ``b`` is the ``b``-th token)."""
    bits = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(~bits, float("-inf"))


def grammar_bias(constraint: GrammarConstraint, generated: Sequence[Sequence[int]], vocab: int,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The grammar as an additive bias: ``[N, V]`` in ``dtype``, 0 where allowed and ``-inf``
    elsewhere (one table lookup per mask byte, no branch per token: adding it costs what an
    addition costs, whatever the mask's pattern). A dead end allows end-of-sequence only."""
    bitmask = grammar_bitmask(constraint, generated)  # [N, W]
    rows = bitmask.shape[0]
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _byte_table(dtype)).reshape(rows, -1)
    if bias.shape[-1] >= vocab:
        bias = bias[:, :vocab]  # [N, V]
    else:  # ids the engine's tokenizer does not have (padded embedding rows) are never allowed
        bias = torch.cat([bias, bias.new_full((rows, vocab - bias.shape[-1]), float("-inf"))], dim=-1)
    dead_end = bias.amax(dim=-1) == float("-inf")  # [N]
    if bool(dead_end.any()):
        eos = engine_vocabulary(constraint.vocabulary).eos_token
        if not 0 <= eos < vocab:
            raise GrammarError("the grammar allows no token here and end-of-sequence is outside the vocabulary")
        bias = bias.contiguous()
        bias[dead_end, eos] = 0.0
    return bias


def allowed_tokens(constraint: GrammarConstraint, generated: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """The grammar's mask of each row: bool ``[N, V]``, row ``i`` after ``generated[i]`` (the
    tokens generated before it). Dead contexts are all True, dead ends allow only
    end-of-sequence (module docstring)."""
    return grammar_bias(constraint, generated, vocab) == 0


def mask_logits(logits: torch.Tensor, constraint: GrammarConstraint, generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """``logits [N, V]`` in place: ``-inf`` at every token the grammar disallows after
    ``generated[i]``; returns ``logits``."""
    return logits.add_(grammar_bias(constraint, generated, logits.shape[-1], logits.dtype).to(logits.device))


def grammar_complete(constraint: GrammarConstraint, tokens: Sequence[int], eos_token_ids: Sequence[int] = ()) -> bool:
    """Whether ``tokens`` (the generated ids, end-of-sequence ids dropped) are a complete string
    of the grammar (a fresh matcher: the coordinator's check of a finished request)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(engine_vocabulary(constraint.vocabulary), constraint.grammar, log_level=0, limits=_limits())
    body = [int(t) for t in tokens if int(t) not in set(eos_token_ids)]
    return matcher.try_consume_tokens(body) == len(body) and matcher.is_accepting()
