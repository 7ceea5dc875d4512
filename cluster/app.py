"""The Ray Serve application: one ingress deployment serving HTTP (OpenAI-compatible) and gRPC.

``build_app(args)`` is the ``import_path`` target of every ``deploy/*.yaml``
(``cluster.app:build_app``) and the ONLY place Serve options are set. Each replica of the
ingress deployment owns a whole model group (a Coordinator and one ModelWorker per model),
started in the replica's own placement group: bundle 0 holds the replica, bundles 1.. hold the
model workers (see :func:`replica_bundles`). Scaling the deployment (``num_replicas`` or
``autoscaling_config`` in the YAML) therefore scales whole model groups.

Request path: HTTP (FastAPI routes below) or gRPC (methods ``Generate`` / ``GenerateStream``,
named like the rpcs of ``protos/specserve.proto`` so Serve's gRPC proxy routes to them) ->
:class:`actors.api.GenerationRequest` -> ``Coordinator.generate`` (an async generator actor
method, consumed as a streaming ObjectRefGenerator) -> chunks back to the client.

Errors: :class:`actors.api.InvalidRequestError` (raised here while parsing, or by the
coordinator before any work) becomes HTTP 400 with an OpenAI-style error body / gRPC
INVALID_ARGUMENT, both naming the field. A chunk with ``error`` set (a failure mid-request)
becomes HTTP 500 / gRPC INTERNAL (in a stream: an ``error`` event). A dead model group
becomes 503 / UNAVAILABLE. A client that disconnects cancels its coordinator stream, which
frees the request's sessions in the workers.
"""

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import get_current_placement_group

from actors.api import GenerationChunk, GenerationRequest, InvalidRequestError
from actors.plan import resolve_plan
from cluster import grpc_service
from cluster.config import GroupConfig, SpecServeArgs, parse_app_args
from cluster.openai_api import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionAccumulator,
    CompletionRequest,
    completion_response,
    error_body,
    http_field,
    invalid_request_body,
    models_list,
    parse_body,
    sse_event,
    stream_chunk,
    to_generation_request,
    usage_chunk,
)
from protos import specserve_pb2

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "SpecServeIngress"
#: CPUs of the ingress replica itself (bundle 0): it only parses requests and relays chunks.
INGRESS_CPUS = 0.1
#: Placement strategy of a replica's bundles: a group on as few nodes as its resources allow.
PLACEMENT_STRATEGY = "PACK"
#: gRPC servicer registration function (for ``grpc_options.grpc_servicer_functions``).
GRPC_SERVICER_FUNCTION = "protos.specserve_pb2_grpc.add_SpecServeServicer_to_server"
DEFAULT_MODEL_NAME = "specserve"
#: Index of the first model-worker bundle in a replica's placement group (bundle 0 = replica).
MODEL_BUNDLE_OFFSET = 1
HEALTH_TIMEOUT_S = 10.0


class ModelGroupUnavailable(RuntimeError):
    """The replica's coordinator or a model worker died."""


class RequestFailed(RuntimeError):
    """The coordinator reported an error in the middle of a request."""


def replica_bundles(config: GroupConfig) -> list[dict[str, float]]:
    """Placement group bundles of one ingress replica: the replica, then one per model worker.

    Bundle 0 holds the ingress replica (Serve places the replica actor there) plus the
    coordinator's CPUs (the coordinator may go in any bundle with room); bundle
    ``MODEL_BUNDLE_OFFSET + i`` reserves ``config.models[i]`` (see
    :func:`cluster.bringup.model_group_bundles`).
    """
    from cluster.bringup import model_group_bundles

    return [{"CPU": INGRESS_CPUS + config.coordinator_cpus}, *model_group_bundles(config)]


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
MAX_ERROR_CHARS = 1000


def brief_error(message: str) -> str:
    """The client-facing form of an internal error: the last line of a (remote) traceback,
    without terminal colour codes, at most :data:`MAX_ERROR_CHARS` characters."""
    lines = [line.strip() for line in _ANSI_ESCAPE.sub("", message).splitlines() if line.strip()]
    text = lines[-1] if lines else "unknown error"
    return text[:MAX_ERROR_CHARS]


