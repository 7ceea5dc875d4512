"""The Ray Serve application: one ingress deployment serving HTTP (OpenAI-compatible) and gRPC.

``build_app(args)`` is the ``import_path`` target of every ``deploy/*.yaml``
(``cluster.app:build_app``) and the ONLY place Serve options are set. Each replica of the
ingress deployment owns a whole model group (a Coordinator and one ModelWorker per model),
started in the replica's own placement group: bundle 0 holds the replica, bundles 1.. hold the
model workers (see :func:`replica_bundles`). Scaling the deployment (``num_replicas`` or
``autoscaling_config`` in the YAML) therefore scales whole model groups.

Request path: HTTP (FastAPI routes below) or gRPC (methods ``Generate`` / ``GenerateStream``
of :class:`cluster.serving.grpc_ingress.GrpcMethods`, named like the rpcs of ``protos/specserve.proto``
so Serve's gRPC proxy routes to them) ->
one :class:`actors.request_schema.GenerationRequest` per choice (prompts x ``n`` samples) ->
``Coordinator.generate`` (an async generator actor method, consumed as a streaming
ObjectRefGenerator, :mod:`cluster.serving.streams`), the choices of one request concurrently -> chunks
back to the client, interleaved and tagged with their choice index when streamed.

Every field is checked before any model work by the constraints of :mod:`actors.request_schema` (then,
in the coordinator, the plan against the deployment, resolved once per request, and the prompt
against the models), the same way on both protocols. With an
API key configured (``args.security.api_key`` or ``SPECSERVE_API_KEY``), every route but
``GET /health`` (the API's schema and its ``/docs`` / ``/redoc`` pages included) and every gRPC
call must present it (:mod:`cluster.serving.security`).

Errors all go through :func:`cluster.serving.errors.client_error`: :class:`actors.request_schema.InvalidRequestError`
(raised here while parsing, or by the coordinator before any work) becomes HTTP 400 with an
OpenAI-style error body / gRPC INVALID_ARGUMENT, both naming the field; a missing or wrong API
key 401 / UNAUTHENTICATED; a chunk with ``error`` set (a failure mid-request) HTTP 500 / gRPC
INTERNAL (in a stream: an ``error`` event); a dead model group 503 / UNAVAILABLE. Server
errors reach the client as a fixed message and the request id (also in the
``specserve-request-id`` response header / trailing metadata); the detail is logged under
that id. A client that disconnects cancels its coordinator stream, which frees the request's
sessions in the workers.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.util.placement_group import get_current_placement_group

from actors.request_schema import GenerationChunk, InvalidRequestError
from actors.coordination.metrics import GroupIdentity
from actors.worker.bursts import PROBE_GROUP
from cluster import grpc_service
from cluster.config import GroupConfig, SpecServeArgs, parse_app_args, resolve_api_key
from cluster.serving.errors import (
    ClientError,
    ModelGroupUnavailable,
    RequestFailed,
    Unauthenticated,
    clean_text,
    client_error,
)
from cluster.schemas.to_generation import to_generation_requests
from cluster.serving.grpc_ingress import GrpcMethods
from cluster.serving.metrics import CONTENT_TYPE, CoordinatorDirectory, render
from cluster.serving.replica_tokenizer import ReplicaTokenizer
from cluster.serving.request_path import RequestPath
from cluster.responses import (
    SSE_DONE,
    ChoiceStream,
    CompletionAccumulator,
    completion_response,
    error_body,
    models_list,
    sse_event,
    usage_chunk,
)
from cluster.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, http_field, parse_body
from cluster.serving.security import grpc_all_interfaces_warning, require_key
from cluster.serving.streams import (
    CoordinatorStream,
    ModelGroupUnhealthy,
    collect_all,
    interleave,
    model_group_health,
    prime_all,
    start_streams,
    unwrap_task_error,
    wait,
)

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "SpecServeIngress"
#: CPUs of the ingress replica itself (bundle 0): it only parses requests and relays chunks.
INGRESS_CPUS = 0.1
#: Placement strategy of a replica's bundles: a group on as few nodes as its resources allow.
PLACEMENT_STRATEGY = "PACK"
#: The committed stubs' servicer registration function. Serve configs list
#: :data:`GRPC_SERVICER_REGISTRATION` instead, which registers the same service through it.
GRPC_SERVICER_FUNCTION = "protos.specserve_pb2_grpc.add_SpecServeServicer_to_server"
#: gRPC servicer registration function for ``grpc_options.grpc_servicer_functions``: the
#: stubs' registration with a request deserializer that turns undecodable bytes into
#: INVALID_ARGUMENT (see :mod:`cluster.grpc_service`).
GRPC_SERVICER_REGISTRATION = grpc_service.SERVICER_REGISTRATION
DEFAULT_MODEL_NAME = "specserve"
#: Index of the first model-worker bundle in a replica's placement group (bundle 0 = replica).
MODEL_BUNDLE_OFFSET = 1
HEALTH_TIMEOUT_S = 10.0
#: Response header carrying the request id of an error (Serve's own ``x-request-id`` header
#: holds Serve's id for the same request; gRPC: :data:`cluster.serving.grpc_ingress.REQUEST_ID_METADATA`).
REQUEST_ID_HEADER = "specserve-request-id"
#: Response header of ``GET /metrics``: the replica that answered the scrape (it covers them all).
REPLICA_HEADER = "specserve-replica"


def replica_bundles(config: GroupConfig) -> list[dict[str, float]]:
    """Placement group bundles of one ingress replica: the replica, then one per model worker.

    Bundle 0 holds the ingress replica (Serve places the replica actor there) plus the
    coordinator's CPUs (the coordinator may go in any bundle with room); bundle
    ``MODEL_BUNDLE_OFFSET + i`` reserves ``config.models[i]`` (see
    :func:`cluster.serving.bringup.model_group_bundles`).
    """
    from cluster.serving.bringup import model_group_bundles

    return [{"CPU": INGRESS_CPUS + config.coordinator_cpus}, *model_group_bundles(config)]

def _http_client_error(error: BaseException, request_id: str, chat: bool = False, what: str = "request") -> ClientError:
    if isinstance(error, InvalidRequestError):
        error = http_field(error, chat)
    return client_error(error, request_id, what)


def _http_error(error: BaseException, request_id: str, chat: bool = False, what: str = "request") -> JSONResponse:
    """HTTP status + OpenAI error body of a failure (:func:`cluster.serving.errors.client_error`)."""
    failure = _http_client_error(error, request_id, chat, what)
    headers = {REQUEST_ID_HEADER: request_id}
    if failure.http_status == 401:
        headers["www-authenticate"] = "Bearer"
    body = error_body(failure.message, failure.param, failure.error_type, failure.code)
    return JSONResponse(body, status_code=failure.http_status, headers=headers)

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


# FastAPI's own /docs, /redoc and /openapi.json are turned off: the ingress serves them as routes
# of its own, which need the API key like every route but /health.
fastapi_app = FastAPI(
    title="specserve",
    description="Lossless speculative decoding and speculative ensembles (OpenAI-compatible API).",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)


# NOTE: serve.ingress serializes the class when it is applied, so everything its methods use
# must be defined above this point.
@serve.ingress(fastapi_app)
class SpecServeIngress(GrpcMethods):
    """One replica: a model group plus the HTTP routes (here) and gRPC methods
    (:class:`cluster.serving.grpc_ingress.GrpcMethods`) that feed it."""

    def __init__(self, args: dict[str, Any], start_group: Callable[..., Any] | None = None):
        """``start_group(config, placement_group=..., first_bundle=..., identity=...)`` builds the
        model group (default: :func:`cluster.serving.bringup.start_model_group`); it must return an object
        with a ``coordinator`` actor handle and a ``shutdown()`` method. ``identity`` (the served
        model name and this replica's id) names the coordinator so ``GET /metrics`` finds it."""
        if start_group is None:
            from cluster.serving.bringup import start_model_group as start_group
        if _replica_id():  # a Serve replica: its bring-up lines (workers' slots, forward paths) in the serve log
            from cluster.serving.bringup import show_startup_logs

            show_startup_logs()

        self._args: SpecServeArgs = parse_app_args(args)
        self._config: GroupConfig = self._args.freeze()
        model_name = _served_model_name()
        api_key = resolve_api_key(self._args)
        if api_key is None:
            logger.warning("%s (HTTP is unauthenticated too)", grpc_all_interfaces_warning([model_name]))
        placement_group = get_current_placement_group()
        self._placement_group_id = placement_group.id.hex() if placement_group else None
        logger.info(
            "starting model group %s (placement group %s)",
            [model.name for model in self._config.models],
            self._placement_group_id,
        )
        identity = GroupIdentity(model_name, _replica_id() or uuid.uuid4().hex[:12])
        self._group = start_group(self._config, placement_group=placement_group, first_bundle=MODEL_BUNDLE_OFFSET,
                                  identity=identity)
        super().__init__(RequestPath(
            api_key=api_key,
            model_name=model_name,
            coordinator=self._group.coordinator,
            tokens=ReplicaTokenizer(self._config.tokenizer_path),
            max_prompt_chars=self._config.max_prompt_chars,
            # Choices (prompts x n) per request: each is a coordinator request, all decoded at once.
            max_choices=max(1, min(MAX_CHOICES, self._config.max_concurrent_requests)),
            # Deployment-wide sampling defaults for unset request fields; none beyond
            # actors.request_schema.SamplingParams' own today (the YAML args have no sampling section).
            sampling_defaults={},
        ))
        self._metrics = CoordinatorDirectory(model_name, identity.actor_name, self.request_path.coordinator)

    # ------------------------------------------------------------------ HTTP

    def _http_auth(self, http_request: Request) -> None:
        """Raise :class:`cluster.serving.errors.Unauthenticated` unless the request presents the API key."""
        require_key(self.request_path.api_key, http_request.headers)

    def _refused(self, http_request: Request, what: str) -> JSONResponse | None:
        """The 401 response of a request without the API key (when one is set), else None."""
        try:
            self._http_auth(http_request)
        except Unauthenticated as error:
            return _http_error(error, self.request_path.new_request_id(what))
        return None

    @fastapi_app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when the replica's coordinator and workers answer, 503 otherwise (open: no API key)."""
        request_id = self.request_path.new_request_id("health")
        try:
            await wait(self.request_path.coordinator.health.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure means unhealthy
            unavailable = unwrap_task_error(error)
            if not isinstance(unavailable, ModelGroupUnavailable):
                unavailable = ModelGroupUnavailable(f"health check failed: {type(error).__name__}: {error}")
            failure = client_error(unavailable, request_id, "health check")
            return JSONResponse(
                {"status": "unavailable", "error": failure.message, "request_id": request_id},
                status_code=503,
                headers={REQUEST_ID_HEADER: request_id},
            )
        return JSONResponse({"status": "ok", "model": self.request_path.model_name})

    async def check_health(self) -> None:
        """Serve's replica health check: raises when the coordinator or a model worker does not
        answer, so Serve replaces the replica (and rebuilds its model group) after its failure
        threshold. A worker that died is restarted by Ray in a few seconds, well inside it."""
        await model_group_health(self.request_path.coordinator.health.remote(), HEALTH_TIMEOUT_S)

    @fastapi_app.get("/v1/status")
    async def status(self, http_request: Request) -> JSONResponse:
        """This replica's model group: models, defaults, active requests, open sessions per worker."""
        request_id = self.request_path.new_request_id("status")
        names = list(self._group.workers)
        try:
            self._http_auth(http_request)
            description = await self.request_path.coordinator.describe.remote()
            sessions = await asyncio.gather(*(self._group.workers[name].num_sessions.options(
                concurrency_group=PROBE_GROUP).remote() for name in names))
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response
            return _http_error(unwrap_task_error(error), request_id, what="status request")
        return JSONResponse(
            {
                "model": self.request_path.model_name,
                "replica": _replica_id(),
                "replica_actor": ray.get_runtime_context().get_actor_id(),
                "placement_group": self._placement_group_id,
                "coordinator": self.request_path.coordinator._actor_id.hex(),
                "workers": {name: getattr(handle, "host", handle)._actor_id.hex()  # a hosted model: its host's
                            for name, handle in self._group.workers.items()},
                "sessions": dict(zip(names, sessions)),
                **description,
            }
        )

    @fastapi_app.get("/metrics")
    async def metrics(self, http_request: Request) -> Response:
        """Prometheus text: the metrics of every model group (replica) of this application
        (:mod:`cluster.serving.metrics`); needs the API key when one is set."""
        if (refused := self._refused(http_request, "metrics")) is not None:
            return refused
        scrape = await self._metrics.scrape()
        return Response(render(self.request_path.model_name, scrape), media_type=CONTENT_TYPE,
                        headers={REPLICA_HEADER: _replica_id()})

    @fastapi_app.get("/v1/models")
    async def models(self, http_request: Request) -> JSONResponse:
        if (refused := self._refused(http_request, "models")) is not None:
            return refused
        return JSONResponse(models_list([self.request_path.model_name]))

    @fastapi_app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, http_request: Request) -> JSONResponse:
        """The HTTP API's OpenAPI schema (FastAPI's); needs the API key when one is set."""
        return self._refused(http_request, "openapi") or JSONResponse(fastapi_app.openapi())

    @fastapi_app.get("/docs", include_in_schema=False)
    async def docs(self, http_request: Request) -> Response:
        """The schema's Swagger UI page; needs the API key when one is set (and so does the
        schema the page then loads)."""
        schema_url = http_request.scope.get("root_path", "").rstrip("/") + "/openapi.json"
        return self._refused(http_request, "docs") or get_swagger_ui_html(
            openapi_url=schema_url, title=f"{fastapi_app.title} - Swagger UI")

    @fastapi_app.get("/redoc", include_in_schema=False)
    async def redoc(self, http_request: Request) -> Response:
        """The schema's ReDoc page; needs the API key when one is set."""
        schema_url = http_request.scope.get("root_path", "").rstrip("/") + "/openapi.json"
        return self._refused(http_request, "redoc") or get_redoc_html(openapi_url=schema_url,
                                                                         title=f"{fastapi_app.title} - ReDoc")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, chat=True)

    async def _openai(self, http_request: Request, chat: bool) -> Response:
        path = self.request_path
        started = time.monotonic()
        created = int(time.time())
        request_id = path.new_request_id("chatcmpl" if chat else "cmpl")
        try:
            self._http_auth(http_request)
            body = parse_body(ChatCompletionRequest if chat else CompletionRequest, await http_request.body())
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response (fields named as sent)
            path.count_if_invalid(error)
            return _http_error(error, request_id)
        try:
            path.check_model(body.model)
            if body.user:
                logger.info("request %s: user %r", request_id, clean_text(body.user, 128))
            prompt = await path.tokens.chat_prompt(body) if chat else None
            specs, generations = to_generation_requests(
                body, request_id, path.sampling_defaults, path.max_prompt_chars, path.max_choices, chat_prompt=prompt,
            )
            wants_texts = body.logprobs_count() is not None or body.prompt_logprobs_count() is not None
            texts = (await path.tokens.texts())[1] if wants_texts else None
            prefixes = await path.tokens.echo_prefixes(body, specs)
            streams = start_streams(path.coordinator, generations)
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response
            path.count_if_invalid(error)
            return _http_error(unwrap_task_error(error), request_id, chat)
        token_ids = bool(body.return_token_ids)
        rendering = {
            "echo_logprobs": getattr(body, "echo_logprobs", None),
            "prompt_logprobs": body.prompt_logprobs,
            "generated_logprobs": body.logprobs_count() is not None,
        }
        if not body.streaming:
            tool_call = body.tool_call() if chat else None
            results = [CompletionAccumulator(spec.index, prefix, counts_prompt=spec.sample_index == 0)
                       for spec, prefix in zip(specs, prefixes)]
            try:
                await collect_all(streams, results)
            except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response
                return _http_error(error, request_id, chat)
            response = completion_response(request_id, path.model_name, created, results, chat, token_ids,
                                           logprobs=texts, wall_s=time.monotonic() - started, tool_call=tool_call,
                                           **rendering)
            return JSONResponse(response)
        try:
            firsts = await prime_all(streams)
        except Exception as error:  # noqa: BLE001 - mapped to an HTTP error response
            return _http_error(error, request_id, chat)
        renderers = [
            ChoiceStream(request_id, path.model_name, created, chat, index=spec.index, prefix=prefix,
                         counts_prompt=spec.sample_index == 0, token_ids=token_ids, logprobs=texts,
                         single=len(specs) == 1, include_usage=body.include_usage,
                         continuous_usage=body.continuous_usage, **rendering)
            for spec, prefix in zip(specs, prefixes)
        ]
        events = self._sse_events(streams, firsts, renderers, request_id, created, chat, body.include_usage, started)
        return StreamingResponse(events, media_type="text/event-stream", headers={REQUEST_ID_HEADER: request_id})

    async def _sse_events(
        self,
        streams: list[CoordinatorStream],
        firsts: list[GenerationChunk | None],
        renderers: list[ChoiceStream],
        request_id: str,
        created: int,
        chat: bool,
        include_usage: bool,
        started: float,
    ) -> AsyncIterator[bytes]:
        """Server-sent events of one request, the choices interleaved as their chunks arrive;
        cancels every coordinator stream if the client leaves."""
        chunks = interleave(streams, firsts)
        try:
            async for position, chunk in chunks:
                yield sse_event(renderers[position].render(chunk))
            if include_usage:
                results = [renderer.result for renderer in renderers]
                wall_s = time.monotonic() - started
                yield sse_event(usage_chunk(request_id, self.request_path.model_name, created, results, chat, wall_s))
        except Exception as error:  # noqa: BLE001 - reported to the client as an error event
            response = _http_error(error, request_id, chat)
            yield sse_event(response.body.decode())
        finally:
            await chunks.aclose()
            for stream in streams:
                stream.cancel()
        yield SSE_DONE
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
    PACK), its CPUs, and ``max_ongoing_requests`` (= ``limits.max_concurrent_requests`` +
    ``limits.max_queued_requests``: the coordinator's scheduler does the queueing, and answers 429
    past it, instead of an unbounded queue in front of the replica).
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
        max_ongoing_requests=config.max_concurrent_requests + config.max_queued_requests,
    )
    return deployment.bind(parsed.model_dump(mode="json"))


__all__ = [
    "DEPLOYMENT_NAME",
    "ModelGroupUnhealthy",
    "GRPC_SERVICER_FUNCTION",
    "GRPC_SERVICER_REGISTRATION",
    "ModelGroupUnavailable",
    "RequestFailed",
    "SpecServeIngress",
    "build_app",
    "model_group_health",
    "replica_bundles",
]
