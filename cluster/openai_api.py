"""OpenAI-compatible request/response schemas of the HTTP endpoint, and their translation.

The HTTP ingress (``cluster/app.py``) parses request bodies with the models below (strict
types, ``extra="forbid"``), turns them into one :class:`actors.api.GenerationRequest` per
choice with :func:`to_generation_requests`, and renders :class:`actors.api.GenerationChunk`
streams back as OpenAI ``text_completion`` / ``chat.completion`` objects (or their
server-sent-event chunks). Every validation failure becomes an
:class:`actors.api.InvalidRequestError` whose ``field`` is the request's own field name
(``temperature``, ``speculation.gamma``), which the ingress answers with HTTP 400 and an
OpenAI-style error body (:func:`error_body`).

Choices: a completions ``prompt`` may be one prompt (a string or a list of token ids) or a
list of them (strings or token-id lists); each prompt gets ``n`` independent samples, and the
choice of sample ``i`` of prompt ``p`` has ``index = p * n + i`` (OpenAI's and vLLM's order).
Every choice is its own coordinator request (:class:`ChoiceSpec`, request id
``<id>-<index>`` when there is more than one); with a ``seed``, sample ``i`` of every prompt
uses ``seed + i``.

OpenAI fields that are accepted only at their neutral value answer 400 naming the field
otherwise: ``suffix`` (null), ``best_of`` (null or equal to ``n``), ``tools`` / ``functions``
(null or empty), ``tool_choice`` / ``function_call`` (null or ``"none"``), ``response_format``
(null or ``{"type": "text"}``), ``echo`` together with ``logprobs`` (the server computes no
prompt log-probabilities). Penalties, ``logit_bias`` and ``logprobs`` map onto
:class:`actors.api.SamplingParams` (the coordinator answers 400 for those its engine does not
support yet).

Extensions to the OpenAI schema:

- ``return_token_ids`` (each choice then carries ``token_ids``);
- ``top_k``, ``ignore_eos``, ``repetition_penalty`` (sampling), and ``speculation`` (an
  object with the fields of :class:`actors.api.SpeculationParams`: strategy, method, gamma,
  num_drafts, ensemble, weights, mu, gammas, members); unset fields take the deployment's
  defaults.
- Responses carry a ``speculation`` block next to ``usage``: the request's
  :class:`actors.api.RequestStats` (accepted lengths, block efficiency, target calls, ...);
  with several choices it is their sum (:func:`merged_speculation`) and each choice carries
  its own.

Chat template (the embedded family has none): each message is rendered as
``"<role>: <content>\\n"`` in order (``developer`` messages as ``system``), and the prompt ends
with ``"assistant:"`` — see :func:`render_chat_prompt`.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from actors.api import (
    MAX_TOP_LOGPROBS,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    RequestStats,
    SpeculationParams,
    TokenLogprob,
)
from cluster.chat_prompt import check_template_kwargs, render_chat_prompt
from cluster.config import DEFAULT_MAX_PROMPT_CHARS
from cluster.validation import INT64_MAX, MAX_STOP_STRINGS, check_generation_request

#: Most choices one request may ask for (``n`` times the number of prompts); each is its own
#: coordinator request, decoded concurrently.
MAX_CHOICES = 64
#: Largest absolute ``presence_penalty`` / ``frequency_penalty`` (OpenAI's range).
MAX_PENALTY = 2.0
#: Largest ``repetition_penalty`` (extension; must be > 0, 1 disables it).
MAX_REPETITION_PENALTY = 10.0
#: Log-probabilities below this (``-inf``: a token the sampling law excludes) are shown as it,
#: as OpenAI and vLLM do (JSON has no infinity).
LOGPROB_FLOOR = -9999.0

# Sampling fields a request may set; unset ones fall back to the deployment's defaults.
SAMPLING_FIELDS: tuple[str, ...] = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs",
)
# The scalar ones that are copied as they are.
_PLAIN_SAMPLING_FIELDS: tuple[str, ...] = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
)

ChatRole = Literal["system", "developer", "user", "assistant"]


# ----------------------------------------------------------------------------------------
# Field checks shared with gRPC (cluster/grpc_service.py): each raises InvalidRequestError
# ----------------------------------------------------------------------------------------


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_n(field: str, value: int) -> int:
    """Number of samples per prompt: 1..MAX_CHOICES."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise InvalidRequestError(field, f"must be an integer in [1, {MAX_CHOICES}] (got {_short(value)})")
    return value


