"""gRPC side of the Serve ingress: proto <-> GenerationRequest/GenerationChunk, status codes.

Ray Serve's gRPC proxy deserializes ``specserve.GenerateRequest`` with the request
deserializer of the registered service and calls the ingress deployment's method of the same
name as the rpc (``Generate`` / ``GenerateStream``) with the message and a ``grpc_context``.
The service is registered through ``grpc_options.grpc_servicer_functions:
["cluster.grpc_service.add_SpecServeServicer_to_server"]`` (:func:`add_SpecServeServicer_to_server`):
the committed stubs' registration (``protos/specserve_pb2_grpc.py``) with a tolerant request
deserializer. With the stubs' own deserializer, bytes that are not a ``GenerateRequest`` fail
inside grpcio before Serve sees the call, and the client gets ``UNKNOWN`` (``DecodeError``);
:func:`decode_request` instead hands an :class:`UndecodableRequest` to the replica, which
answers ``INVALID_ARGUMENT`` (after the API-key check, like every call).

The ingress methods (``cluster/app.py``) use the functions here:

- :func:`check_wire_types` rejects fields that arrived with the wrong wire type (a client
  built from a different .proto): protobuf keeps such fields as *unknown fields* instead of
  failing, so without this check they would silently take their defaults;
- :func:`to_generation_requests` reads presence-aware options and checks every field by the
  constraints of :mod:`actors.api` (the same ones HTTP uses) and names the bad field (``sampling.temperature``, ``speculation.gamma``) in an
  :class:`InvalidRequestError`; ``sampling.n`` > 1 gives one coordinator request per sample
  (sample ``i`` seeded with ``seed + i``);
- :func:`chunk_to_response` / :func:`final_response` render chunks (tagged with their choice
  ``index``) and results (every choice in ``choices``, choice 0 also in the top-level fields),
  with per-token log-probabilities when ``sampling.logprobs`` is set;
- :func:`grpc_field` names a coordinator error's field by its proto path.

Status codes (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, INTERNAL) are chosen by the ingress
(``cluster.app``) and set on Serve's ``grpc_context``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import Field

from actors.api import (
    MAX_NAME_CHARS,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    RequestStats,
    StructuredOutput,
    TokenLogprob,
    TopLogprobs,
    check_value,
)
from cluster.config import DEFAULT_MAX_PROMPT_CHARS
from cluster.generation_requests import (
    ChoiceSpec,
    build_generation_request,
    check_choices,
    choice_specs,
    sample_request,
)
from cluster.responses import CompletionAccumulator, TokenTexts, merged_speculation, prediction_details, total_usage
from cluster.schemas import (
    MAX_CHOICES,
    VLLM_SAMPLING_FIELDS,
    SampleCount,
    check_sample_seeds,
    parse_structured_outputs,
)
from protos import specserve_pb2, specserve_pb2_grpc

#: The servicer registration function for ``grpc_options.grpc_servicer_functions``.
SERVICER_REGISTRATION = "cluster.grpc_service.add_SpecServeServicer_to_server"
#: A client-chosen request id (``request_id``): used in logs and session names.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: The served model a call names (empty: the one served).
ModelName = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


@dataclass(frozen=True)
class UndecodableRequest:
    """What the replica receives instead of a ``GenerateRequest`` whose bytes did not parse
    (plain data: Serve's proxy pickles it to the replica)."""

    size: int
    reason: str


def decode_request(data: bytes) -> specserve_pb2.GenerateRequest | UndecodableRequest:
    """``GenerateRequest.FromString`` that never raises: bytes that do not parse (corrupt or
    truncated wire data, invalid UTF-8 in a string field) become an :class:`UndecodableRequest`."""
    try:
        return specserve_pb2.GenerateRequest.FromString(data)
    except (DecodeError, ValueError, TypeError, RuntimeError) as error:
        return UndecodableRequest(size=len(data), reason=type(error).__name__)


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_deserializer == specserve_pb2.GenerateRequest.FromString:
        return handler._replace(request_deserializer=decode_request)
    return handler


class _TolerantDecodingServer:
    """Forwards a servicer registration to ``server`` with :func:`decode_request` as the
    request deserializer of every handler that used ``GenerateRequest.FromString``."""

    def __init__(self, server: Any):
        self._server = server

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[Any]) -> None:
        rebuilt = []
        for handler in generic_rpc_handlers:
            method_handlers = getattr(handler, "_method_handlers", None)
            if method_handlers is None:  # not a grpc.method_handlers_generic_handler: keep as is
                rebuilt.append(handler)
                continue
            service = handler.service_name()
            methods = {path.rsplit("/", 1)[-1]: _tolerant(h) for path, h in method_handlers.items()}
            rebuilt.append(grpc.method_handlers_generic_handler(service, methods))
        self._server.add_generic_rpc_handlers(tuple(rebuilt))

    def add_registered_method_handlers(self, service_name: str, method_handlers: Mapping[str, Any]) -> None:
        register = getattr(self._server, "add_registered_method_handlers", None)
        if register is not None:
            register(service_name, {name: _tolerant(handler) for name, handler in method_handlers.items()})


