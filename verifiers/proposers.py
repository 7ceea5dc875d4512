"""Model-free proposers for speculative decoding: drafts that no model samples.

A proposer looks at the committed tokens and returns up to ``count`` draft tokens, a
deterministic function of the request's past (the prompt, the prediction, the committed tokens).
The draft is then a *one-hot* row per position (probability 1 on the proposed token), and the
request's rule verifies it against the target rows like any draft (:func:`one_hot_rows`):

* token verification (Leviathan et al., "Fast Inference from Transformers via Speculative
  Decoding", arXiv:2211.17192, Alg. 1) accepts a proposed token ``x`` with probability
  ``min(1, p(x) / 1) = p(x)`` and otherwise draws from ``norm(max(0, p - onehot(x)))``: ``p``
  with ``x`` removed;
* block verification (Sun et al., "Block Verification Accelerates Speculative Decoding",
  arXiv:2403.10444, Alg. 2) takes the same one-hot rows.

Both are lossless for every draft law chosen from the past alone, so the output law is the
target's whatever the proposal is; a good proposal only makes it faster. (Greedy block
verification carries a distribution modification that assumes one draft model across
iterations, so model-free proposals are refused with it: :data:`MODEL_FREE_METHODS`.)

Two proposers:

* :class:`PredictionProposer` -- OpenAI's predicted outputs (``prediction``): the predicted
  tokens after the aligned position. After a rejection the output leaves the prediction; the
  proposer realigns by finding the last ``n`` generated tokens in the prediction (``n`` from
  ``ngram_max`` down to ``ngram_min``), the match closest to where the output would be had it
  followed the prediction, and proposes what follows it. Nothing matches: no proposal.
* :class:`PromptLookupProposer` -- prompt lookup (Saxena, "Prompt Lookup Decoding", 2023; vLLM's
  ``ngram``, transformers' ``prompt_lookup_num_tokens``): the last ``n`` tokens of prompt +
  output looked up in the earlier context (the latest occurrence, ``n`` from ``ngram_max``
  down to ``ngram_min``), proposing the tokens that followed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Verification rules a model-free proposal may use (one-hot draft rows, any proposal law).
MODEL_FREE_METHODS: tuple[str, ...] = ("token", "block")
#: Default n-gram sizes of the lookups (vLLM's prompt_lookup_max / prompt_lookup_min).
DEFAULT_NGRAM_MAX = 4
DEFAULT_NGRAM_MIN = 2


def one_hot_rows(tokens: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Draft rows of a model-free proposal: ``tokens [..., gamma]`` int64 -> ``[..., gamma, V]``
    in ``dtype``, probability 1 at each proposed token."""
    rows = torch.zeros(*tokens.shape, vocab, dtype=dtype, device=tokens.device)  # [..., gamma, V]
    return rows.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def _check_sizes(ngram_max: int, ngram_min: int) -> None:
    if not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")


def _occurrences(haystack: Sequence[int], needle: Sequence[int], end: int) -> list[int]:
    """Start indices ``i`` with ``haystack[i:i+n] == needle`` and ``i + n <= end``."""
    n = len(needle)
    first = needle[0]
    return [i for i in range(0, end - n + 1) if haystack[i] == first and list(haystack[i:i + n]) == list(needle)]


class PredictionProposer:
    """Drafts from a predicted output (see the module docstring). ``propose`` is called once per
    iteration with every committed token so far; its state (the aligned position) is a function
    of those tokens alone."""

    name = "prediction"

    def __init__(self, prediction: Sequence[int], *, ngram_max: int = DEFAULT_NGRAM_MAX,
                 ngram_min: int = DEFAULT_NGRAM_MIN):
        _check_sizes(ngram_max, ngram_min)
        self.prediction = [int(t) for t in prediction]
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.cursor: int | None = 0  # index of the next predicted token; None: off the prediction
        self.expected = 0  # where the output would be in the prediction had it followed it
        self.seen = 0  # committed tokens taken into account

    def propose(self, generated: Sequence[int], count: int) -> list[int]:
        """Up to ``count`` predicted tokens after ``generated`` (the committed output); [] when
        the output cannot be aligned on the prediction or the prediction is used up."""
        self._follow(generated)
        if self.cursor is None:
            return []
        return self.prediction[self.cursor: self.cursor + count]

    def _follow(self, generated: Sequence[int]) -> None:
        for token in generated[self.seen:]:
            self.expected += 1
            if self.cursor is not None and self.cursor < len(self.prediction) and self.prediction[self.cursor] == token:
                self.cursor += 1
            else:
                self.cursor = None
        self.seen = len(generated)
        if self.cursor is None:
            self.cursor = self._realign(generated)

    def _realign(self, generated: Sequence[int]) -> int | None:
        """The prediction index after the match of the output's last n tokens closest to
        :attr:`expected` (ties: the earlier), largest n first; None when nothing matches."""
        for n in range(min(self.ngram_max, len(generated)), self.ngram_min - 1, -1):
            starts = _occurrences(self.prediction, generated[-n:], len(self.prediction))
            if starts:
                return min((start + n for start in starts), key=lambda end: (abs(end - self.expected), end))
        return None


class PromptLookupProposer:
    """Drafts copied from the context (see the module docstring): stateless."""

    name = "ngram"

    def __init__(self, prompt: Sequence[int], *, ngram_max: int = DEFAULT_NGRAM_MAX,
                 ngram_min: int = DEFAULT_NGRAM_MIN):
        _check_sizes(ngram_max, ngram_min)
        self.prompt = [int(t) for t in prompt]
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, generated: Sequence[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the context's
        last n tokens (largest n first); [] when none occurs."""
        context = self.prompt + [int(t) for t in generated]
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            starts = _occurrences(context, context[-n:], len(context) - 1)  # not the suffix itself
            if starts:
                start = starts[-1] + n
                return context[start: start + count]
        return []


Proposer = PredictionProposer | PromptLookupProposer


__all__ = [
    "DEFAULT_NGRAM_MAX",
    "DEFAULT_NGRAM_MIN",
    "MODEL_FREE_METHODS",
    "PredictionProposer",
    "PromptLookupProposer",
    "Proposer",
    "one_hot_rows",
]
