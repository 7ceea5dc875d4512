"""What every section of the application args shares: frozen models that refuse unknown keys, and
the error a bad configuration raises."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """The deployment configuration is invalid; the message names the key and the value."""


class Frozen(BaseModel):
    """A section of the args: frozen, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@dataclass(frozen=True)
class Accepts:
    """``Annotated`` metadata naming what a field accepts where its validated type reads otherwise
    (a size string parsed to bytes): the configuration reference prints ``text`` as the type."""

    text: str
