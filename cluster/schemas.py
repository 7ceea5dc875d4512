"""OpenAI-compatible request schemas of the HTTP endpoint, their field checks and parsing.

The HTTP ingress (``cluster/app.py``) parses request bodies with the models below (strict
types, ``extra="forbid"``) through :func:`parse_body`. Every validation failure becomes an
:class:`actors.api.InvalidRequestError` whose ``field`` is the request's own field name
(``temperature``, ``speculation.gamma``), which the ingress answers with HTTP 400 and an
OpenAI-style error body (:func:`cluster.responses.error_body`). A field is checked once: its
JSON type and shape here, its value by the constraints of :mod:`actors.api` (the value types
``SampleCount`` / ``TopLogprobs`` of the fields that stay here, and the
:class:`actors.api.GenerationRequest` every choice becomes), the same ones gRPC uses.

OpenAI fields that are accepted only at their neutral value answer 400 naming the field
otherwise: ``suffix`` (null), ``best_of`` (null or equal to ``n``), ``tools`` / ``functions``
(null or empty), ``tool_choice`` / ``function_call`` (null or ``"none"``). ``response_format``
(text, ``json_object``, ``json_schema``) and the ``structured_outputs`` extension (json, regex,
choice, grammar) constrain the output (:mod:`verifiers.grammar`). Penalties, ``logit_bias``, ``logprobs`` and prompt
log-probabilities (completions ``echo`` with ``logprobs``, ``prompt_logprobs``) map onto
:class:`actors.api.SamplingParams`.

Extensions to the OpenAI schema: ``return_token_ids``; ``top_k``, ``ignore_eos``,
``repetition_penalty``, ``min_p``, ``min_tokens`` (sampling), ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``
(output), ``stream_options.continuous_usage_stats``; ``prompt_logprobs`` (completions per choice, chat per
response and not streamed), ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message`` (chat), as vLLM has them; and ``speculation`` (an object with the
fields of :class:`actors.api.SpeculationParams`; unset fields take the deployment's defaults).

OpenAI fields without a meaning here are accepted and ignored (:data:`IGNORED_OPENAI_FIELDS`:
``store``, ``metadata``, ``service_tier``, ``reasoning_effort``, ``user``); ``modalities`` is
accepted as ``["text"]`` only; ``prediction`` (predicted outputs) is the draft of the request.
Any other field is refused as unknown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from actors.api import (
    INT64_MAX,
    MAX_TOP_LOGPROBS,
    InvalidRequestError,
    SpeculationParams,
    StructuredOutput,
    TopLogprobs,
    check_value,
    invalid_request,
    shortened,
)
from cluster.chat_prompt import check_template_kwargs, render_chat_prompt

#: Most choices one request may ask for (``n`` times the number of prompts); each is its own
#: coordinator request, decoded concurrently.
MAX_CHOICES = 64
#: Samples per prompt (``n``, ``best_of``; gRPC ``sampling.n``).
SampleCount = Annotated[int, Field(ge=1, le=MAX_CHOICES)]

# Sampling fields a request may set; unset ones fall back to the deployment's defaults.
#: vLLM's sampling extensions, copied as they are.
VLLM_SAMPLING_FIELDS: tuple[str, ...] = (
    "min_p", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "truncate_prompt_tokens",
)
SAMPLING_FIELDS: tuple[str, ...] = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs",
    *VLLM_SAMPLING_FIELDS,
)
# The scalar ones that are copied as they are.
_PLAIN_SAMPLING_FIELDS: tuple[str, ...] = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", *VLLM_SAMPLING_FIELDS,
)
#: OpenAI fields accepted and ignored: they have no meaning for this server (no stored
#: completions, no service tiers, no reasoning models).
IGNORED_OPENAI_FIELDS: tuple[str, ...] = ("store", "metadata", "service_tier", "reasoning_effort", "user")

ChatRole = Literal["system", "developer", "user", "assistant"]


# ----------------------------------------------------------------------------------------
# Shapes shared with gRPC (cluster/grpc_service.py): each raises InvalidRequestError
# ----------------------------------------------------------------------------------------


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")


def parse_token_id_keys(field: str, bias: Mapping[str, float]) -> dict[int, float]:
    """JSON ``logit_bias`` keys (decimal strings) as token ids: ``{int: float}``. The entries'
    count, ids and values are checked by :class:`actors.api.SamplingParams`, and whether the
    ids exist in the vocabulary by the coordinator."""
    checked: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequestError(field, f"keys must be token ids (decimal integers >= 0), got {shortened(key)}")
        checked[int(key)] = value
    return checked


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
    continuous_usage_stats: bool = Field(
        False, description="Every chunk also carries its choice's usage so far (vLLM's extension)."
    )


class Prediction(BaseModel):
    """OpenAI ``prediction``: the expected output (an edited file, a template), used as the draft."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Any = Field(..., description='Only "content".')
    content: Any = Field(..., description='The predicted text, or a list of text parts ({"type": "text", "text": ...}).')

    @field_validator("type")
    @classmethod
    def _content_type(cls, value: Any) -> str:
        if value != "content":
            raise ValueError(f'only "content" predictions are supported (got {shortened(value)})')
        return value

    @field_validator("content")
    @classmethod
    def _text(cls, value: Any) -> str:
        return _text_content(value)


