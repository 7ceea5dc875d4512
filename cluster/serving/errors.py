"""What a client is told about a failure, and what the server log keeps.

:func:`client_error` is the one place the serving layer turns an exception into the answer a
client gets, on both protocols (HTTP status + OpenAI error body, gRPC status code + details):

- client errors (:class:`actors.request_schema.InvalidRequestError`, :class:`ModelNotFound`,
  :class:`Unauthenticated`, and :class:`actors.coordination.admission.OverloadedError`: 429 /
  ``RESOURCE_EXHAUSTED``, naming the limit) keep their message; it is cleaned of
  terminal colour codes and control characters and cut to :data:`MAX_CLIENT_MESSAGE_CHARS`;
- server errors (a dead model group, a failure in the middle of decoding, anything
  unexpected) become a fixed sentence plus the request id. They never carry the exception's
  text: Ray errors hold tracebacks, node IP addresses, actor ids, process ids and colour
  codes. The full detail is logged (``logger.exception``, with the traceback) under the same
  request id, so ``grep <request id>`` in the replica's log finds it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

import grpc
from ray.exceptions import GetTimeoutError, RayActorError

from actors.request_schema import InvalidRequestError
from actors.coordination.admission import OverloadedError

logger = logging.getLogger(__name__)

MAX_CLIENT_MESSAGE_CHARS = 500

#: ANSI escape sequences (colours, cursor movement) and other control characters.
_ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class ModelNotFound(LookupError):
    """The request names a model this application does not serve."""


class Unauthenticated(PermissionError):
    """The request carries no API key, or a wrong one."""


class ModelGroupUnavailable(RuntimeError):
    """The replica's coordinator or a model worker died (the message is for the log only)."""


class RequestTimedOut(TimeoutError):
    """The request ran past ``limits.request_timeout_s`` (the message names the limit)."""


class RequestFailed(RuntimeError):
    """The coordinator reported an error in the middle of a request (the message is for the log only)."""


@dataclass(frozen=True)
class ClientError:
    """One failure as the client sees it, on either protocol."""

    http_status: int
    grpc_code: grpc.StatusCode
    message: str
    param: str | None
    error_type: str  # OpenAI error ``type``
    code: str | None  # OpenAI error ``code``
    request_id: str


def clean_text(text: str, limit: int = MAX_CLIENT_MESSAGE_CHARS) -> str:
    """``text`` without ANSI escape sequences or control characters (newlines become spaces),
    at most ``limit`` characters."""
    text = _CONTROL.sub(" ", _ANSI_ESCAPE.sub("", text).replace("\n", " ").replace("\t", " "))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_unavailable(error: BaseException) -> bool:
    return isinstance(error, (ModelGroupUnavailable, RayActorError, GetTimeoutError, TimeoutError, asyncio.TimeoutError))


def client_error(error: BaseException, request_id: str, what: str = "request") -> ClientError:
    """The client's view of ``error``; server errors are logged here with their full detail.

    ``what`` names the operation in the log line (``request``, ``health check``, ...).
    """
    if isinstance(error, InvalidRequestError):
        param = None if error.field == "body" else error.field
        message = clean_text(f"{error.field}: {error.message}")
        return ClientError(400, grpc.StatusCode.INVALID_ARGUMENT, message, param, "invalid_request_error",
                           "invalid_value", request_id)
    if isinstance(error, Unauthenticated):
        return ClientError(401, grpc.StatusCode.UNAUTHENTICATED, clean_text(str(error)), None,
                           "invalid_request_error", "invalid_api_key", request_id)
    if isinstance(error, RequestTimedOut):
        logger.warning("%s %s timed out: %s", what, request_id, error)
        return ClientError(504, grpc.StatusCode.DEADLINE_EXCEEDED, clean_text(str(error)), None, "server_error",
                           "timeout", request_id)
    if isinstance(error, OverloadedError):
        logger.warning("%s %s refused: %s", what, request_id, error.message)
        return ClientError(429, grpc.StatusCode.RESOURCE_EXHAUSTED, clean_text(f"{error.message}; retry later"), None,
                           "rate_limit_error", "server_busy", request_id)
    if isinstance(error, ModelNotFound):
        return ClientError(404, grpc.StatusCode.NOT_FOUND, clean_text(str(error)), "model", "invalid_request_error",
                           "model_not_found", request_id)
    if _is_unavailable(error):
        logger.exception("%s %s: model group unavailable: %s", what, request_id, error, exc_info=error)
        message = f"the model group is unavailable; try again later (request id {request_id})"
        return ClientError(503, grpc.StatusCode.UNAVAILABLE, message, None, "server_error", "unavailable", request_id)
    logger.exception("%s %s failed: %s: %s", what, request_id, type(error).__name__, error, exc_info=error)
    message = f"internal error while serving the {what} (request id {request_id})"
    return ClientError(500, grpc.StatusCode.INTERNAL, message, None, "server_error", "internal_error", request_id)


__all__ = [
    "MAX_CLIENT_MESSAGE_CHARS",
    "ClientError",
    "ModelGroupUnavailable",
    "ModelNotFound",
    "RequestFailed",
    "RequestTimedOut",
    "Unauthenticated",
    "clean_text",
    "client_error",
]
