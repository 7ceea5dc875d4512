"""The configuration reference, ``docs/configuration.md``, generated from the pydantic models.

    python -m cluster.config.reference > docs/configuration.md

Every setting is declared once, with its default, bounds and description, in the pydantic models
that validate it: the application ``args`` of a Ray Serve YAML file (:class:`cluster.config.SpecServeArgs`
and the sections it holds), the ``speculation`` object of a request
(:class:`actors.request_schema.SpeculationParams`) and the ``speculation`` statistics of a response
(:class:`actors.request_schema.RequestStats`). The HTTP and gRPC request fields, whose accepted ranges are
checked outside their schemas, are tabulated in ``docs/serving.md``. This module walks those
models and prints one table per section, a row per field (its key without the section's prefix);
``tests/cluster/config/test_reference.py`` fails when the committed page differs from what it
prints, or when a field has no description.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from actors.request_schema import RequestStats, SpeculationParams
from cluster.config import SpecServeArgs
from cluster.config.base import Accepts

REGENERATE = "python -m cluster.config.reference > docs/configuration.md"


@dataclass(frozen=True)
class Row:
    """One field of a section: its key as the YAML or the request spells it, and what the model says."""

    key: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    """A table of the reference: the fields of one model (nested models get sections of their own)."""

    title: str
    summary: str
    rows: tuple[Row, ...]
    prefix: str = ""  # the dotted key of the section (``engine.``); its rows print without it
    show_defaults: bool = True  # False for a request's fields (unset: the deployment's) and a response's


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for m in map(_model_in, typing.get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def _mapped_model(annotation: object) -> type[BaseModel] | None:
    """``V`` when the annotation is ``dict[str, V]`` with ``V`` a pydantic model, else None."""
    if typing.get_origin(annotation) is dict:
        return _model_in(typing.get_args(annotation)[1])
    return None


def type_name(annotation: object) -> str:
    """How the reference spells a field's type (YAML / JSON words: integer, number, string, ...)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        accepts = [item.text for item in args[1:] if isinstance(item, Accepts)]
        return accepts[0] if accepts else type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(value) for value in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    names = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null", typing.Any: "any"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _number(value: object) -> str:
    """A bound as the reference prints it: ``0.0`` as ``0``, ``0.5`` as ``0.5``."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _range(low: tuple[str, object] | None, high: tuple[str, object] | None) -> str:
    """``1..32`` for inclusive bounds on both sides, else ``>= 0``, ``> 0, <= 86400``."""
    if low and high and low[0] == ">=" and high[0] == "<=":
        return f"{_number(low[1])}..{_number(high[1])}"
    return ", ".join(f"{bound[0]} {_number(bound[1])}" for bound in (low, high) if bound)


def _bounds(field: FieldInfo) -> str:
    """The field's numeric and length bounds, e.g. ``1..32``, ``>= 0``, ``length <= 64``."""
    low = high = length_low = length_high = None
    for item in field.metadata:
        for kind, symbol, attribute in ((annotated_types.Ge, ">=", "ge"), (annotated_types.Gt, ">", "gt")):
            if isinstance(item, kind):
                low = (symbol, getattr(item, attribute))
        for kind, symbol, attribute in ((annotated_types.Le, "<=", "le"), (annotated_types.Lt, "<", "lt")):
            if isinstance(item, kind):
                high = (symbol, getattr(item, attribute))
        if isinstance(item, annotated_types.MinLen):
            length_low = (">=", item.min_length)
        if isinstance(item, annotated_types.MaxLen):
            length_high = ("<=", item.max_length)
    words = [_range(low, high)] if low or high else []
    words += [f"length {_range(length_low, length_high)}"] if length_low or length_high else []
    return ", ".join(words)


def _yaml_value(value: object) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, (dict, list, tuple)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def default_text(field: FieldInfo) -> str:
    """The field's default (``required`` when it has none)."""
    if field.default_factory is not None:
        return _yaml_value(field.default_factory())
    if field.default is PydanticUndefined:
        return "required"
    return _yaml_value(field.default)


def _cell(text: str) -> str:
    """Text that stays inside one table cell: one line, ``|`` escaped, and a ``<`` that opens a tag
    outside code spans escaped so that a placeholder such as ``embedded:<name>`` is not read as
    HTML (``<= 32`` stays as it is)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", part) for i, part in enumerate(parts))


def _row(key: str, field: FieldInfo) -> Row:
    """A field's row; a field whose default is null prints its type without ``| null`` (the default says it)."""
    bounds = _bounds(field)
    default = default_text(field)
    type_text = type_name(field.annotation)
    if default == "null" and type_text.endswith(" | null"):
        type_text = type_text.removesuffix(" | null")
    type_text += (", " if bounds.startswith("length") else " ") + bounds if bounds else ""
    return Row(key=key, type=type_text, default=default, description=field.description or "")


def model_sections(model: type[BaseModel], title: str, prefix: str, summary: str = "") -> Iterator[Section]:
    """The section of ``model``'s own fields, then one section per nested model (depth first).

    ``prefix`` is the dotted key of the model (``engine.``); a field holding a model is a section of
    its own, a field mapping names to models (``models``) a section keyed ``<name>``."""
    rows: list[Row] = []
    nested: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = _model_in(field.annotation)
        mapped = _mapped_model(field.annotation)
        if inner is not None and inner is not model:
            nested.append((key, inner, field.description or ""))
            continue
        if mapped is not None:
            nested.append((f"{key}.<name>", mapped, field.description or ""))
            continue
        rows.append(_row(f"`{key}`", field))
    yield Section(title=title, summary=summary or (model.__doc__ or "").strip().split("\n\n")[0], rows=tuple(rows),
                  prefix=prefix)
    for key, inner, description in nested:
        yield from model_sections(inner, f"`{key}`", f"{key}.", description)


