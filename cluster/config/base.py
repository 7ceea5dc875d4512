"""What every section of the application args shares: frozen models that refuse unknown keys, and
the error a bad configuration raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """The deployment configuration is invalid; the message names the key and the value."""


class Frozen(BaseModel):
    """A section of the args: frozen, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")