def add_SpecServeServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - grpc naming
    """Register the ``specserve.SpecServe`` service exactly as the committed stubs do
    (``protos.specserve_pb2_grpc.add_SpecServeServicer_to_server``), but with
    :func:`decode_request` as the request deserializer."""
    specserve_pb2_grpc.add_SpecServeServicer_to_server(servicer, _TolerantDecodingServer(server))

_WIRE_TYPE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group start", 4: "group end", 5: "32-bit"}
_SAMPLING_SCALARS: tuple[str, ...] = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", *VLLM_SAMPLING_FIELDS,
)
#: Sampling fields the coordinator may name without the ``sampling.`` prefix.
_BARE_SAMPLING_FIELDS: frozenset[str] = frozenset(_SAMPLING_SCALARS) | {"stop", "logit_bias", "logprobs", "prompt_logprobs"}
_SPECULATION_SCALARS: tuple[str, ...] = (
    "strategy", "method", "gamma", "gamma_max", "num_drafts", "ensemble", "mu", "proposer", "prompt_lookup_max",
    "prompt_lookup_min",
)
_SPECULATION_LISTS: tuple[str, ...] = ("weights", "gammas", "members")


def check_wire_types(message: Message, prefix: str = "") -> None:
    """Raise :class:`InvalidRequestError` if ``message`` (or a set sub-message) has unknown fields.

    A field sent with a wire type that does not match the .proto (e.g. ``max_tokens`` as a
    string) is stored by protobuf as an unknown field with the same number; the error names
    the field. Numbers the .proto does not define are reported as unknown fields.
    """
    fields_by_number = message.DESCRIPTOR.fields_by_number
    for unknown in UnknownFieldSet(message):
        field = fields_by_number.get(unknown.field_number)
        wire = _WIRE_TYPE_NAMES.get(unknown.wire_type, str(unknown.wire_type))
        if field is None:
            raise InvalidRequestError(f"{prefix}#{unknown.field_number}", f"unknown field number {unknown.field_number}")
        raise InvalidRequestError(
            f"{prefix}{field.name}", f"wrong type: sent as {wire}, expected {_proto_type_name(field)}"
        )
    for field, value in message.ListFields():
        if field.message_type is not None and not _is_map(field):
            values = value if _is_repeated(field) else [value]
            for item in values:
                check_wire_types(item, prefix=f"{prefix}{field.name}.")


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)


def _is_map(field: Any) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _proto_type_name(field: Any) -> str:
    names = {
        field.TYPE_DOUBLE: "double",
        field.TYPE_FLOAT: "float",
        field.TYPE_INT64: "int64",
        field.TYPE_INT32: "int32",
        field.TYPE_UINT64: "uint64",
        field.TYPE_UINT32: "uint32",
        field.TYPE_BOOL: "bool",
        field.TYPE_STRING: "string",
        field.TYPE_BYTES: "bytes",
        field.TYPE_MESSAGE: "message",
    }
    name = names.get(field.type, "value")
    return f"repeated {name}" if _is_repeated(field) else name


def grpc_field(error: InvalidRequestError) -> InvalidRequestError:
    """The same error with its field named as in ``GenerateRequest`` (``max_tokens`` ->
    ``sampling.max_tokens``); the coordinator names some sampling fields without the prefix."""
    if error.field in _BARE_SAMPLING_FIELDS:
        return InvalidRequestError(f"sampling.{error.field}", error.message)
    return error


