"""OpenAI response objects: token texts, log-probabilities, whole responses, stream chunks, SSE.

:class:`actors.api.GenerationChunk` streams are rendered as OpenAI ``text_completion`` /
``chat.completion`` objects or their server-sent-event chunks. Responses carry a
``speculation`` block next to ``usage`` (an extension): the request's
:class:`actors.api.RequestStats` (accepted lengths, block efficiency, target calls, ...); with
several choices it is their sum (:func:`merged_speculation`) and each choice carries its own.
Prompt log-probabilities render as OpenAI's ``echo`` with ``logprobs`` (the prompt's tokens
first, the first one null) and as vLLM's ``prompt_logprobs`` (:func:`prompt_logprobs_block`).
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any


from actors.api import (
    GenerationChunk,
    InvalidRequestError,
    RequestStats,
    TokenLogprob,
)

def tool_calls_of(text: str, call: str, call_id: str) -> list[dict] | None:
    """The OpenAI ``tool_calls`` of a constrained call's output (None when it is not complete JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    name, arguments = (value.get("name"), value.get("arguments")) if call == "required" else (call, value)
    return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]


#: Log-probabilities below this (``-inf``: a token the sampling law excludes) are shown as it,
#: as OpenAI and vLLM do (JSON has no infinity).
LOGPROB_FLOOR = -9999.0

# ----------------------------------------------------------------------------------------
# Token texts and log-probabilities
# ----------------------------------------------------------------------------------------


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
    """Renders one choice's :class:`actors.api.TokenLogprob` entries in OpenAI's shapes, chunk
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


def _with_prompt(renderer: LogprobsRenderer, chunk_entries: Sequence[TokenLogprob], prompt_ids: Sequence[int] | None,
                 prompt_entries: Sequence[TokenLogprob] | None, echo_logprobs: int | None) -> dict[str, Any]:
    """A completions ``logprobs`` block: the echoed prompt's entries first (when this chunk
    carries them and the request echoes with logprobs), then the generated tokens'."""
    if echo_logprobs is None or prompt_ids is None:
        return renderer.render(chunk_entries)
    rendered = renderer.render_prompt(prompt_ids, prompt_entries or [], echo_logprobs)
    for key, values in renderer.render(chunk_entries).items():
        rendered[key].extend(values)
    return rendered


# ----------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------


def error_body(message: str, param: str | None, error_type: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI-style error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_request_body(error: InvalidRequestError) -> dict:
    """The 400 body of an :class:`InvalidRequestError`; the message names the field."""
    param = None if error.field == "body" else error.field
    return error_body(f"{error.field}: {error.message}", param, code="invalid_value")


def usage_block(stats: RequestStats | None) -> dict[str, Any]:
    """OpenAI ``usage`` from the request's stats (with ``completion_tokens_details`` when a
    prediction drafted: :func:`prediction_details`)."""
    prompt_tokens = stats.prompt_tokens if stats else 0
    completion_tokens = stats.completion_tokens if stats else 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    details = prediction_details([stats] if stats else [])
    if details is not None:
        usage["completion_tokens_details"] = details
    return usage


def prediction_details(stats: Sequence[RequestStats]) -> dict[str, int] | None:
    """OpenAI's ``completion_tokens_details`` of predicted outputs: the predicted tokens verification
    accepted (``accepted_prediction_tokens``) and rejected (``rejected_prediction_tokens``); None
    when no choice had a prediction drafted."""
    used = [s for s in stats if "prediction" in s.proposed_tokens]
    if not used:
        return None
    accepted = sum(s.accepted_proposed["prediction"] for s in used)
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(s.proposed_tokens["prediction"] for s in used) - accepted}


def speculation_block(stats: RequestStats | None) -> dict[str, Any] | None:
    """The ``speculation`` extension block: every RequestStats field except the token counts."""
    if stats is None:
        return None
    return stats.model_dump(exclude={"prompt_tokens", "completion_tokens"})


