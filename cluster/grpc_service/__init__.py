"""gRPC side of the Serve ingress: proto <-> GenerationRequest/GenerationChunk, status codes.

Ray Serve's gRPC proxy deserializes ``specserve.GenerateRequest`` with the request
deserializer of the registered service and calls the ingress deployment's method of the same
name as the rpc (``Generate`` / ``GenerateStream``) with the message and a ``grpc_context``.
The service is registered through ``grpc_options.grpc_servicer_functions:
["cluster.grpc_service.add_SpecServeServicer_to_server"]`` (:func:`add_SpecServeServicer_to_server`):
the committed stubs' registration (``protos/specserve_pb2_grpc.py``) with a tolerant request
deserializer. With the stubs' own deserializer, bytes that are not a ``GenerateRequest`` fail
inside grpcio before Serve sees the call, and the client gets ``UNKNOWN`` (``DecodeError``);
:func:`decode_request` instead hands an :class:`UndecodableRequest` to the replica, which
answers ``INVALID_ARGUMENT`` (after the API-key check, like every call).

The ingress methods (``cluster/serving/ingress.py``) use the functions here:

- :func:`check_wire_types` rejects fields that arrived with the wrong wire type (a client
  built from a different .proto): protobuf keeps such fields as *unknown fields* instead of
  failing, so without this check they would silently take their defaults;
- :func:`to_generation_requests` reads presence-aware options and checks every field by the
  constraints of :mod:`actors.request_schema` (the same ones HTTP uses) and names the bad field
  (``sampling.temperature``, ``speculation.gamma``) in an :class:`InvalidRequestError`;
  ``sampling.n`` > 1 gives one coordinator request per sample (sample ``i`` seeded with
  ``seed + i``);
- :func:`chunk_to_response` / :func:`final_response` render chunks (tagged with their choice
  ``index``) and results (every choice in ``choices``, choice 0 also in the top-level fields),
  with per-token log-probabilities when ``sampling.logprobs`` is set;
- :func:`grpc_field` names a coordinator error's field by its proto path.

By job: the servicer registration and decoding (:mod:`cluster.grpc_service.decoding`), messages to
generation requests (:mod:`cluster.grpc_service.to_generation`) and responses (:mod:`cluster.grpc_service.responses`);
every name is re-exported here. Status codes (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE,
INTERNAL) are chosen by the ingress (``cluster.serving.ingress``) and set on Serve's ``grpc_context``.
"""

from cluster.grpc_service.decoding import (
    SERVICER_REGISTRATION,
    UndecodableRequest,
    add_SpecServeServicer_to_server,
    check_decoded,
    decode_request,
)
from cluster.grpc_service.to_generation import (
    check_request_id,
    check_wire_types,
    client_request_id,
    grpc_field,
    request_prompt,
    samples,
    sampling_overrides,
    speculation_overrides,
    structured_output,
    to_generation_requests,
)
from cluster.grpc_service.responses import (
    chunk_to_response,
    final_response,
    logprobs_to_proto,
    speculation_to_proto,
    stats_to_proto,
    usage_to_proto,
    wants_logprobs,
)

__all__ = [
    "SERVICER_REGISTRATION",
    "UndecodableRequest",
    "add_SpecServeServicer_to_server",
    "check_decoded",
    "check_request_id",
    "check_wire_types",
    "chunk_to_response",
    "client_request_id",
    "decode_request",
    "final_response",
    "grpc_field",
    "logprobs_to_proto",
    "request_prompt",
    "samples",
    "sampling_overrides",
    "speculation_overrides",
    "speculation_to_proto",
    "stats_to_proto",
    "structured_output",
    "to_generation_requests",
    "usage_to_proto",
    "wants_logprobs",
]