def _set_scalars(message: Message, names: tuple[str, ...]) -> dict[str, Any]:
    """The ``optional`` scalar fields that the client set (proto3 presence)."""
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def sampling_overrides(request: specserve_pb2.GenerateRequest) -> dict[str, Any]:
    """The sampling options the client set explicitly (``n`` aside: see :func:`samples`), with
    ``logprobs`` / ``top_logprobs`` mapped onto ``SamplingParams.logprobs``; the values are
    checked by :func:`cluster.generation_requests.build_generation_request`."""
    if not request.HasField("sampling"):
        return {}
    sampling = request.sampling
    overrides = _set_scalars(sampling, _SAMPLING_SCALARS)
    if sampling.stop:
        overrides["stop"] = list(sampling.stop)
    if sampling.logit_bias:
        overrides["logit_bias"] = dict(sampling.logit_bias)
    top = None
    if sampling.HasField("top_logprobs"):
        top = check_value("sampling.top_logprobs", TopLogprobs, sampling.top_logprobs)
    if sampling.logprobs:
        overrides["logprobs"] = top or 0
    elif top:
        raise InvalidRequestError("sampling.top_logprobs", "needs logprobs: true")
    if sampling.HasField("prompt_logprobs"):
        overrides["prompt_logprobs"] = sampling.prompt_logprobs
    if sampling.HasField("structured_outputs"):
        overrides["structured"] = structured_output(sampling.structured_outputs)
    return overrides


def structured_output(message: specserve_pb2.StructuredOutputs) -> StructuredOutput:
    """``sampling.structured_outputs`` -> the constraint (exactly one field set); the errors name
    ``sampling.structured_outputs.<field>``."""
    field = "sampling.structured_outputs"
    given = {name: getattr(message, name) for name in ("json", "regex", "grammar", "json_object")
             if message.HasField(name)}
    if message.choice:
        given["choice"] = list(message.choice)
    if given.get("json_object") is False:
        del given["json_object"]
    if len(given) != 1:
        raise InvalidRequestError(field, "set exactly one of json, json_object, regex, choice, grammar")
    (name, value), = given.items()
    if name == "json_object":
        return StructuredOutput.checked("json_object", field=f"{field}.json_object")
    try:
        parsed = parse_structured_outputs({name: value})
    except InvalidRequestError as error:
        raise InvalidRequestError(f"sampling.{error.field}", error.message) from None
    return parsed.model_copy(update={"field": f"sampling.{parsed.field}"})


def samples(request: specserve_pb2.GenerateRequest) -> int:
    """``sampling.n`` (checked), 1 when unset."""
    if request.HasField("sampling") and request.sampling.HasField("n"):
        return check_value("sampling.n", SampleCount, request.sampling.n)
    return 1


def speculation_overrides(request: specserve_pb2.GenerateRequest) -> dict[str, Any]:
    """The speculation options the client set explicitly."""
    if not request.HasField("speculation"):
        return {}
    overrides = _set_scalars(request.speculation, _SPECULATION_SCALARS)
    if request.speculation.HasField("gamma_auto") and request.speculation.gamma_auto:
        if "gamma" in overrides:
            raise InvalidRequestError("speculation.gamma_auto", "set either gamma or gamma_auto, not both")
        overrides["gamma"] = "auto"
    for name in _SPECULATION_LISTS:
        values = list(getattr(request.speculation, name))
        if values:
            overrides[name] = values
    return overrides


def request_prompt(request: specserve_pb2.GenerateRequest) -> str | list[int]:
    """Exactly one of ``prompt`` / ``prompt_ids`` (its value is checked with the other fields);
    raises :class:`InvalidRequestError`."""
    has_text = request.HasField("prompt")
    has_ids = len(request.prompt_ids) > 0
    if has_text and has_ids:
        raise InvalidRequestError("prompt", "set exactly one of prompt and prompt_ids, not both")
    if not has_text and not has_ids:
        raise InvalidRequestError("prompt", "field required (set prompt or prompt_ids)")
    return list(request.prompt_ids) if has_ids else request.prompt


