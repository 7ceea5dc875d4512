"""``limits``, ``security`` and ``server``: admission and request-size limits, the API key, the
addresses `specserve serve` listens on."""

from __future__ import annotations

import string

from pydantic import Field, field_validator

from cluster.config.base import Frozen

#: Default of ``limits.max_prompt_chars``.
DEFAULT_MAX_PROMPT_CHARS = 1_000_000


class LimitsArgs(Frozen):
    """Admission, request-size and session limits of one model group."""

    max_concurrent_requests: int = Field(16, ge=1, description="Requests decoded at once by one coordinator.")
    max_queued_requests: int = Field(
        64, ge=0, description="Requests waiting for a decoding place; past this, refused (HTTP 429, gRPC RESOURCE_EXHAUSTED)."
    )
    session_idle_timeout_s: float = Field(
        300.0, gt=0.0, description="A worker frees a request's KV cache after this long without a call."
    )
    request_timeout_s: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="A request unfinished this long after arriving (waiting included) ends with HTTP 504 / gRPC "
        "DEADLINE_EXCEEDED, its sessions freed.",
    )
    max_prompt_chars: int = Field(
        DEFAULT_MAX_PROMPT_CHARS,
        ge=1,
        description="Longest prompt, checked by the ingress before any model work: characters of a text prompt (chat: the "
        "rendered conversation), or ids of a token-id prompt.",
    )


#: Environment variable holding the API key when ``security.api_key`` is not set.
API_KEY_ENV = "SPECSERVE_API_KEY"
API_KEY_MIN_CHARS = 16
API_KEY_MAX_CHARS = 256
_API_KEY_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)


def check_api_key(key: str, where: str) -> str:
    """``key`` if it is 16-256 printable ASCII characters without spaces, else ValueError
    (the message never repeats the key)."""
    if not API_KEY_MIN_CHARS <= len(key) <= API_KEY_MAX_CHARS:
        raise ValueError(f"{where}: an API key needs {API_KEY_MIN_CHARS} to {API_KEY_MAX_CHARS} characters, got {len(key)}")
    if not set(key) <= _API_KEY_CHARS:
        raise ValueError(f"{where}: an API key may hold printable ASCII characters only (no spaces)")
    return key


class SecurityArgs(Frozen):
    """Client authentication of the HTTP and gRPC endpoints."""

    api_key: str | None = Field(
        None,
        repr=False,
        description="Key clients send (HTTP `Authorization: Bearer <key>` or `X-API-Key`; gRPC metadata "
        f"`authorization` or `x-api-key`). Unset: the serving processes' {API_KEY_ENV}; neither: no authentication. "
        "16-256 printable ASCII characters. GET /health stays open.",
    )

    @field_validator("api_key")
    @classmethod
    def _key_format(cls, value: str | None) -> str | None:
        return None if value is None else check_api_key(value, "security.api_key")


class ServerArgs(Frozen):
    """Where the HTTP and gRPC servers listen (used by `specserve serve`)."""

    host: str = Field(
        "127.0.0.1",
        description="Bind address of HTTP (and direct HTTP), not of gRPC (docs/serving.md, Security).",
    )
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP (OpenAI-compatible) port.")
    grpc_port: int = Field(9000, ge=1, le=65535, description="gRPC port.")
    direct_http_port: int | None = Field(
        None, ge=1, le=65535,
        description="Each replica also serves HTTP itself, skipping Serve's proxy (Ray Serve's experimental direct ingress), "
        "on this port, + 1, ... (docs/serving.md). Unset: off.",
    )