class CompletionAccumulator:
    """Collects one choice's chunk stream into its text, token ids, log-probabilities, finish
    reason and stats. ``prefix`` (the echoed prompt) starts the text; ``counts_prompt``: this
    choice's prompt tokens count in the usage (the first sample of each prompt)."""

    def __init__(self, index: int = 0, prefix: str = "", counts_prompt: bool = True) -> None:
        self.index = index
        self.prefix = prefix
        self.counts_prompt = counts_prompt
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.prompt_token_ids is not None:
            self.prompt_token_ids, self.prompt_logprobs = chunk.prompt_token_ids, chunk.prompt_logprobs
        self.text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(chunk.logprobs)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stats = chunk.stats

    @property
    def generated_text(self) -> str:
        """The generated text alone (without the echoed prompt)."""
        return "".join(self.text_parts)

    @property
    def text(self) -> str:
        return self.prefix + self.generated_text


def _results(results: CompletionAccumulator | Sequence[CompletionAccumulator]) -> list[CompletionAccumulator]:
    return [results] if isinstance(results, CompletionAccumulator) else list(results)


def total_usage(results: CompletionAccumulator | Sequence[CompletionAccumulator]) -> dict[str, int]:
    """``usage`` of a request's choices: the prompt tokens of each prompt once, the completion
    tokens of every choice."""
    results = _results(results)
    prompt_tokens = sum(r.stats.prompt_tokens for r in results if r.stats is not None and r.counts_prompt)
    completion_tokens = sum(r.stats.completion_tokens for r in results if r.stats is not None)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    details = prediction_details([r.stats for r in results if r.stats is not None])
    if details is not None:
        usage["completion_tokens_details"] = details
    return usage


def merged_speculation(
    results: CompletionAccumulator | Sequence[CompletionAccumulator], wall_s: float | None = None
) -> dict[str, Any] | None:
    """The request's ``speculation`` block. One choice: its stats. Several: counts, calls, times
    and bytes summed, ``accepted_lengths`` concatenated in choice order, ``block_efficiency``
    = all generated tokens / all target calls, and ``tokens_per_second`` = all generated tokens
    / the request's wall-clock seconds (``wall_s``; the choices run concurrently)."""
    results = _results(results)
    stats = [r.stats for r in results if r.stats is not None]
    if not stats:
        return None
    if len(results) == 1:
        return speculation_block(stats[0])
    blocks = [speculation_block(s) for s in stats]
    merged: dict[str, Any] = dict(blocks[0])
    for key, first in blocks[0].items():
        values = [block[key] for block in blocks]
        if isinstance(first, bool) or isinstance(first, str) or first is None:
            continue
        if isinstance(first, (int, float)):
            merged[key] = sum(values)
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        elif isinstance(first, dict):
            summed: dict[str, Any] = {}
            for value in values:
                for name, count in value.items():
                    summed[name] = summed.get(name, 0) + count
            merged[key] = summed
    completion_tokens = sum(s.completion_tokens for s in stats)
    target_calls = sum(s.target_calls for s in stats)
    merged["block_efficiency"] = completion_tokens / target_calls if target_calls else 0.0
    merged["tokens_per_second"] = completion_tokens / wall_s if wall_s else 0.0
    return merged


