"""Turn accepted token ids into the streamed output: EOS, max_tokens, stop strings, text deltas.

Text is emitted only when it decodes cleanly: a byte-level BPE token can hold part of a
multi-byte character, which decodes to U+FFFD until the rest arrives, so trailing replacement
characters are held back. Text that could be the beginning of a stop string is held back too,
so a stop string never leaks into the output; when one appears, the text is cut before it and
the request finishes with ``finish_reason="stop"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class OutputDelta:
    """What one batch of accepted tokens adds to the output."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class OutputTracker:
    """Accumulates generated tokens for one request and decides when it is finished.

    ``eos_token_ids`` end the request (the EOS token itself is not part of the output) unless
    ``ignore_eos``; ``max_tokens`` caps the number of output tokens; ``stop`` strings end the
    request with the text cut before the first match. ``tokenizer`` may be None (token ids
    only, no text; stop strings then cannot be used). ``min_tokens``: no stop string ends the
    output before it has that many tokens (a match must end in the text of the tokens from the
    ``min_tokens``-th on; the rows ban EOS before it). ``include_stop_str_in_output``: the text
    keeps the stop string that ended it. ``skip_special_tokens`` / ``spaces_between_special_tokens``:
    the tokenizer's decode options (vLLM's).
    """

    def __init__(
        self,
        tokenizer: Any | None,
        *,
        max_tokens: int,
        stop: list[str] | tuple[str, ...] = (),
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.stop = [s for s in stop if s]
        self.eos_token_ids = frozenset() if ignore_eos else frozenset(eos_token_ids)
        self.min_tokens = min_tokens
        self.include_stop = include_stop_str_in_output
        self._decode_options = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # only slow tokenizers read it; the default leaves it out
            self._decode_options["spaces_between_special_tokens"] = False
        self._stop_from = 0 if min_tokens <= 1 else None  # where a match must end past; None: not yet
        self.token_ids: list[int] = []
        self.sent_text = ""
        self.finish_reason: str | None = None
        # Incremental detokenization: ``_text`` is the text of token_ids[:_read_offset]; each
        # call decodes only the tokens from ``_prefix_offset`` (the previous read offset) on.
        self._text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.token_ids)

    def _decode(self) -> str:
        """The text of every token so far, decoding only the tokens added since the last stable
        point (the text of a window is the difference of two small decodes, so a token whose
        text depends on its left neighbour -- a leading space, a split UTF-8 character -- comes
        out as the whole decode would give it)."""
        if self.tokenizer is None or self._read_offset == len(self.token_ids):
            return self._text
        window = self.token_ids[self._prefix_offset:]
        before = self._decode_ids(window[: self._read_offset - self._prefix_offset])
        after = self._decode_ids(window)
        if not after.startswith(before):  # the tokenizer rewrote earlier text: decode it all
            return self._decode_ids(self.token_ids)
        if after.endswith(REPLACEMENT_CHAR):  # an unfinished character: not stable yet
            return self._text + after[len(before):]
        self._text += after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return self._text

    def _decode_ids(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, clean_up_tokenization_spaces=False, **self._decode_options)

    def add(self, tokens: list[int]) -> OutputDelta:
        """Take accepted tokens (in order); return the new output and whether it finished."""
        delta = OutputDelta()
        if self.finished:
            return delta
        text = None
        for token in tokens:
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                break
            self.token_ids.append(int(token))
            delta.token_ids.append(int(token))
            if self.stop:
                text = self._decode()
                cut = self._stop_position(text)
                if cut is not None:
                    text = text[:cut]
                    self.finish_reason = "stop"
                    break
            if len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
                break
        if text is None:
            text = self._decode()
        delta.text = self._new_text(text)
        delta.finish_reason = self.finish_reason
        return delta

    def finish(self, reason: str) -> OutputDelta:
        """End the request now (e.g. the context is full); flush held-back text."""
        if not self.finished:
            self.finish_reason = reason
        return OutputDelta(text=self._new_text(self._decode()), finish_reason=self.finish_reason)

    @property
    def text(self) -> str:
        return self.sent_text

    def _stop_position(self, text: str) -> int | None:
        """Where the output text ends when a stop string matches (after it with
        ``include_stop_str_in_output``), or None. Before ``min_tokens`` tokens nothing matches;
        from then on a match must end in the text of the ``min_tokens``-th token or later."""
        if self._stop_from is None:
            if len(self.token_ids) < self.min_tokens:
                return None
            self._stop_from = len(self._text_before_last_token())
        matches = [(text.find(stop, max(0, self._stop_from - len(stop) + 1)), stop) for stop in self.stop]
        found = [(start, stop) for start, stop in matches if start >= 0]
        if not found:
            return None
        start, stop = min(found)
        return start + len(stop) if self.include_stop else start

    def _text_before_last_token(self) -> str:
        return self._decode_ids(self.token_ids[:-1])

    def _new_text(self, text: str) -> str:
        if not self.finished:
            text = text[: len(text) - self._held_back(text)]
        if not text.startswith(self.sent_text):
            # Decoding more tokens rewrote earlier text (rare tokenizer normalisation); never
            # retract what was sent, append only what is new past it.
            new = text[len(self.sent_text):] if len(text) > len(self.sent_text) else ""
        else:
            new = text[len(self.sent_text):]
        self.sent_text += new
        return new

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change or start a stop string."""
        held = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    held = max(held, length)
                    break
        return held
