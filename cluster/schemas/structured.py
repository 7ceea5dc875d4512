"""OpenAI ``response_format``, the ``structured_outputs`` extension and ``tools`` /
``tool_choice`` as :class:`actors.request_schema.StructuredOutput` constraints (:mod:`verifiers.grammar`)."""

from __future__ import annotations

import json
import re
from typing import Any

from actors.request_schema import InvalidRequestError, StructuredOutput
from actors.invalid_request import shortened


def parse_response_format(value: Any) -> StructuredOutput | None:
    """OpenAI ``response_format`` -> the constraint (None for text); InvalidRequestError naming
    the field otherwise (a grammar that does not compile too: :meth:`actors.request_schema.StructuredOutput.checked`)."""
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