class _GenerationFields(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="Served model name (GET /v1/models); optional.")
    max_tokens: int | None = Field(
        None, description="Maximum number of generated tokens (>= 1; 0 scores the prompt alone: completions "
        "with echo and logprobs, or prompt_logprobs)."
    )
    temperature: float | None = Field(None, description="Softmax temperature (>= 0); 0 is greedy.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, description="Keep the k most likely tokens; 0 disables it (extension).")
    seed: int | None = Field(None, description="Seed of the request's random streams (>= 0); sample i uses seed + i.")
    stop: Any = Field(None, description="A stop string or a list of them; output ends before the first match.")
    ignore_eos: bool | None = Field(None, description="Keep generating past the end-of-sequence token (extension).")
    stream: bool | None = Field(False, description="Stream server-sent events (`data: {...}` chunks, then `data: [DONE]`).")
    stream_options: StreamOptions | None = Field(None, description="OpenAI stream options (include_usage).")
    n: SampleCount | None = Field(None, description=f"Independent samples per prompt, 1..{MAX_CHOICES} (default 1).")
    presence_penalty: float | None = Field(None, description="Subtracted from the logit of every token already generated, [-2, 2].")
    frequency_penalty: float | None = Field(None, description="Subtracted once per earlier occurrence of a token, [-2, 2].")
    repetition_penalty: float | None = Field(
        None, description="Divides positive / multiplies negative logits of tokens already seen, (0, 10]; 1 disables (extension)."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    user: str | None = Field(None, description="End-user id (accepted and logged, not used).")
    min_p: float | None = Field(
        None, description="Drop tokens below min_p times the most likely one's probability, in [0, 1] (vLLM's extension)."
    )
    min_tokens: int | None = Field(
        None, description="Generate at least this many tokens before EOS or a stop string ends the output, in "
        "[0, max_tokens] (vLLM's extension)."
    )
    skip_special_tokens: bool | None = Field(None, description="Leave special tokens out of the text (default true).")
    spaces_between_special_tokens: bool | None = Field(
        None, description="With skip_special_tokens false: spaces around special tokens (default true)."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="Keep the stop string that ended the output in the text (default false)."
    )
    truncate_prompt_tokens: int | None = Field(None, description="Keep only the prompt's last this many tokens (>= 1).")
    store: bool | None = Field(None, description="Accepted and ignored: completions are not stored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored (belongs with store).")
    service_tier: str | None = Field(None, description="Accepted and ignored: one tier.")
    reasoning_effort: str | None = Field(None, description="Accepted and ignored: the models do not reason.")
    modalities: list[str] | None = Field(None, description='Output modalities: only ["text"].')
    prediction: Prediction | None = Field(
        None, description='Predicted output {"type": "content", "content": ...}: its tokens are the draft, verified '
        "by the request's rule (output unchanged); usage reports accepted / rejected prediction tokens."
    )
    speculation: SpeculationParams | None = Field(
        None, description="Decoding strategy overrides (extension); unset fields use the deployment defaults."
    )
    return_token_ids: bool | None = Field(
        False, description="Add the generated token ids to each choice as `token_ids` (extension)."
    )
    response_format: Any = Field(
        None, description='OpenAI: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}.'
    )
    structured_outputs: Any = Field(
        None, description='Extension (vLLM): exactly one of {"json": schema}, {"regex": str}, {"choice": [str]}, '
        '{"grammar": Lark grammar}.'
    )

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        return None if value is None else _pydantic_check(parse_token_id_keys, value)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise ValueError(f'only ["text"] is supported (got {shortened(value)})')
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
        return value  # their number and lengths: actors.api.SamplingParams

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

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (``stream_options.continuous_usage_stats``, with ``include_usage`` as vLLM)."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    @property
    def predicted_text(self) -> str | None:
        return None if self.prediction is None else self.prediction.content

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
        structured = self.structured()
        if structured is not None:
            overrides["structured"] = structured
        return overrides

    def structured(self) -> StructuredOutput | None:
        """The output constraint of ``response_format`` / ``structured_outputs`` (at most one)."""
        from_format = parse_response_format(self.response_format)
        from_extension = parse_structured_outputs(self.structured_outputs)
        if from_format is not None and from_extension is not None:
            raise InvalidRequestError("structured_outputs", "conflicts with response_format; set only one")
        return from_format or from_extension


def parse_response_format(value: Any) -> StructuredOutput | None:
    """OpenAI ``response_format`` -> the constraint (None for text); InvalidRequestError naming
    the field otherwise (a grammar that does not compile too: :meth:`actors.api.StructuredOutput.checked`)."""
    field = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError(field, 'must be an object with a "type"')
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise InvalidRequestError(f"{field}.{extra[0]}", "unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.checked("json_object", field=field)
    if kind != "json_schema":
        raise InvalidRequestError(f"{field}.type", f'must be "text", "json_object" or "json_schema" (got {shortened(kind)})')
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{field}.json_schema", 'must be an object {"name", "schema", "strict"}')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise InvalidRequestError(f"{field}.json_schema.{unknown[0]}", "unknown field")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequestError(f"{field}.json_schema.name", "must be a non-empty string")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError(f"{field}.json_schema.strict", "must be a boolean")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{field}.json_schema.schema", "must be a JSON schema object")
    return StructuredOutput.checked("json_schema", schema, f"{field}.json_schema.schema")


#: ``structured_outputs`` keys -> constraint kinds.
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def parse_structured_outputs(value: Any) -> StructuredOutput | None:
    """The ``structured_outputs`` extension (exactly one of json / regex / choice / grammar) ->
    the constraint; InvalidRequestError naming the field otherwise."""
    field = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be an object with one of " + ", ".join(_STRUCTURED_KINDS))
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS))
    if unknown:
        raise InvalidRequestError(f"{field}.{unknown[0]}", "unknown field; one of " + ", ".join(_STRUCTURED_KINDS))
    given = [key for key in _STRUCTURED_KINDS if value.get(key) is not None]
    if len(given) != 1:
        raise InvalidRequestError(field, "set exactly one of " + ", ".join(_STRUCTURED_KINDS))
    key = given[0]
    spec = value[key]
    if key == "json" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise InvalidRequestError(f"{field}.json", "must be a JSON schema (an object or its JSON text)") from None
    if key == "json" and not isinstance(spec, dict):
        raise InvalidRequestError(f"{field}.json", "must be a JSON schema object")
    if key in ("regex", "grammar") and (not isinstance(spec, str) or not spec):
        raise InvalidRequestError(f"{field}.{key}", "must be a non-empty string")
    if key == "choice" and (not isinstance(spec, list) or not spec
                            or not all(isinstance(item, str) and item for item in spec)):
        raise InvalidRequestError(f"{field}.choice", "must be a non-empty list of non-empty strings")
    return StructuredOutput.checked(_STRUCTURED_KINDS[key], spec, f"{field}.{key}")


