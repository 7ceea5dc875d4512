"""OpenAI-compatible request/response schemas of the HTTP endpoint, and their translation.

The HTTP ingress (``cluster/app.py``) parses request bodies with the models below (strict
types, ``extra="forbid"``), turns them into :class:`actors.api.GenerationRequest` with
:func:`to_generation_request`, and renders :class:`actors.api.GenerationChunk` streams back
as OpenAI ``text_completion`` / ``chat.completion`` objects (or their server-sent-event
chunks). Every validation failure becomes an :class:`actors.api.InvalidRequestError` whose
``field`` is the request's own field name (``temperature``, ``speculation.gamma``), which
the ingress answers with HTTP 400 and an OpenAI-style error body (:func:`error_body`).

Extensions to the OpenAI schema:

- ``return_token_ids`` (each choice then carries ``token_ids``);
- ``top_k``, ``ignore_eos`` (sampling), and ``speculation`` (an object with the fields of
  :class:`actors.api.SpeculationParams`: strategy, method, gamma, num_drafts, ensemble,
  weights, mu, gammas, members); unset fields take the deployment's defaults.
- Responses carry a ``speculation`` block next to ``usage``: the request's
  :class:`actors.api.RequestStats` (accepted lengths, block efficiency, target calls, ...).

Chat template (the embedded family has none): each message is rendered as
``"<role>: <content>\\n"`` in order, and the prompt ends with ``"assistant:"`` — see
:func:`render_chat_prompt`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from actors.api import (
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    RequestStats,
    SpeculationParams,
)
from cluster.config import DEFAULT_MAX_PROMPT_CHARS
from cluster.validation import MAX_STOP_STRINGS, check_generation_request

# Sampling fields a request may set; unset ones fall back to the deployment's defaults.
SAMPLING_FIELDS: tuple[str, ...] = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")

ChatRole = Literal["system", "user", "assistant"]


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(
        False, description="Send a last chunk with empty choices and the request's usage before [DONE]."
    )


class _GenerationFields(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="Served model name (GET /v1/models); optional.")
    max_tokens: int | None = Field(None, ge=1, description="Maximum number of generated tokens (>= 1).")
    temperature: float | None = Field(None, ge=0.0, description="Softmax temperature (>= 0); 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens; 0 disables it (extension).")
    seed: int | None = Field(None, ge=0, description="Seed of the request's random streams (>= 0).")
    stop: Any = Field(None, description="A stop string or a list of them; output ends before the first match.")
    ignore_eos: bool | None = Field(None, description="Keep generating past the end-of-sequence token (extension).")
    stream: bool = Field(False, description="Stream server-sent events (`data: {...}` chunks, then `data: [DONE]`).")
    stream_options: StreamOptions | None = Field(None, description="OpenAI stream options (include_usage).")
    n: int = Field(1, description="Number of choices; only 1 is supported.")
    user: str | None = Field(None, description="End-user id (accepted and logged, not used).")
    speculation: SpeculationParams | None = Field(
        None, description="Decoding strategy overrides (extension); unset fields use the deployment defaults."
    )
    return_token_ids: bool = Field(
        False, description="Add the generated token ids to each choice as `token_ids` (extension)."
    )

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n = 1 is supported, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError("must be a string or a list of strings")
        if any(not item for item in value):
            raise ValueError("stop strings must not be empty")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        return value

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling fields this request set explicitly (the rest use deployment defaults)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}


class CompletionRequest(_GenerationFields):
    """Body of ``POST /v1/completions``."""

    prompt: Any = Field(..., description="Prompt text (non-empty string) or a list of token ids.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            if not value:
                raise ValueError("must not be empty")
            if any(item < 0 for item in value):
                raise ValueError("token ids must be >= 0")
            return value
        raise ValueError("must be a string or a list of token ids (one prompt per request)")


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: ChatRole = Field(..., description="system | user | assistant.")
    content: str = Field(..., description="Message text.")
    name: str | None = Field(None, description="Optional author name (not rendered).")


class ChatCompletionRequest(_GenerationFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation, oldest first.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer OpenAI clients).")

    def sampling_overrides(self) -> dict[str, Any]:
        overrides = super().sampling_overrides()
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError("max_completion_tokens", "conflicts with max_tokens; set only one")
            overrides["max_tokens"] = self.max_completion_tokens
        return overrides


def render_chat_prompt(messages: list[ChatMessage]) -> str:
    """The chat template: ``"<role>: <content>\\n"`` per message, then ``"assistant:"``.

    Example: ``[{"role": "user", "content": "hi"}]`` becomes ``"user: hi\\nassistant:"``.
    """
    return "".join(f"{message.role}: {message.content}\n" for message in messages) + "assistant:"


def _param_name(loc: tuple[Any, ...]) -> str | None:
    """Dotted field path of a pydantic error location (``("speculation", "gamma")`` -> ``speculation.gamma``)."""
    parts = [str(part) for part in loc if part not in ("body",)]
    return ".".join(parts) if parts else None


def invalid_request_from_validation(error: ValidationError, field_names: dict[str, str] | None = None) -> InvalidRequestError:
    """Turn the first pydantic error into an :class:`InvalidRequestError` naming the field.

    ``field_names`` renames internal paths to the caller's field names (e.g.
    ``sampling.temperature`` -> ``temperature`` for HTTP).
    """
    first = error.errors(include_url=False)[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return InvalidRequestError("body", f"invalid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _param_name(tuple(first.get("loc", ())))
    if param is not None and field_names:
        param = field_names.get(param, param)
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "field required"
    elif kind not in ("value_error", "model_type", "model_attributes_type"):
        message = f"{message} (got {json.dumps(first.get('input'), default=str)})"
    if param is None:
        return InvalidRequestError("body", message)
    return InvalidRequestError(param, message)


# GenerationRequest paths -> HTTP field names, for errors raised while building the request.
_HTTP_FIELD_NAMES: dict[str, str] = {f"sampling.{name}": name for name in SAMPLING_FIELDS}
_HTTP_FIELD_NAMES.update({"prompt_ids": "prompt"})
# Chat requests: the prompt is the rendered conversation.
_HTTP_CHAT_FIELD_NAMES: dict[str, str] = {**_HTTP_FIELD_NAMES, "prompt": "messages", "prompt_ids": "messages"}


def http_field(error: InvalidRequestError, chat: bool = False) -> InvalidRequestError:
    """The same error with its field named as in the HTTP request (``prompt_ids`` -> ``prompt``,
    ``sampling.temperature`` -> ``temperature``; chat: ``prompt`` -> ``messages``); the
    coordinator names GenerationRequest paths."""
    names = _HTTP_CHAT_FIELD_NAMES if chat else _HTTP_FIELD_NAMES
    field = names.get(error.field, error.field)
    return error if field == error.field else InvalidRequestError(field, error.message)


def parse_body(model: type[_GenerationFields], raw: bytes) -> _GenerationFields:
    """Validate a JSON request body (strict types); raise :class:`InvalidRequestError`."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise invalid_request_from_validation(error) from None


