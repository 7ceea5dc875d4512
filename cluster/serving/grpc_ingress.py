"""The gRPC half of the ingress: ``Generate`` / ``GenerateStream``, named like the rpcs of
``protos/specserve.proto`` so Serve's gRPC proxy routes to them.

:class:`GrpcMethods` is a base of :class:`cluster.serving.ingress.SpecServeIngress`; what it uses
of the replica is its constructor argument, a :class:`cluster.serving.request_path.RequestPath`
(the API key, request ids, the served model, the sampling defaults and limits, the tokenizer and
the coordinator), the same object the HTTP routes use. A failure sets its status on Serve's
``grpc_context`` (:func:`cluster.serving.errors.client_error`, the field named by its proto path)
with the request id in the trailing metadata.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from actors.request_schema import GenerationRequest, InvalidRequestError
from cluster import grpc_service
from cluster.serving.errors import ClientError, client_error
from cluster.serving.request_path import RequestPath
from cluster.schemas.to_generation import ChoiceSpec
from cluster.responses import CompletionAccumulator, TokenTexts
from cluster.serving.security import require_key
from cluster.serving.streams import collect_all, interleave, prime_all, start_streams, unwrap_task_error
from protos import specserve_pb2

#: Trailing metadata key carrying the request id of an error.
REQUEST_ID_METADATA = "specserve-request-id"


def _grpc_status(error: BaseException, request_id: str) -> ClientError:
    """gRPC status code and details of a failure (:func:`cluster.serving.errors.client_error`)."""
    if isinstance(error, InvalidRequestError):
        error = grpc_service.grpc_field(error)
    return client_error(error, request_id)


class GrpcRequestError(Exception):
    """Raised after setting the status on ``grpc_context`` so Serve's proxy returns that status."""


class GrpcMethods:
    """The ingress's gRPC methods over ``request_path``, the replica's request path (shared with
    its HTTP routes)."""

    def __init__(self, request_path: RequestPath):
        self.request_path = request_path

    async def _grpc_request(
        self, proto: Any, grpc_context: Any, request_id: str
    ) -> tuple[list[ChoiceSpec], list[GenerationRequest], str, TokenTexts | None]:
        """Authenticate, decode and validate one call; returns its choices, their coordinator
        requests, its id and the token texts of its log-probabilities (None when not asked
        for), or raises (the request id is the server's until the client's own is validated)."""
        path = self.request_path
        require_key(path.api_key, grpc_context.invocation_metadata() if grpc_context is not None else ())
        try:
            proto = grpc_service.check_decoded(proto)
            request_id = path.new_request_id("grpc", grpc_service.client_request_id(proto))
            path.check_model(proto.model)
            specs, generations = grpc_service.to_generation_requests(
                proto, request_id, path.sampling_defaults, path.max_prompt_chars, path.max_choices
            )
        except Exception as error:
            path.count_if_invalid(error)
            raise
        texts = (await path.tokens.texts())[1] if grpc_service.wants_logprobs(generations[0]) else None
        return specs, generations, request_id, texts

    @staticmethod
    def _fail(grpc_context: Any, error: BaseException, request_id: str) -> GrpcRequestError:
        """Set the client's status on ``grpc_context`` (:func:`cluster.serving.errors.client_error`)."""
        failure = _grpc_status(unwrap_task_error(error), request_id)
        if grpc_context is not None:
            grpc_context.set_code(failure.grpc_code)
            grpc_context.set_details(failure.message)
            grpc_context.set_trailing_metadata([(REQUEST_ID_METADATA, request_id)])
        return GrpcRequestError(failure.message)

    async def Generate(  # noqa: N802 - named like the rpc in protos/specserve.proto
        self, request: specserve_pb2.GenerateRequest, grpc_context: Any = None
    ) -> specserve_pb2.GenerateResponse:
        """Unary rpc: every choice's whole completion with usage and speculation stats."""
        started = time.monotonic()
        request_id = self.request_path.new_request_id("grpc")
        try:
            specs, generations, request_id, texts = await self._grpc_request(request, grpc_context, request_id)
            results = [CompletionAccumulator(spec.index, counts_prompt=spec.sample_index == 0) for spec in specs]
            await collect_all(start_streams(self.request_path.coordinator, generations), results)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status
            failure = self._fail(grpc_context, error, request_id)
            if grpc_context is None:
                raise failure from None
            # The status set on grpc_context is what the client receives; the empty message
            # is not delivered (returning instead of raising keeps the replica log quiet).
            return specserve_pb2.GenerateResponse()
        return grpc_service.final_response(request_id, self.request_path.model_name, results, texts, time.monotonic() - started)

    async def GenerateStream(  # noqa: N802 - named like the rpc in protos/specserve.proto
        self, request: specserve_pb2.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[specserve_pb2.GenerateResponse]:
        """Server-streaming rpc: one message per chunk, tagged with its choice ``index`` (the
        choices interleaved as they arrive); each choice's last message has finished, usage and
        stats."""
        request_id = self.request_path.new_request_id("grpc")
        try:
            specs, generations, request_id, texts = await self._grpc_request(request, grpc_context, request_id)
            streams = start_streams(self.request_path.coordinator, generations)
            firsts = await prime_all(streams)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status
            raise self._fail(grpc_context, error, request_id) from None
        chunks = interleave(streams, firsts)
        try:
            async for position, chunk in chunks:
                yield grpc_service.chunk_to_response(
                    chunk, self.request_path.model_name, index=specs[position].index, request_id=request_id, texts=texts
                )
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status
            raise self._fail(grpc_context, error, request_id) from None
        finally:
            await chunks.aclose()
            for stream in streams:
                stream.cancel()