def parse_tools(value: Any) -> dict[str, dict]:
    """OpenAI ``tools`` -> ``{function name: its parameters schema}`` (in order)."""
    if not isinstance(value, list):
        raise ValueError('must be a list of {"type": "function", "function": {...}}')
    tools: dict[str, dict] = {}
    for index, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"tools[{index}].function.name must be 1-64 letters, digits, _ or -")
        if name in tools:
            raise ValueError(f"tools[{index}]: two tools named {name!r}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{index}].function.parameters must be a JSON schema object")
        tools[name] = parameters
    return tools


def parse_tool_choice(value: Any) -> str:
    """OpenAI ``tool_choice`` -> "none" / "auto" / "required" / the named function."""
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ValueError(f'must be "none", "auto", "required" or a named function (got {shortened(value)})')
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return value["function"]["name"]
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def tool_call_schema(tools: dict[str, dict], call: str) -> dict:
    """The JSON schema of a constrained call: the named function's parameters (the output is its
    arguments), or for ``"required"`` ``{"name": one of the tools, "arguments": its parameters}``."""
    if call != "required":
        return tools[call]
    alternatives = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for name, parameters in tools.items()]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _check_token_ids(ids: list[int], which: str = "") -> None:
    if not ids:  # their values: actors.api.GenerationRequest.prompt_ids
        raise ValueError(f"{which}must not be empty")


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
    best_of: SampleCount | None = Field(None, description="Samples to draw per prompt: only n (or null) is accepted.")
    logprobs: Any = Field(
        None, description=f"Log-probabilities of each generated token with this many alternatives (0..{MAX_TOP_LOGPROBS})."
    )
    prompt_logprobs: TopLogprobs | None = Field(
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

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> int | None:
        """An integer (OpenAI's), or false / null for none."""
        if value is None or value is False:
            return None
        return _pydantic_check(check_value, TopLogprobs, value)

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
        return _text_content(value)


def _text_content(value: Any) -> str:
    """A message's (or prediction's) content: a string, or text parts joined."""
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
    top_logprobs: TopLogprobs | None = Field(
        None, description=f"With logprobs: this many most likely alternatives per token (0..{MAX_TOP_LOGPROBS})."
    )
    prompt_logprobs: TopLogprobs | None = Field(
        None, description="Each prompt token's log-probability with this many alternatives, as the response's "
        f"`prompt_logprobs` (vLLM's extension; 0..{MAX_TOP_LOGPROBS}; not with stream)."
    )
    tools: Any = Field(None, description='Functions the model may call: [{"type": "function", "function": {"name", '
                       '"description", "parameters"}}]. Calls are constrained only with tool_choice "required" or named.')
    tool_choice: Any = Field(None, description='"none" / "auto" (plain text, as without tools), "required" (one call '
                             'of one of the tools) or {"type": "function", "function": {"name"}} (a call of that one).')
    functions: Any = Field(None, description="Function calling is not supported: only null or [] is accepted.")
    function_call: Any = Field(None, description='Only null or "none" is accepted.')
    parallel_tool_calls: bool | None = Field(None, description="Accepted; meaningless without tools.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables of the model's chat template (vLLM's extension), e.g. {\"enable_thinking\": false}."
    )
    add_generation_prompt: bool = Field(
        True, description="Open the assistant's turn after the conversation (the chat template's own argument; vLLM's)."
    )
    continue_final_message: bool = Field(
        False, description="Leave the last (assistant) message open so the output continues it; needs "
        "add_generation_prompt false (vLLM's extension)."
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else _pydantic_check(check_template_kwargs, value)

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: Any) -> None:
        if value is not None and value != []:
            raise ValueError("the legacy functions field is not supported; use tools")
        return None

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> None:
        if value is not None and not _neutral(value, ("none",)):
            raise ValueError('the legacy function_call field is not supported; use tool_choice')
        return None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: Any) -> dict[str, dict] | None:
        return None if value is None else parse_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | None:
        return None if value is None else parse_tool_choice(value)

    def tool_call(self) -> str | None:
        """``"required"``, the named function, or None (no constrained call: plain text)."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if not self.tools:
            raise InvalidRequestError("tool_choice", f"{choice!r} needs tools")
        if choice != "required" and choice not in self.tools:
            raise InvalidRequestError("tool_choice.function.name", f"no tool named {shortened(choice)}")
        return choice

    def structured(self) -> StructuredOutput | None:
        tool_call = self.tool_call()
        if tool_call is None:
            return super().structured()
        if self.response_format not in (None, {"type": "text"}) or self.structured_outputs is not None:
            raise InvalidRequestError("tool_choice", "conflicts with response_format / structured_outputs; set only one")
        return StructuredOutput.checked("json_schema", tool_call_schema(self.tools, tool_call), "tools")

    def prompts(self) -> list[str | list[int]]:
        """The fallback rendering (:func:`cluster.chat_prompt.render_chat_prompt`); the ingress
        renders with the model's chat template instead (``to_generation_requests(chat_prompt=...)``)."""
        return [render_chat_prompt(self.messages)]

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs

    def check_fields(self) -> None:
        super().check_fields()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        if self.prompt_logprobs is not None and self.streaming:  # as vLLM: a response-level field
            raise InvalidRequestError("prompt_logprobs", "not available with stream: true")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError("continue_final_message", "needs add_generation_prompt: false")
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError("continue_final_message", "the last message must be the assistant's")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError("max_completion_tokens", "conflicts with max_tokens; set only one")
        if self.tool_call() is not None and self.streaming:
            raise InvalidRequestError("stream", 'tool_choice "required" or named is answered whole; set stream: false')

    def sampling_overrides(self) -> dict[str, Any]:
        overrides = super().sampling_overrides()
        if self.max_completion_tokens is not None:  # a conflict with max_tokens: check_fields
            overrides["max_tokens"] = self.max_completion_tokens
        return overrides