def build_generation_request(
    *,
    request_id: str,
    prompt: str | list[int],
    sampling_defaults: dict[str, Any],
    sampling_overrides: dict[str, Any],
    speculation: SpeculationParams | dict[str, Any] | None,
    field_names: dict[str, str] | None = None,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
) -> GenerationRequest:
    """Merge deployment sampling defaults with the request's overrides into a GenerationRequest
    and check every field (:func:`cluster.validation.check_generation_request`).

    Raises :class:`InvalidRequestError` (field renamed through ``field_names``) when the merged
    request is invalid.
    """
    sampling = {**sampling_defaults, **sampling_overrides}
    if isinstance(speculation, SpeculationParams):
        speculation = speculation.model_dump(exclude_unset=True)
    fields: dict[str, Any] = {
        "request_id": request_id,
        "sampling": sampling,
        "speculation": speculation or {},
    }
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    else:
        fields["prompt_ids"] = prompt
    try:
        request = GenerationRequest.model_validate(fields)
    except ValidationError as error:
        raise invalid_request_from_validation(error, field_names) from None
    try:
        return check_generation_request(request, max_prompt_chars)
    except InvalidRequestError as error:
        field = (field_names or {}).get(error.field, error.field)
        raise InvalidRequestError(field, error.message) from None


