"""API-key authentication of the HTTP and gRPC endpoints, and the start-up warnings.

The key comes from the application's ``args.security.api_key``, else from the
``SPECSERVE_API_KEY`` environment variable of the serving processes
(:func:`cluster.config.resolve_api_key`). With a key set, every HTTP route except
``GET /health`` and every gRPC call of ``specserve.SpecServe`` must present it:

- HTTP: ``Authorization: Bearer <key>`` (what the ``openai`` client sends as ``api_key``), or
  ``X-API-Key: <key>``; otherwise 401 with an OpenAI-style error body;
- gRPC: metadata ``authorization: Bearer <key>`` or ``x-api-key: <key>``; otherwise
  ``UNAUTHENTICATED``.

Keys are compared with :func:`hmac.compare_digest` (time independent of where they differ).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Mapping

from cluster.serving.errors import Unauthenticated

logger = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"
API_KEY_HEADER = "x-api-key"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)"


def bearer_token(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def presented_key(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> str | None:
    """The key a client sent: ``authorization: Bearer <key>``, else ``x-api-key``; header names
    are case-insensitive. ``headers`` is a mapping (HTTP) or (key, value) pairs (gRPC metadata)."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for name, value in items:
        name = name.lower() if isinstance(name, str) else ""
        if name in (AUTHORIZATION_HEADER, API_KEY_HEADER) and name not in found and isinstance(value, str):
            found[name] = value
    token = bearer_token(found.get(AUTHORIZATION_HEADER))
    if token is not None:
        return token
    key = (found.get(API_KEY_HEADER) or "").strip()
    return key or None


def key_matches(expected: str, presented: str | None) -> bool:
    """Constant-time comparison of the presented key with the expected one."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8", "surrogatepass"))


def require_key(expected: str | None, headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
    """Raise :class:`cluster.serving.errors.Unauthenticated` unless ``expected`` is None (no key
    configured) or ``headers`` present it."""
    if expected is None:
        return
    if not key_matches(expected, presented_key(headers)):
        raise Unauthenticated(UNAUTHENTICATED_MESSAGE)


def grpc_all_interfaces_warning(app_names: list[str], grpc_port: int | None = None) -> str:
    """The start-up warning for applications served without an API key: Ray Serve's gRPC proxy
    has no host option and listens on every interface."""
    names = ", ".join(repr(name) for name in app_names)
    port = "<grpc_options.port>" if grpc_port is None else str(grpc_port)
    return (
        f"no API key for application {names}: Ray Serve's gRPC proxy listens on every interface "
        f"([::]:{port}), so anyone who can reach that port can generate; set args.security.api_key "
        "or the SPECSERVE_API_KEY environment variable, or firewall the port"
    )


__all__ = [
    "API_KEY_HEADER",
    "AUTHORIZATION_HEADER",
    "UNAUTHENTICATED_MESSAGE",
    "bearer_token",
    "grpc_all_interfaces_warning",
    "key_matches",
    "presented_key",
    "require_key",
]
