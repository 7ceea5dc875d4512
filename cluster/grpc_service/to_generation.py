"""A ``GenerateRequest`` as :class:`~actors.request_schema.GenerationRequest` s, one per choice:
wire types, presence-aware options, the prompt, the client's request id and the choices of
``sampling.n``; every value checked by the constraints of :mod:`actors.request_schema` and named
by its proto path."""

from __future__ import annotations

import re
from typing import Annotated, Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from pydantic import Field

from actors.request_schema import (
    MAX_NAME_CHARS,
    GenerationRequest,
    InvalidRequestError,
    StructuredOutput,
    TopLogprobs,
)
from actors.invalid_request import check_value
from cluster.config import DEFAULT_MAX_PROMPT_CHARS
from cluster.schemas.to_generation import (
    ChoiceSpec,
    build_generation_request,
    check_choices,
    choice_specs,
    sample_request,
)
from cluster.schemas import (
    MAX_CHOICES,
    VLLM_SAMPLING_FIELDS,
    SampleCount,
    check_sample_seeds,
    parse_structured_outputs,
)
from protos import specserve_pb2

#: A client-chosen request id (``request_id``): used in logs and session names.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: The served model a call names (empty: the one served).
ModelName = Annotated[str, Field(max_length=MAX_NAME_CHARS)]

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
    checked by :func:`cluster.schemas.to_generation.build_generation_request`."""
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
