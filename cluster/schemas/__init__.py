"""OpenAI-compatible request schemas of the HTTP endpoint, their field checks and parsing.

The HTTP ingress (``cluster/serving/ingress.py``) parses request bodies with the models of this package
(strict types, ``extra="forbid"``) through :func:`parse_body`: the fields both endpoints share
(:mod:`cluster.schemas.fields`), each endpoint's own (:mod:`cluster.schemas.completions`,
:mod:`cluster.schemas.chat`) and the output constraints (:mod:`cluster.schemas.structured`).
Every validation failure becomes an :class:`actors.request_schema.InvalidRequestError` whose ``field`` is
the request's own field name (``temperature``, ``speculation.gamma``), which the ingress answers
with HTTP 400 and an OpenAI-style error body (:func:`cluster.responses.error_body`). A field is checked once: its
JSON type and shape here, its value by the constraints of :mod:`actors.request_schema` (the value types
``SampleCount`` / ``TopLogprobs`` of the fields that stay here, and the
:class:`actors.request_schema.GenerationRequest` every choice becomes), the same ones gRPC uses.

OpenAI fields that are accepted only at their neutral value answer 400 naming the field
otherwise: ``suffix`` (null), ``best_of`` (null or equal to ``n``), ``tools`` / ``functions``
(null or empty), ``tool_choice`` / ``function_call`` (null or ``"none"``). ``response_format``
(text, ``json_object``, ``json_schema``) and the ``structured_outputs`` extension (json, regex,
choice, grammar) constrain the output (:mod:`verifiers.grammar`). Penalties, ``logit_bias``, ``logprobs`` and prompt
log-probabilities (completions ``echo`` with ``logprobs``, ``prompt_logprobs``) map onto
:class:`actors.request_schema.SamplingParams`.

Extensions to the OpenAI schema: ``return_token_ids``; ``top_k``, ``ignore_eos``,
``repetition_penalty``, ``min_p``, ``min_tokens`` (sampling), ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``
(output), ``stream_options.continuous_usage_stats``; ``prompt_logprobs`` (completions per choice, chat per
response and not streamed), ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message`` (chat), as vLLM has them; and ``speculation`` (an object with the
fields of :class:`actors.request_schema.SpeculationParams`; unset fields take the deployment's defaults).

OpenAI fields without a meaning here are accepted and ignored (:data:`IGNORED_OPENAI_FIELDS`:
``store``, ``metadata``, ``service_tier``, ``reasoning_effort``, ``user``); ``modalities`` is
accepted as ``["text"]`` only; ``prediction`` (predicted outputs) is the draft of the request.
Any other field is refused as unknown.

Beside the schemas: the chat template's rendering of a conversation (:mod:`cluster.schemas.chat_prompt`)
and a parsed body's choices as generation requests (:mod:`cluster.schemas.to_generation`, which gRPC
shares); neither is re-exported here.
"""

from cluster.schemas.chat import ChatCompletionRequest, ChatMessage, ChatRole
from cluster.schemas.completions import CompletionRequest
from cluster.schemas.fields import (
    HTTP_CHAT_FIELD_NAMES,
    HTTP_FIELD_NAMES,
    IGNORED_OPENAI_FIELDS,
    MAX_CHOICES,
    SAMPLING_FIELDS,
    VLLM_SAMPLING_FIELDS,
    Prediction,
    SampleCount,
    StreamOptions,
    check_sample_seeds,
    http_field,
    parse_body,
    parse_token_id_keys,
)
from cluster.schemas.structured import (
    parse_response_format,
    parse_structured_outputs,
    parse_tool_choice,
    parse_tools,
    tool_call_schema,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatRole",
    "CompletionRequest",
    "HTTP_CHAT_FIELD_NAMES",
    "HTTP_FIELD_NAMES",
    "IGNORED_OPENAI_FIELDS",
    "MAX_CHOICES",
    "Prediction",
    "SAMPLING_FIELDS",
    "SampleCount",
    "StreamOptions",
    "VLLM_SAMPLING_FIELDS",
    "check_sample_seeds",
    "http_field",
    "parse_body",
    "parse_response_format",
    "parse_structured_outputs",
    "parse_token_id_keys",
    "parse_tool_choice",
    "parse_tools",
    "tool_call_schema",
]
