"""The fields ``/v1/completions`` and ``/v1/chat/completions`` share: sampling, streaming,
speculation, predicted and structured outputs, the OpenAI fields accepted and ignored; the
shapes gRPC shares (token-id keys, seeds of ``n`` samples); and body parsing with the HTTP
names of fields (:func:`parse_body`, :func:`http_field`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from actors.request_schema import (
    INT64_MAX,
    InvalidRequestError,
    SpeculationParams,
    StructuredOutput,
)
from actors.invalid_request import invalid_request, shortened
from cluster.schemas.structured import parse_response_format, parse_structured_outputs

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


# ----------------------------------------------------------------------------------------
# Shapes shared with gRPC (cluster/grpc_service/): each raises InvalidRequestError
# ----------------------------------------------------------------------------------------


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")


def parse_token_id_keys(field: str, bias: Mapping[str, float]) -> dict[int, float]:
    """JSON ``logit_bias`` keys (decimal strings) as token ids: ``{int: float}``. The entries'
    count, ids and values are checked by :class:`actors.request_schema.SamplingParams`, and whether the
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


def pydantic_check(check: Callable[..., Any], *args: Any) -> Any:
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
        return text_content(value)


class GenerationFields(BaseModel):
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
        return None if value is None else pydantic_check(parse_token_id_keys, value)

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
        return value  # their number and lengths: actors.request_schema.SamplingParams

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



def text_content(value: Any) -> str:
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


def parse_body(model: type[GenerationFields], raw: bytes) -> GenerationFields:
    """Validate a JSON request body (strict types, then the checks across fields); raise
    :class:`InvalidRequestError`."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as error:
        raise invalid_request(error, model, whole="body") from None
    body.check_fields()
    return body

