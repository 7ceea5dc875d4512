"""Streamed responses: each choice's chunks (:class:`ChoiceStream`), the usage chunk and
server-sent events."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from actors.request_schema import GenerationChunk, RequestStats
from cluster.responses.logprobs import LogprobsRenderer, TokenTexts, prompt_logprobs_block, with_prompt
from cluster.responses.usage import (
    CompletionAccumulator,
    merged_speculation,
    results_of,
    speculation_block,
    total_usage,
    usage_block,
)


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
        rendered = with_prompt(logprobs, chunk.logprobs or [], chunk.prompt_token_ids, chunk.prompt_logprobs,
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
    results = results_of(stats)
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