def _unwrap_task_error(error: BaseException) -> BaseException:
    """The InvalidRequestError behind a Ray task error (re-created so it pickles cleanly)."""
    cause = getattr(error, "cause", None)
    for candidate in (error, cause):
        if isinstance(candidate, InvalidRequestError):
            return InvalidRequestError(candidate.field, candidate.message)
    if isinstance(error, RayActorError) or isinstance(cause, RayActorError):
        return ModelGroupUnavailable(f"model group unavailable: {error}")
    return error


class CoordinatorStream:
    """Async iterator over one request's :class:`GenerationChunk` stream from the coordinator.

    ``cancel()`` (called when the client goes away) cancels the coordinator's generator task,
    whose clean-up releases the request's sessions in every worker.
    """

    def __init__(self, coordinator: Any, request: GenerationRequest):
        self.request_id = request.request_id
        self._refs = coordinator.generate.options(num_returns="streaming").remote(request)
        self._finished = False

    def __aiter__(self) -> "CoordinatorStream":
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            ref = await self._refs.__anext__()
            chunk: GenerationChunk = await ref
        except StopAsyncIteration:
            self._finished = True
            raise
        except (RayTaskError, RayActorError) as error:
            self._finished = True
            raise _unwrap_task_error(error) from None
        if chunk.error is not None:
            self._finished = True
            logger.error("request %s failed in the model group: %s", self.request_id, chunk.error)
            raise RequestFailed(brief_error(chunk.error))
        if chunk.finished:
            self._finished = True
        return chunk

    def cancel(self) -> None:
        """Cancel the coordinator task if it is still running (idempotent)."""
        if not self._finished:
            self._finished = True
            logger.info("request %s: client went away, cancelling its coordinator stream", self.request_id)
            ray.cancel(self._refs)


