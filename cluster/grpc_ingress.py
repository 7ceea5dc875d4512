"""The gRPC half of the ingress: ``Generate`` / ``GenerateStream``, named like the rpcs of
``protos/specserve.proto`` so Serve's gRPC proxy routes to them.

:class:`GrpcMethods` is a base of :class:`cluster.app.SpecServeIngress` and uses its request
path: ``_api_key``, ``_new_request_id``, ``_check_model``, ``_count_if_invalid``,
``_sampling_defaults``, ``_config``, ``_max_choices``, ``_tokens``, ``_coordinator`` and
``_model_name``. A failure sets its status on Serve's ``grpc_context``
(:func:`cluster.errors.client_error`, the field named by its proto path) with the request id
in the trailing metadata.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from actors.api import GenerationRequest, InvalidRequestError
from cluster import grpc_service
from cluster.errors import ClientError, client_error
from cluster.generation_requests import ChoiceSpec
from cluster.responses import CompletionAccumulator, TokenTexts
from cluster.security import require_key
from cluster.streams import collect_all, interleave, prime_all, start_streams, unwrap_task_error
from protos import specserve_pb2

#: Trailing metadata key carrying the request id of an error.
REQUEST_ID_METADATA = "specserve-request-id"


def _grpc_status(error: BaseException, request_id: str) -> ClientError:
    """gRPC status code and details of a failure (:func:`cluster.errors.client_error`)."""
    if isinstance(error, InvalidRequestError):
        error = grpc_service.grpc_field(error)
    return client_error(error, request_id)


class GrpcRequestError(Exception):
    """Raised after setting the status on ``grpc_context`` so Serve's proxy returns that status."""


class GrpcMethods:
    """The ingress's gRPC methods (see the module docstring for what they use of the ingress)."""

    async def _grpc_request(
        self, proto: Any, grpc_context: Any, request_id: str
    ) -> tuple[list[ChoiceSpec], list[GenerationRequest], str, TokenTexts | None]:
        """Authenticate, decode and validate one call; returns its choices, their coordinator
        requests, its id and the token texts of its log-probabilities (None when not asked
        for), or raises (the request id is the server's until the client's own is validated)."""
        require_key(self._api_key, grpc_context.invocation_metadata() if grpc_context is not None else ())
        try:
            proto = grpc_service.check_decoded(proto)
            request_id = self._new_request_id("grpc", grpc_service.client_request_id(proto))
            self._check_model(proto.model)
            specs, generations = grpc_service.to_generation_requests(
                proto, request_id, self._sampling_defaults, self._config.max_prompt_chars, self._max_choices
            )
        except Exception as error:
            self._count_if_invalid(error)
            raise
        texts = (await self._tokens.texts())[1] if grpc_service.wants_logprobs(generations[0]) else None
        return specs, generations, request_id, texts

    @staticmethod
    def _fail(grpc_context: Any, error: BaseException, request_id: str) -> GrpcRequestError:
        """Set the client's status on ``grpc_context`` (:func:`cluster.errors.client_error`)."""
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
        request_id = self._new_request_id("grpc")
        try:
            specs, generations, request_id, texts = await self._grpc_request(request, grpc_context, request_id)
            results = [CompletionAccumulator(spec.index, counts_prompt=spec.sample_index == 0) for spec in specs]
            await collect_all(start_streams(self._coordinator, generations), results)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status
            failure = self._fail(grpc_context, error, request_id)
            if grpc_context is None:
                raise failure from None
            # The status set on grpc_context is what the client receives; the empty message
            # is not delivered (returning instead of raising keeps the replica log quiet).
            return specserve_pb2.GenerateResponse()
        return grpc_service.final_response(request_id, self._model_name, results, texts, time.monotonic() - started)

    async def GenerateStream(  # noqa: N802 - named like the rpc in protos/specserve.proto
        self, request: specserve_pb2.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[specserve_pb2.GenerateResponse]:
        """Server-streaming rpc: one message per chunk, tagged with its choice ``index`` (the
        choices interleaved as they arrive); each choice's last message has finished, usage and
        stats."""
        request_id = self._new_request_id("grpc")
        try:
            specs, generations, request_id, texts = await self._grpc_request(request, grpc_context, request_id)
            streams = start_streams(self._coordinator, generations)
            firsts = await prime_all(streams)
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status
            raise self._fail(grpc_context, error, request_id) from None
        chunks = interleave(streams, firsts)
        try:
            async for position, chunk in chunks:
                yield grpc_service.chunk_to_response(
                    chunk, self._model_name, index=specs[position].index, request_id=request_id, texts=texts
                )
        except Exception as error:  # noqa: BLE001 - every failure becomes a gRPC status
            raise self._fail(grpc_context, error, request_id) from None
        finally:
            await chunks.aclose()
            for stream in streams:
                stream.cancel()
