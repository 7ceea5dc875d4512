"""The ``specserve.SpecServe`` servicer registration with a request deserializer that never
raises (:func:`decode_request`), and the check the replica makes of what it received
(:func:`check_decoded`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from actors.request_schema import InvalidRequestError
from protos import specserve_pb2, specserve_pb2_grpc

#: The servicer registration function for ``grpc_options.grpc_servicer_functions``.
SERVICER_REGISTRATION = "cluster.grpc_service.add_SpecServeServicer_to_server"



@dataclass(frozen=True)
class UndecodableRequest:
    """What the replica receives instead of a ``GenerateRequest`` whose bytes did not parse
    (plain data: Serve's proxy pickles it to the replica)."""

    size: int
    reason: str


def decode_request(data: bytes) -> specserve_pb2.GenerateRequest | UndecodableRequest:
    """``GenerateRequest.FromString`` that never raises: bytes that do not parse (corrupt or
    truncated wire data, invalid UTF-8 in a string field) become an :class:`UndecodableRequest`."""
    try:
        return specserve_pb2.GenerateRequest.FromString(data)
    except (DecodeError, ValueError, TypeError, RuntimeError) as error:
        return UndecodableRequest(size=len(data), reason=type(error).__name__)


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_deserializer == specserve_pb2.GenerateRequest.FromString:
        return handler._replace(request_deserializer=decode_request)
    return handler


class _TolerantDecodingServer:
    """Forwards a servicer registration to ``server`` with :func:`decode_request` as the
    request deserializer of every handler that used ``GenerateRequest.FromString``."""

    def __init__(self, server: Any):
        self._server = server

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Sequence[Any]) -> None:
        rebuilt = []
        for handler in generic_rpc_handlers:
            method_handlers = getattr(handler, "_method_handlers", None)
            if method_handlers is None:  # not a grpc.method_handlers_generic_handler: keep as is
                rebuilt.append(handler)
                continue
            service = handler.service_name()
            methods = {path.rsplit("/", 1)[-1]: _tolerant(h) for path, h in method_handlers.items()}
            rebuilt.append(grpc.method_handlers_generic_handler(service, methods))
        self._server.add_generic_rpc_handlers(tuple(rebuilt))

    def add_registered_method_handlers(self, service_name: str, method_handlers: Mapping[str, Any]) -> None:
        register = getattr(self._server, "add_registered_method_handlers", None)
        if register is not None:
            register(service_name, {name: _tolerant(handler) for name, handler in method_handlers.items()})


def add_SpecServeServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - grpc naming
    """Register the ``specserve.SpecServe`` service exactly as the committed stubs do
    (``protos.specserve_pb2_grpc.add_SpecServeServicer_to_server``), but with
    :func:`decode_request` as the request deserializer."""
    specserve_pb2_grpc.add_SpecServeServicer_to_server(servicer, _TolerantDecodingServer(server))


def check_decoded(request: Any) -> specserve_pb2.GenerateRequest:
    """``request`` if it is a decoded ``GenerateRequest``; raises :class:`InvalidRequestError`
    for the :class:`UndecodableRequest` of bytes that did not parse."""
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(
            "request", f"the {request.size} bytes received are not a valid specserve.GenerateRequest ({request.reason})"
        )
    if not isinstance(request, specserve_pb2.GenerateRequest):
        raise InvalidRequestError("request", f"expected a specserve.GenerateRequest, got {type(request).__name__}")
    return request