def check_decoded(request: Any) -> specserve_pb2.GenerateRequest:
    """``request`` if it is a decoded ``GenerateRequest``; raises :class:`InvalidRequestError`
    for the :class:`UndecodableRequest` of bytes that did not parse."""
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(
            "request", f"the {request.size} bytes received are not a valid specserve.GenerateRequest ({request.reason})"
        )
    if not isinstance(request, specserve_pb2.GenerateRequest):
        raise InvalidRequestError("request", f"expected a specserve.GenerateRequest, got {type(request).__name__}")
    return request


def check_request_id(field: str, value: str) -> str:
    """A client-chosen request id: 1-128 characters of ``A-Z a-z 0-9 . _ : -``."""
    if not REQUEST_ID_PATTERN.fullmatch(value):
        raise InvalidRequestError(field, "must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'")
    return value


def client_request_id(request: specserve_pb2.GenerateRequest) -> str | None:
    """The client's ``request_id`` when it set one (validated), else None."""
    if not request.request_id:
        return None
    return check_request_id("request_id", request.request_id)


def to_generation_requests(
    request: specserve_pb2.GenerateRequest,
    request_id: str,
    sampling_defaults: dict[str, Any],
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    max_choices: int = MAX_CHOICES,
) -> tuple[list[ChoiceSpec], list[GenerationRequest]]:
    """The choices of a gRPC ``GenerateRequest`` (``sampling.n`` samples of its prompt, at most
    ``max_choices``) and their coordinator requests, every field checked first; raises
    :class:`InvalidRequestError`."""
    check_wire_types(request)
    check_value("model", ModelName, request.model)
    prompt = request_prompt(request)
    overrides = sampling_overrides(request)
    n = samples(request)
    check_choices(1, n, max_choices, "prompt", "sampling.n")
    specs = choice_specs(request_id, [prompt], n)
    first = build_generation_request(
        request_id=specs[0].request_id,
        prompt=prompt,
        sampling_defaults=sampling_defaults,
        sampling_overrides=overrides,
        speculation=speculation_overrides(request),
        max_prompt_chars=max_prompt_chars,
        prediction=request.prediction if request.HasField("prediction") else None,
    )
    check_sample_seeds("sampling.seed", first.sampling.seed, n)
    return specs, [sample_request(first, spec) for spec in specs]


def stats_to_proto(stats: RequestStats | None) -> tuple[specserve_pb2.Usage, specserve_pb2.SpeculationStats]:
    """``usage`` and ``speculation`` messages of the final response."""
    if stats is None:
        return specserve_pb2.Usage(), specserve_pb2.SpeculationStats()
    usage = specserve_pb2.Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
        **(prediction_details([stats]) or {}),
    )
    speculation = specserve_pb2.SpeculationStats(
        strategy=stats.strategy,
        method=stats.method or "",
        target_calls=stats.target_calls,
        model_calls=dict(stats.model_calls),
        accepted_lengths=list(stats.accepted_lengths),
        draft_lengths=list(stats.draft_lengths),
        proposer=stats.proposer or "",
        block_efficiency=stats.block_efficiency,
        tokens_per_second=stats.tokens_per_second,
        time_draft_s=stats.time_draft_s,
        time_target_s=stats.time_target_s,
        time_verify_s=stats.time_verify_s,
        time_coordination_s=stats.time_coordination_s,
        bytes_moved=stats.bytes_moved,
        proposed_tokens=dict(stats.proposed_tokens),
        accepted_proposed=dict(stats.accepted_proposed),
    )
    return usage, speculation


def usage_to_proto(usage: dict[str, Any]) -> specserve_pb2.Usage:
    """An HTTP ``usage`` object (:func:`cluster.responses.total_usage`) as a message: the
    prediction details flattened into it."""
    flat = {name: value for name, value in usage.items() if name != "completion_tokens_details"}
    return specserve_pb2.Usage(**flat, **usage.get("completion_tokens_details", {}))


def speculation_to_proto(block: dict[str, Any] | None) -> specserve_pb2.SpeculationStats:
    """A ``speculation`` block (:func:`cluster.responses.merged_speculation`) as a message."""
    if block is None:
        return specserve_pb2.SpeculationStats()
    fields = specserve_pb2.SpeculationStats.DESCRIPTOR.fields_by_name
    values = {name: value for name, value in block.items() if name in fields and value is not None}
    return specserve_pb2.SpeculationStats(**values)