def completion_response(
    request_id: str,
    model: str,
    created: int,
    result: CompletionAccumulator | Sequence[CompletionAccumulator],
    chat: bool,
    token_ids: bool = False,
    *,
    logprobs: TokenTexts | None = None,
    wall_s: float | None = None,
    echo_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    generated_logprobs: bool = True,
    tool_call: str | None = None,
) -> dict:
    """A whole ``text_completion`` or ``chat.completion`` object, one choice per accumulator
    (``token_ids``: add them to each choice; ``logprobs``: the token texts of log-probabilities;
    ``generated_logprobs``: render each choice's ``logprobs``, led by the echoed prompt's with
    ``echo_logprobs`` alternatives when set; ``prompt_logprobs``: add each choice's
    ``prompt_logprobs`` with this many alternatives, or for chat the response's, as vLLM). With several choices each carries its own
    ``speculation`` block, and the response's is :func:`merged_speculation`."""
    results = _results(result)
    choices = []
    for item in results:
        rendered = None
        if logprobs is not None and generated_logprobs:
            offset = 0 if echo_logprobs is not None else len(item.prefix)
            renderer = LogprobsRenderer(logprobs, chat, initial_offset=offset)
            rendered = _with_prompt(renderer, item.logprobs or [], item.prompt_token_ids, item.prompt_logprobs,
                                    echo_logprobs)
        if chat:
            choice: dict[str, Any] = {
                "index": item.index,
                "message": {"role": "assistant", "content": item.text},
                "finish_reason": item.finish_reason,
                "logprobs": rendered,
            }
            calls = tool_calls_of(item.text, tool_call, f"call_{request_id}_{item.index}") \
                if tool_call is not None and item.finish_reason == "stop" else None
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        else:
            choice = {"index": item.index, "text": item.text, "finish_reason": item.finish_reason, "logprobs": rendered}
        if token_ids:
            choice["token_ids"] = list(item.token_ids)
        if prompt_logprobs is not None and logprobs is not None and item.prompt_token_ids is not None:
            choice["prompt_logprobs"] = prompt_logprobs_block(logprobs, item.prompt_token_ids,
                                                              item.prompt_logprobs or [], prompt_logprobs)
        if len(results) > 1:
            choice["speculation"] = speculation_block(item.stats)
        choices.append(choice)
    response = {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": total_usage(results),
        "speculation": merged_speculation(results, wall_s),
    }
    if chat and "prompt_logprobs" in choices[0]:  # one prompt: vLLM's chat has it once, beside the choices
        response["prompt_logprobs"] = choices[0]["prompt_logprobs"]
        for choice in choices:
            del choice["prompt_logprobs"]
    return response


