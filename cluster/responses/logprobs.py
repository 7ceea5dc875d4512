"""Token texts and log-probabilities as OpenAI shows them: each token's text and bytes
(:class:`TokenTexts`), the ``logprobs`` of completions and chat (:class:`LogprobsRenderer`) and
vLLM's ``prompt_logprobs`` (:func:`prompt_logprobs_block`)."""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from actors.request_schema import TokenLogprob


#: Log-probabilities below this (``-inf``: a token the sampling law excludes) are shown as it,
#: as OpenAI and vLLM do (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's ``bytes_to_unicode``), inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


_BYTE_LEVEL_CHARS = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``type`` names in a fast tokenizer's decoder (``ByteLevel``, ``Metaspace``, ...)."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - a slow or unusual tokenizer: decode token by token
        return set()
    types: set[str] = set()
    stack = [decoder]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("type"), str):
                types.add(item["type"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return types


class TokenTexts:
    """How a token is shown in log-probabilities: its raw bytes, and its text as OpenAI shows it
    (the UTF-8 text, or ``"bytes:\\xNN..."`` for a token that is part of a character)."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._cache: dict[int, bytes] = {}

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenTexts:
        """Token bytes of a transformers tokenizer: byte-level BPE pieces are mapped back to
        their bytes, sentencepiece pieces get their spaces (``▁``) and byte fallbacks
        (``<0xNN>``) back, anything else is decoded one token at a time."""
        types = _decoder_types(tokenizer)
        byte_level = "ByteLevel" in types
        added = {int(token_id): str(getattr(token, "content", token))
                 for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}

        def token_bytes(token_id: int) -> bytes:
            if token_id in added:
                return added[token_id].encode()
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if not isinstance(piece, str):
                return b""
            if byte_level and all(char in _BYTE_LEVEL_CHARS for char in piece):
                return bytes(_BYTE_LEVEL_CHARS[char] for char in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if "Metaspace" in types:
                return piece.replace("\u2581", " ").encode()
            return tokenizer.decode([token_id]).encode()

        return cls(token_bytes)

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = bytes(self._token_bytes(token_id))
        return cached

    def text_of(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def _logprob(value: float) -> float:
    """A JSON-safe log-probability (``-inf`` and NaN become :data:`LOGPROB_FLOOR`)."""
    return max(float(value), LOGPROB_FLOOR) if math.isfinite(value) else LOGPROB_FLOOR


class LogprobsRenderer:
    """Renders one choice's :class:`actors.request_schema.TokenLogprob` entries in OpenAI's shapes, chunk
    after chunk (it keeps the choice's text offset across a stream):

    - completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob},
      ...], "text_offset": [...]}``; each ``top_logprobs`` entry holds the alternatives and the
      chosen token (up to ``logprobs + 1`` entries, as OpenAI returns them);
    - chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
      "bytes"}]}]}`` with exactly the requested alternatives.

    ``text_offset`` counts characters of the choice's text before each token (``initial_offset``:
    the echoed prompt's length); a token that completes a character started by earlier ones
    points at that character.
    """

    def __init__(self, texts: TokenTexts, chat: bool, initial_offset: int = 0):
        self.texts = texts
        self.chat = chat
        self._chars = initial_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _offset(self, raw: bytes) -> int:
        offset = self._chars
        decoded = self._decoder.decode(raw)
        self._chars += len(decoded)
        return offset

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.texts.text_of(token_id), "logprob": _logprob(logprob),
                "bytes": list(self.texts.bytes_of(token_id))}

    def render(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = []
            for entry in entries:
                item = self._entry(entry.token_id, entry.logprob)
                item["top_logprobs"] = [self._entry(token_id, logprob) for token_id, logprob in entry.top]
                content.append(item)
            return {"content": content}
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries:
            tokens.append(self.texts.text_of(entry.token_id))
            token_logprobs.append(_logprob(entry.logprob))
            top = {self.texts.text_of(token_id): _logprob(logprob) for token_id, logprob in entry.top}
            top.setdefault(tokens[-1], token_logprobs[-1])
            top_logprobs.append(top)
            text_offset.append(self._offset(self.texts.bytes_of(entry.token_id)))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}

    def render_prompt(self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
        """The echoed prompt's tokens in the completions shape (OpenAI's ``echo`` with
        ``logprobs``): the first token's ``token_logprobs`` and ``top_logprobs`` are null (nothing
        precedes it), each other token has its log-probability and its ``top`` alternatives."""
        first = self.texts.text_of(prompt_ids[0])
        rendered = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None],
                    "text_offset": [self._offset(self.texts.bytes_of(prompt_ids[0]))]}
        rest = self.render([entry.model_copy(update={"top": entry.top[:top]}) for entry in entries])
        for key, values in rest.items():
            rendered[key].extend(values)
        return rendered


def prompt_logprobs_block(texts: TokenTexts, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob],
                          top: int) -> list[dict[str, dict[str, Any]] | None]:
    """A choice's ``prompt_logprobs`` in vLLM's shape: ``null`` for the first prompt token, then
    per token ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the token itself
    and its ``top`` most likely alternatives (ranks 1..top)."""
    def item(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": texts.text_of(token_id)}

    block: list[dict[str, dict[str, Any]] | None] = [None] if prompt_ids else []
    for entry in entries:
        ranked = {str(token_id): item(logprob, rank, token_id)
                  for rank, (token_id, logprob) in enumerate(entry.top[:top], start=1)}
        ranked.setdefault(str(entry.token_id), item(entry.logprob, entry.rank, entry.token_id))
        block.append(ranked)
    return block


def with_prompt(renderer: LogprobsRenderer, chunk_entries: Sequence[TokenLogprob], prompt_ids: Sequence[int] | None,
                 prompt_entries: Sequence[TokenLogprob] | None, echo_logprobs: int | None) -> dict[str, Any]:
    """A completions ``logprobs`` block: the echoed prompt's entries first (when this chunk
    carries them and the request echoes with logprobs), then the generated tokens'."""
    if echo_logprobs is None or prompt_ids is None:
        return renderer.render(chunk_entries)
    rendered = renderer.render_prompt(prompt_ids, prompt_entries or [], echo_logprobs)
    for key, values in renderer.render(chunk_entries).items():
        rendered[key].extend(values)
    return rendered

