"""Whole (not streamed) responses: completions and chat completions, tool calls, error bodies
and the model list."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from actors.request_schema import InvalidRequestError
from cluster.responses.logprobs import LogprobsRenderer, TokenTexts, prompt_logprobs_block, with_prompt
from cluster.responses.usage import (
    CompletionAccumulator,
    merged_speculation,
    results_of,
    speculation_block,
    total_usage,
)


def tool_calls_of(text: str, call: str, call_id: str) -> list[dict] | None:
    """The OpenAI ``tool_calls`` of a constrained call's output (None when it is not complete JSON)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    name, arguments = (value.get("name"), value.get("arguments")) if call == "required" else (call, value)
    return [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]


def error_body(message: str, param: str | None, error_type: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI-style error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_request_body(error: InvalidRequestError) -> dict:
    """The 400 body of an :class:`InvalidRequestError`; the message names the field."""
    param = None if error.field == "body" else error.field
    return error_body(f"{error.field}: {error.message}", param, code="invalid_value")


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
    results = results_of(result)
    choices = []
    for item in results:
        rendered = None
        if logprobs is not None and generated_logprobs:
            offset = 0 if echo_logprobs is not None else len(item.prefix)
            renderer = LogprobsRenderer(logprobs, chat, initial_offset=offset)
            rendered = with_prompt(renderer, item.logprobs or [], item.prompt_token_ids, item.prompt_logprobs,
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


def models_list(model_names: list[str], created: int | None = None) -> dict:
    """``GET /v1/models`` body."""
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "specserve"} for name in model_names],
    }