def stream_chunk(
    request_id: str,
    model: str,
    created: int,
    chunk: GenerationChunk,
    chat: bool,
    first: bool,
    token_ids: bool = False,
    *,
    index: int = 0,
    prefix: str = "",
    logprobs: LogprobsRenderer | None = None,
    single: bool = True,
    usage: bool = True,
    echo_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> dict:
    """One streamed ``text_completion`` / ``chat.completion.chunk`` object for choice ``index``.

    ``prefix`` is put before the chunk's text (the echoed prompt, on a choice's first chunk);
    ``token_ids`` adds the chunk's new token ids to the choice; ``logprobs`` renders the
    chunk's log-probabilities. A choice's final chunk (``chunk.finished``) carries
    ``finish_reason``; with a single choice (``single``) also the request's ``speculation``
    and, unless ``usage`` is false (``stream_options.include_usage`` sends it in a chunk of its
    own, and clients add up every ``usage`` they see), its ``usage``; with several choices the
    choice's own ``speculation`` inside the choice. The chunk that carries the prompt's
    log-probabilities (the first) leads its ``logprobs`` with the echoed prompt's
    (``echo_logprobs`` alternatives, when set) and, with ``prompt_logprobs``, adds the choice's
    ``prompt_logprobs`` block.
    """
    finish_reason = chunk.finish_reason if chunk.finished else None
    rendered = None
    if logprobs is not None:
        rendered = _with_prompt(logprobs, chunk.logprobs or [], chunk.prompt_token_ids, chunk.prompt_logprobs,
                                echo_logprobs)
    if chat:
        delta: dict[str, Any] = {"content": prefix + chunk.text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": rendered}
    else:
        choice = {"index": index, "text": prefix + chunk.text, "finish_reason": finish_reason, "logprobs": rendered}
    if token_ids:
        choice["token_ids"] = list(chunk.token_ids)
    if prompt_logprobs is not None and logprobs is not None and chunk.prompt_token_ids is not None:
        choice["prompt_logprobs"] = prompt_logprobs_block(logprobs.texts, chunk.prompt_token_ids,
                                                          chunk.prompt_logprobs or [], prompt_logprobs)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if chunk.finished:
        if single:
            if usage:
                body["usage"] = usage_block(chunk.stats)
            body["speculation"] = speculation_block(chunk.stats)
        else:
            choice["speculation"] = speculation_block(chunk.stats)
    return body


class ChoiceStream:
    """Renders the chunks of one choice of a streamed request (first-chunk role and echo
    prefix, log-probabilities with a running text offset) and accumulates its totals.
    ``include_usage``: the request's usage goes in a chunk of its own (:func:`usage_chunk`),
    not on the final chunk. ``continuous_usage``: every chunk also carries this choice's usage
    so far (vLLM's ``stream_options.continuous_usage_stats``)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        chat: bool,
        *,
        index: int = 0,
        prefix: str = "",
        counts_prompt: bool = True,
        token_ids: bool = False,
        logprobs: TokenTexts | None = None,
        single: bool = True,
        include_usage: bool = False,
        echo_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        generated_logprobs: bool = True,
        continuous_usage: bool = False,
    ):
        self.request_id, self.model, self.created, self.chat = request_id, model, created, chat
        self.continuous_usage = continuous_usage
        self._prompt_tokens = 0
        self.index = index
        self.token_ids = token_ids
        self.single = single
        self.include_usage = include_usage
        self.result = CompletionAccumulator(index, prefix, counts_prompt)
        self._prefix = prefix
        self._first = True
        self.echo_logprobs, self.prompt_logprobs = echo_logprobs, prompt_logprobs
        self.generated_logprobs = generated_logprobs
        offset = 0 if echo_logprobs is not None else len(prefix)
        self._logprobs = None if logprobs is None else LogprobsRenderer(logprobs, chat, initial_offset=offset)

    def render(self, chunk: GenerationChunk) -> dict:
        self.result.add(chunk)
        body = stream_chunk(
            self.request_id, self.model, self.created, chunk, self.chat, self._first, self.token_ids,
            index=self.index, prefix=self._prefix if self._first else "", logprobs=self._logprobs, single=self.single,
            usage=not self.include_usage, echo_logprobs=self.echo_logprobs, prompt_logprobs=self.prompt_logprobs,
        )
        if not self.generated_logprobs:  # the token texts were loaded for prompt_logprobs alone
            body["choices"][0]["logprobs"] = None
        if self.continuous_usage:
            body["usage"] = self._usage_so_far(chunk)
        self._first = False
        return body

    def _usage_so_far(self, chunk: GenerationChunk) -> dict[str, int]:
        """This choice's usage up to and including ``chunk``."""
        if chunk.finished and chunk.stats is not None:
            return usage_block(chunk.stats)
        if chunk.prompt_tokens is not None:
            self._prompt_tokens = chunk.prompt_tokens
        completion = len(self.result.token_ids)
        return {"prompt_tokens": self._prompt_tokens, "completion_tokens": completion,
                "total_tokens": self._prompt_tokens + completion}


def usage_chunk(
    request_id: str,
    model: str,
    created: int,
    stats: RequestStats | CompletionAccumulator | Sequence[CompletionAccumulator] | None,
    chat: bool,
    wall_s: float | None = None,
) -> dict:
    """The ``stream_options.include_usage`` chunk: empty choices, the usage of every choice and
    the request's ``speculation`` block (:func:`merged_speculation`)."""
    if stats is None or isinstance(stats, RequestStats):
        result = CompletionAccumulator()
        result.stats = stats
        stats = [result]
    results = _results(stats)
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": total_usage(results),
        "speculation": merged_speculation(results, wall_s),
    }


def sse_event(payload: dict | str) -> bytes:
    """A server-sent event line: ``data: <json>\\n\\n`` (or ``data: [DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


def models_list(model_names: list[str], created: int | None = None) -> dict:
    """``GET /v1/models`` body."""
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "specserve"} for name in model_names],
    }


__all__ = [
    "ChoiceStream",
    "CompletionAccumulator",
    "LOGPROB_FLOOR",
    "LogprobsRenderer",
    "SSE_DONE",
    "TokenTexts",
    "completion_response",
    "error_body",
    "invalid_request_body",
    "merged_speculation",
    "models_list",
    "prompt_logprobs_block",
    "speculation_block",
    "sse_event",
    "stream_chunk",
    "total_usage",
    "usage_block",
    "usage_chunk",
]