def to_generation_request(
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    sampling_defaults: dict[str, Any],
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
) -> GenerationRequest:
    """The coordinator request of an HTTP body (chat bodies go through the chat template)."""
    chat = isinstance(body, ChatCompletionRequest)
    prompt = render_chat_prompt(body.messages) if chat else body.prompt
    return build_generation_request(
        request_id=request_id,
        prompt=prompt,
        sampling_defaults=sampling_defaults,
        sampling_overrides=body.sampling_overrides(),
        speculation=body.speculation,
        field_names=_HTTP_CHAT_FIELD_NAMES if chat else _HTTP_FIELD_NAMES,
        max_prompt_chars=max_prompt_chars,
    )


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


def usage_block(stats: RequestStats | None) -> dict[str, int]:
    """OpenAI ``usage`` from the request's stats."""
    prompt_tokens = stats.prompt_tokens if stats else 0
    completion_tokens = stats.completion_tokens if stats else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def speculation_block(stats: RequestStats | None) -> dict[str, Any] | None:
    """The ``speculation`` extension block: every RequestStats field except the token counts."""
    if stats is None:
        return None
    return stats.model_dump(exclude={"prompt_tokens", "completion_tokens"})


class CompletionAccumulator:
    """Collects a chunk stream into the final text, token ids, finish reason and stats."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.stats = chunk.stats

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def completion_response(
    request_id: str, model: str, created: int, result: CompletionAccumulator, chat: bool, token_ids: bool = False
) -> dict:
    """A whole ``text_completion`` or ``chat.completion`` object (``token_ids``: add them to the choice)."""
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "finish_reason": result.finish_reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
    if token_ids:
        choice["token_ids"] = list(result.token_ids)
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_block(result.stats),
        "speculation": speculation_block(result.stats),
    }


def stream_chunk(
    request_id: str,
    model: str,
    created: int,
    chunk: GenerationChunk,
    chat: bool,
    first: bool,
    token_ids: bool = False,
) -> dict:
    """One streamed ``text_completion`` / ``chat.completion.chunk`` object.

    The final chunk (``chunk.finished``) also carries ``usage`` and ``speculation``;
    ``token_ids`` adds the chunk's new token ids to the choice.
    """
    finish_reason = chunk.finish_reason if chunk.finished else None
    if chat:
        delta: dict[str, Any] = {"content": chunk.text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": chunk.text, "finish_reason": finish_reason, "logprobs": None}
    if token_ids:
        choice["token_ids"] = list(chunk.token_ids)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if chunk.finished:
        body["usage"] = usage_block(chunk.stats)
        body["speculation"] = speculation_block(chunk.stats)
    return body


def usage_chunk(request_id: str, model: str, created: int, stats: RequestStats | None, chat: bool) -> dict:
    """The ``stream_options.include_usage`` chunk: empty choices and the usage."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_block(stats),
        "speculation": speculation_block(stats),
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
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionAccumulator",
    "CompletionRequest",
    "SSE_DONE",
    "StreamOptions",
    "build_generation_request",
    "completion_response",
    "error_body",
    "http_field",
    "invalid_request_body",
    "invalid_request_from_validation",
    "models_list",
    "parse_body",
    "render_chat_prompt",
    "speculation_block",
    "sse_event",
    "stream_chunk",
    "to_generation_request",
    "usage_block",
    "usage_chunk",
]
