"""Reading the args: from a Serve YAML file or a mapping (errors name each bad key), and the
application's API key."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config.app_args import SpecServeArgs
from cluster.config.base import ConfigError
from cluster.config.serving import API_KEY_ENV, check_api_key


def resolve_api_key(args: SpecServeArgs, environ: Any = None) -> str | None:
    """The application's API key: ``security.api_key``, else the :data:`API_KEY_ENV` variable
    of ``environ`` (default: this process's environment), else None (no authentication).

    Raises :class:`ConfigError` when the variable is set but is not a valid key.
    """
    if args.security.api_key is not None:
        return args.security.api_key
    value = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if not value:
        return None
    try:
        return check_api_key(value, API_KEY_ENV)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _describe_validation_error(error: ValidationError, where: str) -> str:
    lines = [f"invalid specserve args in {where}:"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "<args>"
        value = item.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        if "api_key" in key:
            shown = "<hidden>"
        lines.append(f"  {key} = {shown}: {item['msg']}")
    return "\n".join(lines)


def parse_app_args(args: dict[str, Any] | SpecServeArgs, where: str = "args") -> SpecServeArgs:
    """Validate a raw ``args`` mapping; raises :class:`ConfigError` naming each bad key and value."""
    if isinstance(args, SpecServeArgs):
        return args
    try:
        return SpecServeArgs.model_validate(args)
    except ValidationError as error:
        raise ConfigError(_describe_validation_error(error, where)) from None


def read_serve_config(yaml_path: str | pathlib.Path) -> dict[str, Any]:
    """Read a Ray Serve YAML config file and check its ``applications`` list exists."""
    path = pathlib.Path(yaml_path)
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(document, dict) or not isinstance(document.get("applications"), list):
        raise ConfigError(f"{path}: a Ray Serve config needs a top-level 'applications' list")
    return document


def select_application(document: dict[str, Any], app_name: str | None, where: str) -> dict[str, Any]:
    """The application named ``app_name``, or the only one when ``app_name`` is None."""
    applications = document["applications"]
    names = [app.get("name") for app in applications if isinstance(app, dict)]
    if app_name is None:
        if len(applications) != 1:
            raise ConfigError(f"{where}: {len(applications)} applications {names}; pass the name of one")
        return applications[0]
    for app in applications:
        if isinstance(app, dict) and app.get("name") == app_name:
            return app
    raise ConfigError(f"{where}: no application named {app_name!r}; applications are {names}")


def load_app_args(yaml_path: str | pathlib.Path, app_name: str | None = None) -> SpecServeArgs:
    """Read and validate the ``args`` of one application of a Ray Serve YAML file."""
    document = read_serve_config(yaml_path)
    app = select_application(document, app_name, str(yaml_path))
    return parse_app_args(app.get("args") or {}, where=f"{yaml_path} application {app.get('name')!r} args")