async def _prime(stream: CoordinatorStream) -> tuple[GenerationChunk | None, CoordinatorStream]:
    """Wait for the first chunk, so invalid requests fail before a streaming response starts."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        stream.cancel()
        raise
    return first, stream


def _http_error(error: BaseException) -> JSONResponse:
    """HTTP status + OpenAI error body of a failure."""
    if isinstance(error, InvalidRequestError):
        return JSONResponse(invalid_request_body(http_field(error)), status_code=400)
    if isinstance(error, ModelGroupUnavailable):
        return JSONResponse(error_body(str(error), None, "server_error", "unavailable"), status_code=503)
    if isinstance(error, RequestFailed):
        return JSONResponse(error_body(f"request failed: {error}", None, "server_error", "internal_error"), status_code=500)
    logger.exception("unexpected error while serving a request", exc_info=error)
    message = f"internal error: {brief_error(str(error))}"
    return JSONResponse(error_body(message, None, "server_error", "internal_error"), status_code=500)


def _grpc_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC status code and details of a failure."""
    if isinstance(error, InvalidRequestError):
        error = grpc_service.grpc_field(error)
        return grpc.StatusCode.INVALID_ARGUMENT, f"{error.field}: {error.message}"
    if isinstance(error, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(error.args[0] if error.args else error)
    if isinstance(error, ModelGroupUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, RequestFailed):
        return grpc.StatusCode.INTERNAL, f"request failed: {error}"
    return grpc.StatusCode.INTERNAL, f"internal error: {brief_error(str(error))}"


class GrpcRequestError(Exception):
    """Raised after setting the status on ``grpc_context`` so Serve's proxy returns that status."""


async def _wait(ref: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(ref, timeout=timeout_s)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (unit use)
        return ""


def _served_model_name() -> str:
    """The model id clients use: the Serve application's name."""
    try:
        return serve.get_replica_context().app_name or DEFAULT_MODEL_NAME
    except Exception:  # noqa: BLE001 - outside a replica (unit use)
        return DEFAULT_MODEL_NAME


fastapi_app = FastAPI(
    title="specserve",
    description="Lossless speculative decoding and speculative ensembles (OpenAI-compatible API).",
)


# NOTE: serve.ingress serializes the class when it is applied, so everything its methods use
# must be defined above this point.
@serve.ingress(fastapi_app)
class SpecServeIngress:
    """One replica: a model group plus the HTTP routes and gRPC methods that feed it."""

    def __init__(self, args: dict[str, Any], start_group: Callable[..., Any] | None = None):
        """``start_group(config, placement_group=..., first_bundle=...)`` builds the model group (default:
        :func:`cluster.bringup.start_model_group`); it must return an object with a
        ``coordinator`` actor handle and a ``shutdown()`` method."""
        if start_group is None:
            from cluster.bringup import start_model_group as start_group

        self._args: SpecServeArgs = parse_app_args(args)
        self._config: GroupConfig = self._args.freeze()
        self._model_name = _served_model_name()
        # Deployment-wide sampling defaults for unset request fields; none beyond
        # actors.api.SamplingParams' own today (the YAML args have no sampling section).
        self._sampling_defaults: dict[str, Any] = {}
        placement_group = get_current_placement_group()
        self._placement_group_id = placement_group.id.hex() if placement_group else None
        logger.info(
            "starting model group %s (placement group %s)",
            [model.name for model in self._config.models],
            self._placement_group_id,
        )
        self._group = start_group(self._config, placement_group=placement_group, first_bundle=MODEL_BUNDLE_OFFSET)
        self._coordinator = self._group.coordinator

    # ------------------------------------------------------------------ shared request path

    def _new_request_id(self, prefix: str, client_id: str = "") -> str:
        return client_id or f"{prefix}-{uuid.uuid4().hex}"

    def _check_model(self, model: str | None) -> None:
        if model and model != self._model_name:
            raise LookupError(f"model {model!r} is not served here; served model: {self._model_name!r}")

    def _check_plan(self, request: GenerationRequest) -> None:
        """Resolve the strategy against the deployment now, so a bad one fails before any work."""
        resolve_plan(request.speculation, self._config.defaults, self._config.roles)

    def _start(self, request: GenerationRequest) -> CoordinatorStream:
        self._check_plan(request)
        return CoordinatorStream(self._coordinator, request)

    async def _collect(self, stream: CoordinatorStream) -> CompletionAccumulator:
        result = CompletionAccumulator()
        try:
            async for chunk in stream:
                result.add(chunk)
        finally:
            stream.cancel()
        return result

    # ------------------------------------------------------------------ HTTP

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when the replica's coordinator answers, 503 otherwise."""
        try:
            await _wait(self._coordinator.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure means unhealthy
            return JSONResponse({"status": "unavailable", "error": str(error)}, status_code=503)
        return JSONResponse({"status": "ok", "model": self._model_name})

    @fastapi_app.get("/v1/status")
    async def status(self) -> JSONResponse:
        """This replica's model group: models, defaults, active requests, open sessions per worker."""
        names = list(self._group.workers)
        try:
            description = await self._coordinator.describe.remote()
            sessions = await asyncio.gather(*(self._group.workers[name].num_sessions.remote() for name in names))
        except (RayActorError, RayTaskError) as error:
            return _http_error(_unwrap_task_error(error))
        return JSONResponse(
            {
                "model": self._model_name,
                "replica": _replica_id(),
                "replica_actor": ray.get_runtime_context().get_actor_id(),
                "placement_group": self._placement_group_id,
                "coordinator": self._coordinator._actor_id.hex(),
                "workers": {name: handle._actor_id.hex() for name, handle in self._group.workers.items()},
                "sessions": dict(zip(names, sessions)),
                **description,
            }
        )

    @fastapi_app.get("/v1/models")
    async def models(self) -> JSONResponse:
        return JSONResponse(models_list([self._model_name]))

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, chat=True)

    async def _openai(self, http_request: Request, chat: bool) -> Response:
        created = int(time.time())
        request_id = self._new_request_id("chatcmpl" if chat else "cmpl")
        try:
            body = parse_body(ChatCompletionRequest if chat else CompletionRequest, await http_request.body())
            self._check_model(body.model)
            generation = to_generation_request(body, request_id, self._sampling_defaults)
            stream = self._start(generation)
        except LookupError as error:
            return JSONResponse(error_body(str(error), "model", code="model_not_found"), status_code=404)
        except InvalidRequestError as error:
            return _http_error(error)
        if not body.stream:
            try:
                result = await self._collect(stream)
            except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response
                return _http_error(error)
            return JSONResponse(
                completion_response(request_id, self._model_name, created, result, chat, body.return_token_ids)
            )
        try:
            first, stream = await _prime(stream)
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response
            return _http_error(error)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = self._sse_events(stream, first, request_id, created, chat, include_usage, body.return_token_ids)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _sse_events(
        self,
        stream: CoordinatorStream,
        first: GenerationChunk | None,
        request_id: str,
        created: int,
        chat: bool,
        include_usage: bool,
        token_ids: bool,
    ) -> AsyncIterator[bytes]:
        """Server-sent events of one request; cancels the coordinator stream if the client leaves."""
        stats = None
        try:
            chunk = first
            is_first = True
            while chunk is not None:
                yield sse_event(stream_chunk(request_id, self._model_name, created, chunk, chat, is_first, token_ids))
                is_first = False
                stats = chunk.stats if chunk.finished else stats
                chunk = await anext(stream, None)
            if include_usage:
                yield sse_event(usage_chunk(request_id, self._model_name, created, stats, chat))
        except Exception as error:  # noqa: BLE001 - reported to the client as an error event
            response = _http_error(error)
            yield sse_event(response.body.decode())
        finally:
            stream.cancel()
        yield SSE_DONE

    # ------------------------------------------------------------------ gRPC

    def _grpc_request(self, proto: specserve_pb2.GenerateRequest) -> GenerationRequest:
        self._check_model(proto.model)
        request_id = self._new_request_id("grpc", proto.request_id)
        return grpc_service.to_generation_request(proto, request_id, self._sampling_defaults)

    @staticmethod
    def _fail(grpc_context: Any, error: BaseException) -> GrpcRequestError:
        code, details = _grpc_status(error)
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(details)
        if code == grpc.StatusCode.INTERNAL:
            logger.error("gRPC request failed: %s", details)
        return GrpcRequestError(details)

    async def Generate(  # noqa: N802 - named like the rpc in protos/specserve.proto
        self, request: specserve_pb2.GenerateRequest, grpc_context: Any = None
    ) -> specserve_pb2.GenerateResponse:
        """Unary rpc: the whole completion with usage and speculation stats."""
        try:
            generation = self._grpc_request(request)
            result = await self._collect(self._start(generation))
        except (InvalidRequestError, LookupError, ModelGroupUnavailable, RequestFailed) as error:
            if grpc_context is None:
                raise self._fail(grpc_context, error) from None
            # The status set on grpc_context is what the client receives; the empty message
            # is not delivered (returning instead of raising keeps the replica log quiet).
            self._fail(grpc_context, error)
            return specserve_pb2.GenerateResponse()
        return grpc_service.final_response(generation.request_id, self._model_name, result)

    async def GenerateStream(  # noqa: N802 - named like the rpc in protos/specserve.proto
        self, request: specserve_pb2.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[specserve_pb2.GenerateResponse]:
        """Server-streaming rpc: one message per chunk; the last has finished, usage and stats."""
        try:
            stream = self._start(self._grpc_request(request))
        except (InvalidRequestError, LookupError) as error:
            raise self._fail(grpc_context, error) from None
        try:
            async for chunk in stream:
                yield grpc_service.chunk_to_response(chunk, self._model_name)
        except (InvalidRequestError, ModelGroupUnavailable, RequestFailed) as error:
            raise self._fail(grpc_context, error) from None
        finally:
            stream.cancel()

    def __del__(self) -> None:
        group = getattr(self, "_group", None)
        if group is not None:
            try:
                group.shutdown()
            except Exception as error:  # noqa: BLE001 - best effort during replica shutdown
                logger.warning("model group shutdown failed: %s", error)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The specserve Serve application for ``args`` (validated here: a bad key fails the deploy).

    Serve options set here: the replica's placement group (:func:`replica_bundles`, strategy
    PACK), its CPUs, and ``max_ongoing_requests`` (= ``limits.max_concurrent_requests``).
    Replica counts and autoscaling come from the YAML ``deployments`` section.
    """
    parsed = parse_app_args(args)
    config = parsed.freeze()
    deployment = serve.deployment(
        SpecServeIngress,
        name=DEPLOYMENT_NAME,
        ray_actor_options={"num_cpus": INGRESS_CPUS},
        placement_group_bundles=replica_bundles(config),
        placement_group_strategy=PLACEMENT_STRATEGY,
        max_ongoing_requests=config.max_concurrent_requests,
    )
    return deployment.bind(parsed.model_dump(mode="json"))


__all__ = [
    "DEPLOYMENT_NAME",
    "GRPC_SERVICER_FUNCTION",
    "SpecServeIngress",
    "build_app",
    "replica_bundles",
]