def check_penalty(field: str, value: float) -> float:
    """``presence_penalty`` / ``frequency_penalty``: a finite number in [-2, 2]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise InvalidRequestError(field, f"must be a finite number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (got {_short(value)})")
    return float(value)


def check_repetition_penalty(field: str, value: float) -> float:
    """``repetition_penalty``: a finite number in (0, 10]; 1 disables it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 < value <= MAX_REPETITION_PENALTY:
        raise InvalidRequestError(field, f"must be a finite number in (0, {MAX_REPETITION_PENALTY:g}] (got {_short(value)})")
    return float(value)


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")


def check_logit_bias(field: str, bias: Mapping[Any, Any]) -> dict[int, float]:
    """``logit_bias`` keys as token ids (a decimal string in JSON, an integer in gRPC) and values
    as numbers: ``{int: float}``. The entry count and the values' range are checked with every
    other field by :func:`cluster.validation.check_generation_request`, and whether the ids
    exist in the vocabulary by the coordinator."""
    checked: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str):
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise InvalidRequestError(field, f"keys must be token ids (decimal integers >= 0), got {_short(key)}")
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token_id = key
        else:
            raise InvalidRequestError(field, f"keys must be token ids, got {_short(key)}")
        if not 0 <= token_id <= INT64_MAX:
            raise InvalidRequestError(field, f"token ids must be in [0, {INT64_MAX}] (got {_short(token_id)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(field, f"biases must be numbers (got {_short(value)} for token {token_id})")
        checked[token_id] = float(value)
    return checked


def check_top_logprobs(field: str, value: int) -> int:
    """Number of most likely alternatives per token: 0..MAX_TOP_LOGPROBS."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(field, f"must be an integer in [0, {MAX_TOP_LOGPROBS}] (got {_short(value)})")
    return value


def check_sample_seeds(field: str, seed: int | None, n: int) -> None:
    """With ``n`` samples, sample ``i`` uses ``seed + i``: all of them must fit an int64."""
    if seed is not None and n > 1 and seed + n - 1 > INT64_MAX:
        raise InvalidRequestError(field, f"with n = {n}, seed + n - 1 must be at most {INT64_MAX} (sample i uses seed + i)")


def _pydantic_check(check: Callable[..., Any], *args: Any) -> Any:
    """Run a check inside a pydantic validator: its message becomes the validator's."""
    try:
        return check("", *args)
    except InvalidRequestError as error:
        raise ValueError(error.message) from None


# ----------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------


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
    max_tokens: int | None = Field(
        None, ge=0, description="Maximum number of generated tokens (>= 1; 0 scores the prompt alone: completions "
        "with echo and logprobs, or prompt_logprobs)."
    )
    temperature: float | None = Field(None, ge=0.0, description="Softmax temperature (>= 0); 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens; 0 disables it (extension).")
    seed: int | None = Field(None, ge=0, description="Seed of the request's random streams (>= 0); sample i uses seed + i.")
    stop: Any = Field(None, description="A stop string or a list of them; output ends before the first match.")
    ignore_eos: bool | None = Field(None, description="Keep generating past the end-of-sequence token (extension).")
    stream: bool | None = Field(False, description="Stream server-sent events (`data: {...}` chunks, then `data: [DONE]`).")
    stream_options: StreamOptions | None = Field(None, description="OpenAI stream options (include_usage).")
    n: int | None = Field(None, description=f"Independent samples per prompt, 1..{MAX_CHOICES} (default 1).")
    presence_penalty: float | None = Field(None, description="Subtracted from the logit of every token already generated, [-2, 2].")
    frequency_penalty: float | None = Field(None, description="Subtracted once per earlier occurrence of a token, [-2, 2].")
    repetition_penalty: float | None = Field(
        None, description="Divides positive / multiplies negative logits of tokens already seen, (0, 10]; 1 disables (extension)."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    user: str | None = Field(None, description="End-user id (accepted and logged, not used).")
    speculation: SpeculationParams | None = Field(
        None, description="Decoding strategy overrides (extension); unset fields use the deployment defaults."
    )
    return_token_ids: bool | None = Field(
        False, description="Add the generated token ids to each choice as `token_ids` (extension)."
    )

    @field_validator("n")
    @classmethod
    def _n(cls, value: int | None) -> int | None:
        return None if value is None else _pydantic_check(check_n, value)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        return None if value is None else _pydantic_check(check_penalty, value)

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: float | None) -> float | None:
        return None if value is None else _pydantic_check(check_repetition_penalty, value)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        return None if value is None else _pydantic_check(check_logit_bias, value)

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

    # -- derived values

    @property
    def samples(self) -> int:
        """Samples per prompt (``n``, default 1)."""
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order."""
        raise NotImplementedError

    def logprobs_count(self) -> int | None:
        """``SamplingParams.logprobs``: alternatives per token, or None for no log-probabilities."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: alternatives per prompt token, or None."""
        return None

    def check_fields(self) -> None:
        """Checks across fields (after parsing); raises :class:`InvalidRequestError`."""
        choices = len(self.prompts()) * self.samples
        if choices > MAX_CHOICES:
            raise InvalidRequestError(
                "n", f"n ({self.samples}) times the number of prompts ({len(self.prompts())}) must be at most {MAX_CHOICES}"
            )
        check_sample_seeds("seed", self.seed, self.samples)

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling fields this request set explicitly (the rest use deployment defaults)."""
        overrides = {name: getattr(self, name) for name in _PLAIN_SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.logit_bias is not None:
            overrides["logit_bias"] = dict(self.logit_bias)  # {token id: bias}, keys parsed
        logprobs = self.logprobs_count()
        if logprobs is not None:
            overrides["logprobs"] = logprobs
        prompt_logprobs = self.prompt_logprobs_count()
        if prompt_logprobs is not None:
            overrides["prompt_logprobs"] = prompt_logprobs
        return overrides


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _check_token_ids(ids: list[int], which: str = "") -> None:
    if not ids:
        raise ValueError(f"{which}must not be empty")
    if any(item < 0 for item in ids):
        raise ValueError(f"{which}token ids must be >= 0")


class CompletionRequest(_GenerationFields):
    """Body of ``POST /v1/completions``."""

    prompt: Any = Field(
        ..., description="A prompt (non-empty string or list of token ids) or a list of them (strings or token-id lists)."
    )
    echo: bool | None = Field(
        None, description="Prepend the prompt's text to each choice's text (with logprobs: and the prompt tokens' "
        "log-probabilities to its logprobs, the first one null)."
    )
    suffix: str | None = Field(None, description="Text after the completion (insertion): only null is accepted.")
    best_of: int | None = Field(None, description="Samples to draw per prompt: only n (or null) is accepted.")
    logprobs: Any = Field(
        None, description=f"Log-probabilities of each generated token with this many alternatives (0..{MAX_TOP_LOGPROBS})."
    )
    prompt_logprobs: int | None = Field(
        None, description="Each prompt token's log-probability with this many alternatives, as each choice's "
        f"`prompt_logprobs` (vLLM's extension; 0..{MAX_TOP_LOGPROBS})."
    )

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if isinstance(value, list) and value:
            if _is_token_ids(value):
                _check_token_ids(value)
                return value
            if len(value) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts (got {len(value)})")
            if all(isinstance(item, str) for item in value):
                for index, item in enumerate(value):
                    if not item:
                        raise ValueError(f"prompt {index} must not be empty")
                return value
            if all(_is_token_ids(item) for item in value):
                for index, item in enumerate(value):
                    _check_token_ids(item, f"prompt {index}: ")
                return value
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("not supported by this server (no insertion); send null or leave it out")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"must be an integer in [1, {MAX_CHOICES}] (got {_short(value)})")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> int | None:
        if value is None or value is False:
            return None
        return _pydantic_check(check_top_logprobs, value)

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None) -> int | None:
        return None if value is None else _pydantic_check(check_top_logprobs, value)

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token (``echo`` with ``logprobs``), or None."""
        return self.logprobs if self.echo else None

    def prompt_logprobs_count(self) -> int | None:
        wanted = [count for count in (self.echo_logprobs, self.prompt_logprobs) if count is not None]
        return max(wanted) if wanted else None

    def check_fields(self) -> None:
        super().check_fields()
        if self.best_of is not None and self.best_of != self.samples:
            if self.best_of < self.samples:
                raise InvalidRequestError("best_of", f"must be at least n ({self.samples}), got {self.best_of}")
            raise InvalidRequestError(
                "best_of", f"best_of > n is not supported: every sample is returned (got best_of {self.best_of}, "
                f"n {self.samples}); set it to n or leave it out"
            )


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: ChatRole = Field(..., description="system | developer | user | assistant.")
    content: Any = Field(..., description="Message text, or a list of text parts ({\"type\": \"text\", \"text\": ...}).")
    name: str | None = Field(None, description="Optional author name (not rendered).")

    @field_validator("content")
    @classmethod
    def _text(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            parts = []
            for part in value:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                        and set(part) <= {"type", "text"}):
                    raise ValueError('must be a string or a list of text parts {"type": "text", "text": "..."}; '
                                     "only text is supported")
                parts.append(part["text"])
            return "".join(parts)
        raise ValueError('must be a string or a list of text parts {"type": "text", "text": "..."}')


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value == allowed and type(value) is type(allowed) for allowed in neutral)