# GenerationRequest paths -> HTTP field names, for errors raised while building the request.
HTTP_FIELD_NAMES: dict[str, str] = {f"sampling.{name}": name for name in SAMPLING_FIELDS}
HTTP_FIELD_NAMES.update({"prompt_ids": "prompt"})
# Chat requests: the prompt is the rendered conversation.
HTTP_CHAT_FIELD_NAMES: dict[str, str] = {**HTTP_FIELD_NAMES, "prompt": "messages", "prompt_ids": "messages"}


def http_field(error: InvalidRequestError, chat: bool = False) -> InvalidRequestError:
    """The same error with its field named as in the HTTP request (``prompt_ids`` -> ``prompt``,
    ``sampling.temperature`` -> ``temperature``; chat: ``prompt`` -> ``messages``); the
    coordinator names GenerationRequest paths."""
    names = HTTP_CHAT_FIELD_NAMES if chat else HTTP_FIELD_NAMES
    field = names.get(error.field, error.field)
    return error if field == error.field else InvalidRequestError(field, error.message)


def parse_body(model: type[_GenerationFields], raw: bytes) -> _GenerationFields:
    """Validate a JSON request body (strict types, then the checks across fields); raise
    :class:`InvalidRequestError`."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as error:
        raise invalid_request(error, model, whole="body") from None
    body.check_fields()
    return body


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatRole",
    "CompletionRequest",
    "IGNORED_OPENAI_FIELDS",
    "MAX_CHOICES",
    "Prediction",
    "SAMPLING_FIELDS",
    "SampleCount",
    "StreamOptions",
    "check_sample_seeds",
    "http_field",
    "parse_body",
    "parse_token_id_keys",
]