DEFAULTS_TITLE = "`defaults`"
REQUEST_TITLE = "Request: `speculation`"


def all_sections() -> list[Section]:
    """Every section of the reference, in page order."""
    sections = list(model_sections(SpecServeArgs, "Application `args`", ""))
    request = model_sections(SpeculationParams, REQUEST_TITLE, "speculation.")
    response = model_sections(RequestStats, "Response: `speculation` statistics", "speculation.")
    sections += [dataclasses.replace(section, show_defaults=False) for section in (*request, *response)]
    return sections


HEADER = f"""# Configuration reference

Generated from the pydantic models that validate each setting (`{REGENERATE}`; a test fails
when this page is stale).

A deployment is a Ray Serve config file ([examples](serving.md#deployment-files)); Ray Serve's keys
around specserve's `args`:

| key | what |
| --- | --- |
| `http_options: {{host, port}}` | the HTTP proxy's address (`specserve serve`: `127.0.0.1:8000`) |
| `grpc_options: {{port, grpc_servicer_functions}}` | the gRPC proxy's port (every interface); servicer \
`cluster.grpc_service.add_SpecServeServicer_to_server` |
| `proxy_location` | `HeadOnly`, or `EveryNode`: an HTTP proxy on every node |
| `applications[].name`, `route_prefix` | the `model` id; HTTP routes by prefix, gRPC by the `application` metadata key |
| `applications[].import_path` | `cluster.app:build_app` |
| `applications[].deployments: [{{name: SpecServeIngress, num_replicas}}]` | a replica is a model group; \
`autoscaling_config` scales groups |

Each application's `args` holds the sections below (`engine: {{max_model_len: 8192}}`). Null
default: unset; an unknown key or bad value stops the deployment, naming the key. A request's unset
`speculation` fields come from `args.defaults`; sampling fields: [serving.md](serving.md#http-api).
"""


def _short_key(key: str, prefix: str) -> str:
    """A row's key without its section's prefix (the section's title names it): ``engine.overlap``
    prints as ``overlap`` under ``engine``."""
    return key.replace(f"`{prefix}", "`", 1) if prefix else key


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table without padding (the page is read rendered), then a blank line."""
    return ["|" + "|".join(head) + "|", "|" + "---|" * len(head)] + ["|" + "|".join(row) + "|" for row in rows] + [""]


def render_section(section: Section, request_defaults: dict[str, str] | None = None,
                   shared: frozenset[str] = frozenset()) -> str:
    """A section as a table. ``request_defaults`` (the request's section): each key's deployment
    default (``defaults.<key>``) as a column; ``shared`` (the ``defaults`` section): keys left to
    that column, so each is described once, in the request's table."""
    lines = [f"## {section.title}", ""]
    if section.summary:
        lines += [_cell(section.summary), ""]
    rows = [row for row in section.rows if _short_key(row.key, section.prefix).strip("`") not in shared]
    if shared:
        lines += [f"Each key of a request's [`speculation`](#{_anchor(REQUEST_TITLE)}) is a key here too, its default "
                  "(that table's `defaults` column); the others:", ""]
    if request_defaults is not None:
        lines += _table(["key", "type", "`defaults`", "description"],
                        [[_short_key(row.key, section.prefix), _cell(row.type),
                          _cell(request_defaults.get(_short_key(row.key, section.prefix).strip("`"), "–")),
                          _cell(row.description)] for row in rows])
    elif rows and section.show_defaults:
        lines += _table(["key", "type", "default", "description"],
                        [[_short_key(row.key, section.prefix), _cell(row.type), _cell(row.default), _cell(row.description)]
                         for row in rows])
    elif rows:
        lines += _table(["key", "type", "description"],
                        [[_short_key(row.key, section.prefix), _cell(row.type), _cell(row.description)] for row in rows])
    return "\n".join(lines)


def _anchor(title: str) -> str:
    """GitHub's id of a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def render_reference() -> str:
    """The whole page, as committed in ``docs/configuration.md``: the ``defaults`` keys a request's
    ``speculation`` shares are described once, in the request's table, with their defaults there."""
    sections = all_sections()
    defaults = next(section for section in sections if section.title == DEFAULTS_TITLE)
    request = next(section for section in sections if section.title == REQUEST_TITLE)
    default_of = {_short_key(row.key, defaults.prefix).strip("`"): row.default for row in defaults.rows}
    shared = frozenset(default_of) & {_short_key(row.key, request.prefix).strip("`") for row in request.rows}
    rendered = [render_section(section, {k: v for k, v in default_of.items() if k in shared}) if section is request
                else render_section(section, shared=shared) if section is defaults else render_section(section)
                for section in sections]
    return HEADER + "\n" + "\n".join(rendered)


def undescribed_fields() -> list[str]:
    """Keys of the reference whose model field has no description."""
    return [f"{section.title}: {row.key}" for section in all_sections() for row in section.rows if not row.description]


if __name__ == "__main__":
    sys.stdout.write(render_reference())