def logprobs_to_proto(entries: list[TokenLogprob] | None, texts: TokenTexts | None) -> list[specserve_pb2.TokenLogprob]:
    """Per-token log-probabilities as messages (token text and bytes when ``texts`` is given)."""

    def shown(token_id: int) -> dict[str, Any]:
        return {} if texts is None else {"token": texts.text_of(token_id), "bytes": texts.bytes_of(token_id)}

    return [
        specserve_pb2.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top_logprobs=[specserve_pb2.TopLogprob(token_id=token_id, logprob=logprob, **shown(token_id))
                          for token_id, logprob in entry.top],
            **shown(entry.token_id),
            **({} if entry.rank is None else {"rank": entry.rank}),
        )
        for entry in entries or ()
    ]


def chunk_to_response(
    chunk: GenerationChunk,
    model: str,
    *,
    index: int = 0,
    request_id: str | None = None,
    texts: TokenTexts | None = None,
) -> specserve_pb2.GenerateResponse:
    """One streamed message of choice ``index``; a choice's final one carries finish_reason,
    usage and speculation stats (that choice's). ``request_id``: the request's id (default: the
    chunk's, which is the request's when it has one choice)."""
    response = specserve_pb2.GenerateResponse(
        request_id=request_id or chunk.request_id,
        model=model,
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        finished=chunk.finished,
        finish_reason=(chunk.finish_reason or "") if chunk.finished else "",
        index=index,
        logprobs=logprobs_to_proto(chunk.logprobs, texts),
        prompt_logprobs=logprobs_to_proto(chunk.prompt_logprobs, texts),
    )
    if chunk.finished:
        usage, speculation = stats_to_proto(chunk.stats)
        response.usage.CopyFrom(usage)
        response.speculation.CopyFrom(speculation)
    return response


def final_response(
    request_id: str,
    model: str,
    result: CompletionAccumulator | list[CompletionAccumulator],
    texts: TokenTexts | None = None,
    wall_s: float | None = None,
) -> specserve_pb2.GenerateResponse:
    """The unary ``Generate`` response: every choice in ``choices``; choice 0's text, token ids,
    finish reason and log-probabilities also in the top-level fields; the usage of all choices
    and their :func:`cluster.responses.merged_speculation` stats."""
    results = [result] if isinstance(result, CompletionAccumulator) else list(result)
    choices = []
    for item in results:
        usage, speculation = stats_to_proto(item.stats)
        choices.append(specserve_pb2.Choice(
            index=item.index,
            text=item.text,
            token_ids=item.token_ids,
            finish_reason=item.finish_reason or "",
            logprobs=logprobs_to_proto(item.logprobs, texts),
            prompt_logprobs=logprobs_to_proto(item.prompt_logprobs, texts),
            usage=usage,
            speculation=speculation,
        ))
    first = choices[0]
    return specserve_pb2.GenerateResponse(
        request_id=request_id,
        model=model,
        text=first.text,
        token_ids=first.token_ids,
        finished=True,
        finish_reason=first.finish_reason,
        usage=usage_to_proto(total_usage(results)),
        speculation=speculation_to_proto(merged_speculation(results, wall_s)),
        index=0,
        logprobs=first.logprobs,
        prompt_logprobs=first.prompt_logprobs,
        choices=choices,
    )


def wants_logprobs(request: GenerationRequest) -> bool:
    """Whether the request asked for per-token log-probabilities (of its output or its prompt)."""
    return request.sampling.logprobs is not None or request.sampling.prompt_logprobs is not None


__all__ = [
    "SERVICER_REGISTRATION",
    "UndecodableRequest",
    "add_SpecServeServicer_to_server",
    "check_decoded",
    "check_request_id",
    "check_wire_types",
    "client_request_id",
    "decode_request",
    "chunk_to_response",
    "final_response",
    "grpc_field",
    "logprobs_to_proto",
    "request_prompt",
    "samples",
    "sampling_overrides",
    "speculation_overrides",
    "speculation_to_proto",
    "stats_to_proto",
    "to_generation_requests",
    "wants_logprobs",
]
