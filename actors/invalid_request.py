"""The error of a bad request value, and pydantic's validation errors turned into it.

:class:`InvalidRequestError` names the field by its dotted path, so the HTTP layer answers 400
and the gRPC layer INVALID_ARGUMENT with a message that names the field. :func:`invalid_request`
turns the first error of validating a request model into one (the field as the client names it,
the message as the client reads it: the bound, the value sent); :func:`check_value` checks one
value against one of the request value types of :mod:`actors.request_schema`.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError


class InvalidRequestError(ValueError):
    """A request parameter is invalid. ``field`` names it (dotted path), so the HTTP layer can
    answer 400 and the gRPC layer INVALID_ARGUMENT with a message that names the field.

    Raised inside a model's validator, ``field`` is relative to that model (a
    :class:`SamplingParams` validator names ``min_tokens``; the request error then names
    ``sampling.min_tokens``, :func:`invalid_request`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):
        # Pickle by (field, message): the default would call cls(str(self)) and fail, so the
        # error could not cross a Ray actor boundary.
        return (type(self), (self.field, self.message))


def shortened(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown(value: Any) -> str:
    """A client's value as an error message quotes it: its JSON, cut to 40 characters."""
    try:
        text = json.dumps(value, default=str)
    except ValueError:  # a value json cannot write (a circular structure)
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bound(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}
_LENGTH_UNITS = {"List": "items", "Dictionary": "entries", "Tuple": "items", "Set": "items"}


def error_message(error: Mapping[str, Any]) -> str:
    """The message of one pydantic error, as clients read it (the bound, the value they sent)."""
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    got = f" (got {_shown(error.get('input'))})"
    if kind in ("value_error", "assertion_error"):
        inner = ctx.get("error")
        if isinstance(inner, InvalidRequestError):
            return inner.message
        message = error["msg"]
        return message[len("Value error, "):] if message.startswith("Value error, ") else message
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "field required"
    if kind == "finite_number":
        return "must be a finite number" + got
    if kind in _BOUNDS:
        key, operator = _BOUNDS[kind]
        return f"must be {operator} {_bound(ctx[key])}{got}"
    if kind in ("too_long", "string_too_long"):
        unit = "characters" if kind.startswith("string") else _LENGTH_UNITS.get(ctx.get("field_type"), "items")
        actual = ctx.get("actual_length") if unit != "characters" else len(error.get("input") or "")
        return f"at most {ctx['max_length']} {unit}" + ("" if actual is None else f" (got {actual})")
    if kind in ("too_short", "string_too_short"):
        if ctx.get("min_length") == 1:
            return "must not be empty"
        unit = "characters" if kind.startswith("string") else _LENGTH_UNITS.get(ctx.get("field_type"), "items")
        return f"at least {ctx['min_length']} {unit}" + got
    if kind in ("model_type", "model_attributes_type"):
        return error["msg"]
    return error["msg"] + got


def _nested(annotation: Any) -> tuple[Any, Any]:
    """What an error location may go into below a field of this annotation: ``("model",
    Model)`` (``Model | None``), ``("items", Model)`` (``list[Model] | None``), ``("keys",
    None)`` (a dict with string keys), else ``(None, None)``."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    for option in options:
        if isinstance(option, type) and issubclass(option, BaseModel):
            return "model", option
        if get_origin(option) is list:
            (item,) = get_args(option) or (None,)
            if isinstance(item, type) and issubclass(item, BaseModel):
                return "items", item
        if get_origin(option) is dict and get_args(option)[:1] == (str,):
            return "keys", None
    return None, None


def _field_path(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field a pydantic error location points at, as the client names it: model fields,
    list indexes of nested models (``messages.0.content``) and string keys (``metadata.k``);
    never an item of a list of values, a numeric key or a union member
    (``speculation.weights``, not ``speculation.weights.3``)."""
    parts: list[str] = []
    below: tuple[Any, Any] = ("model", model)
    for part in loc:
        kind, inner = below
        if kind == "items" and isinstance(part, int):
            parts.append(str(part))
            below = ("model", inner)
        elif kind == "keys" and isinstance(part, str) and part != "[key]":
            parts.append(part)
            break
        elif kind == "model" and isinstance(part, str) and part in inner.model_fields:
            parts.append(part)
            below = _nested(inner.model_fields[part].annotation)
        else:
            break
    return parts


@functools.cache
def _adapter(value_type: Any) -> TypeAdapter:
    return TypeAdapter(value_type)


def check_value(field: str, value_type: Any, value: Any) -> Any:
    """``value`` validated (strictly) as ``value_type`` (one of the value types above), or
    :class:`InvalidRequestError` naming ``field``: for the values a protocol carries outside a
    :class:`GenerationRequest` (gRPC's ``sampling.n``), checked by the same constraints."""
    try:
        return _adapter(value_type).validate_python(value, strict=True)
    except ValidationError as error:
        raise InvalidRequestError(field, error_message(error.errors(include_url=False)[0])) from None


def invalid_request(error: ValidationError, model: type[BaseModel], whole: str = "request",
                    field_names: Mapping[str, str] | None = None) -> InvalidRequestError:
    """The first error of validating ``model`` as an :class:`InvalidRequestError` naming its field
    (dotted path; ``whole`` when it is about the input as a whole). An
    :class:`InvalidRequestError` raised by a validator names its field relative to the model it
    validates. ``field_names`` renames paths to the caller's own (HTTP: ``sampling.temperature``
    -> ``temperature``)."""
    first = error.errors(include_url=False)[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return InvalidRequestError(whole, f"invalid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = tuple(first.get("loc", ()))
    parts = [str(part) for part in loc] if kind == "extra_forbidden" else _field_path(model, loc)
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, InvalidRequestError) and inner.field:
        parts.append(inner.field)
    field = ".".join(parts) or whole
    if field_names:
        field = field_names.get(field, field)
    return InvalidRequestError(field, error_message(first))