class ChatCompletionRequest(_GenerationFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation, oldest first.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer OpenAI clients).")
    logprobs: bool | None = Field(None, description="Return the log-probability of each generated token.")
    top_logprobs: int | None = Field(
        None, description=f"With logprobs: this many most likely alternatives per token (0..{MAX_TOP_LOGPROBS})."
    )
    tools: Any = Field(None, description="Tool calling is not supported: only null or [] is accepted.")
    tool_choice: Any = Field(None, description='Only null or "none" is accepted.')
    functions: Any = Field(None, description="Function calling is not supported: only null or [] is accepted.")
    function_call: Any = Field(None, description='Only null or "none" is accepted.')
    parallel_tool_calls: bool | None = Field(None, description="Accepted; meaningless without tools.")
    response_format: Any = Field(None, description='Only null or {"type": "text"} is accepted.')
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables of the model's chat template (vLLM's extension), e.g. {\"enable_thinking\": false}."
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else _pydantic_check(check_template_kwargs, value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        return None if value is None else _pydantic_check(check_top_logprobs, value)

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: Any) -> None:
        if value is not None and value != []:
            raise ValueError("tool and function calling are not supported by this server")
        return None

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> None:
        if value is not None and not _neutral(value, ("none",)):
            raise ValueError('tool and function calling are not supported by this server; only "none" is accepted')
        return None

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: Any) -> None:
        if value is not None and value != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported (no JSON mode or structured outputs)')
        return None

    def prompts(self) -> list[str | list[int]]:
        """The fallback rendering (:func:`cluster.chat_prompt.render_chat_prompt`); the ingress
        renders with the model's chat template instead (``to_generation_requests(chat_prompt=...)``)."""
        return [render_chat_prompt(self.messages)]

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_fields(self) -> None:
        super().check_fields()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError("max_completion_tokens", "conflicts with max_tokens; set only one")

    def sampling_overrides(self) -> dict[str, Any]:
        overrides = super().sampling_overrides()
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError("max_completion_tokens", "conflicts with max_tokens; set only one")
            overrides["max_tokens"] = self.max_completion_tokens
        return overrides


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
    """Validate a JSON request body (strict types, then the checks across fields); raise
    :class:`InvalidRequestError`."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as error:
        raise invalid_request_from_validation(error) from None
    body.check_fields()
    return body


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


@dataclass(frozen=True)
class ChoiceSpec:
    """One choice of a request: sample ``sample_index`` of prompt ``prompt_index``."""

    index: int  # prompt_index * n + sample_index
    prompt_index: int
    sample_index: int
    prompt: str | list[int]
    request_id: str  # the coordinator request's id


def choice_request_id(request_id: str, index: int, choices: int) -> str:
    """The coordinator request id of choice ``index``: the request's own id when it has one
    choice, else ``<id>-<index>``."""
    return request_id if choices == 1 else f"{request_id}-{index}"


def choice_specs(request_id: str, prompts: Sequence[str | list[int]], n: int) -> list[ChoiceSpec]:
    """The choices of ``prompts`` x ``n`` samples, in index order (``prompt_index * n + sample_index``)."""
    total = len(prompts) * n
    return [
        ChoiceSpec(
            index=p * n + i,
            prompt_index=p,
            sample_index=i,
            prompt=prompt,
            request_id=choice_request_id(request_id, p * n + i, total),
        )
        for p, prompt in enumerate(prompts)
        for i in range(n)
    ]


def sample_request(first: GenerationRequest, spec: ChoiceSpec) -> GenerationRequest:
    """The coordinator request of ``spec``, from ``first`` (sample 0 of the same prompt, already
    validated): its own request id, and seed ``first``'s seed + ``spec.sample_index`` (no seed:
    each sample's is picked by the coordinator). Seeds were checked with
    :func:`check_sample_seeds`."""
    if spec.sample_index == 0:
        return first.model_copy(update={"request_id": spec.request_id})
    sampling = first.sampling
    if sampling.seed is not None:
        sampling = sampling.model_copy(update={"seed": sampling.seed + spec.sample_index})
    return first.model_copy(update={"request_id": spec.request_id, "sampling": sampling})


def check_choices(prompts: int, n: int, max_choices: int, prompt_field: str, n_field: str) -> None:
    """``prompts`` x ``n`` choices must not exceed ``max_choices`` (the deployment's
    ``limits.max_concurrent_requests``, at most :data:`MAX_CHOICES`): every choice of a request
    is decoded at once."""
    if prompts * n > max_choices:
        field = n_field if n > 1 else prompt_field
        raise InvalidRequestError(
            field, f"{prompts} prompt(s) x n = {n} is {prompts * n} choices; this deployment serves at most "
            f"{max_choices} per request (limits.max_concurrent_requests)"
        )


def to_generation_requests(
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    sampling_defaults: dict[str, Any],
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    max_choices: int = MAX_CHOICES,
    chat_prompt: str | list[int] | None = None,
) -> tuple[list[ChoiceSpec], list[GenerationRequest]]:
    """The choices of an HTTP body and their coordinator requests, every one validated; at most
    ``max_choices`` of them. A chat body's prompt is ``chat_prompt`` (:func:`cluster.chat_prompt.chat_prompt`;
    None: the fallback rendering)."""
    chat = isinstance(body, ChatCompletionRequest)
    prompts = [chat_prompt] if chat and chat_prompt is not None else body.prompts()
    check_choices(len(prompts), body.samples, max_choices, "prompt", "n")
    overrides = body.sampling_overrides()
    specs = choice_specs(request_id, prompts, body.samples)
    field_names = _HTTP_CHAT_FIELD_NAMES if chat else _HTTP_FIELD_NAMES
    requests: list[GenerationRequest] = []
    first: GenerationRequest | None = None  # sample 0 of the current prompt
    for spec in specs:
        if spec.sample_index == 0:
            try:
                first = build_generation_request(
                    request_id=spec.request_id,
                    prompt=spec.prompt,
                    sampling_defaults=sampling_defaults,
                    sampling_overrides=overrides,
                    speculation=body.speculation,
                    field_names=field_names,
                    max_prompt_chars=max_prompt_chars,
                )
            except InvalidRequestError as error:
                if len(prompts) > 1 and error.field == "prompt":
                    raise InvalidRequestError("prompt", f"prompt {spec.prompt_index}: {error.message}") from None
                raise
            check_sample_seeds("seed", first.sampling.seed, body.samples)
        assert first is not None
        requests.append(sample_request(first, spec))
    return specs, requests


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
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
) -> dict:
    """A whole ``text_completion`` or ``chat.completion`` object, one choice per accumulator
    (``token_ids``: add them to each choice; ``logprobs``: the token texts of log-probabilities;
    ``generated_logprobs``: render each choice's ``logprobs``, led by the echoed prompt's with
    ``echo_logprobs`` alternatives when set; ``prompt_logprobs``: add each choice's
    ``prompt_logprobs`` with this many alternatives). With several choices each carries its own
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
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": total_usage(results),
        "speculation": merged_speculation(results, wall_s),
    }


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
    not on the final chunk."""

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
    ):
        self.request_id, self.model, self.created, self.chat = request_id, model, created, chat
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
        self._first = False
        return body


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
    "MAX_CHOICES",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceSpec",
    "ChoiceStream",
    "CompletionAccumulator",
    "CompletionRequest",
    "LogprobsRenderer",
    "SSE_DONE",
    "StreamOptions",
    "TokenTexts",
    "build_generation_request",
    "check_choices",
    "check_logit_bias",
    "check_n",
    "check_penalty",
    "check_repetition_penalty",
    "check_sample_seeds",
    "check_top_logprobs",
    "choice_request_id",
    "choice_specs",
    "sample_request",
    "completion_response",
    "error_body",
    "http_field",
    "invalid_request_body",
    "invalid_request_from_validation",
    "merged_speculation",
    "models_list",
    "parse_body",
    "render_chat_prompt",
    "speculation_block",
    "sse_event",
    "stream_chunk",
    "to_generation_requests",
    "total_usage",
    "usage_block",
    "usage_chunk",
]
