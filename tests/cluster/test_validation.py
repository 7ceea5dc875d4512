"""Every request field is checked before model work, with the same rules on HTTP and gRPC, and
undecodable gRPC bytes become INVALID_ARGUMENT instead of failing inside grpcio (no Ray
needed; the served behaviour is fuzzed in test_fuzz.py)."""

from __future__ import annotations

import json
import math

import pytest

from actors.request_schema import INT64_MAX, MIN_POSITIVE_TEMPERATURE, GenerationRequest, InvalidRequestError
from cluster import grpc_service
from cluster.grpc_service import check_request_id
from cluster.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from tests.cluster.single_request import grpc_generation_request, http_generation_request
from protos import specserve_pb2, specserve_pb2_grpc

INF, NAN = math.inf, math.nan

# (case id, sampling/speculation overrides, gRPC field path): each bad value must be refused
# before any model work, by both protocols, naming the same field.
BAD_VALUES = [
    ("temperature-inf", {"temperature": INF}, "sampling.temperature"),
    ("temperature-nan", {"temperature": NAN}, "sampling.temperature"),
    ("temperature-denormal", {"temperature": 1e-320}, "sampling.temperature"),
    ("temperature-below-minimum", {"temperature": MIN_POSITIVE_TEMPERATURE / 2}, "sampling.temperature"),
    ("top-p-nan", {"top_p": NAN}, "sampling.top_p"),
    ("top-p-inf", {"top_p": INF}, "sampling.top_p"),
    ("top-k-negative", {"top_k": -1}, "sampling.top_k"),
    ("seed-negative", {"seed": -1}, "sampling.seed"),
    ("max-tokens-zero", {"max_tokens": 0}, "sampling.max_tokens"),
    ("stop-too-many", {"stop": ["a"] * 9}, "sampling.stop"),
    ("stop-empty-string", {"stop": [""]}, "sampling.stop"),
    ("stop-too-long", {"stop": ["s" * 257]}, "sampling.stop"),
    ("mu-inf", {"speculation": {"mu": INF}}, "speculation.mu"),
    ("mu-nan", {"speculation": {"mu": NAN}}, "speculation.mu"),
    ("mu-huge", {"speculation": {"strategy": "se", "ensemble": "contrastive", "mu": 1e308}}, "speculation.mu"),
    ("weights-nan", {"speculation": {"strategy": "sd", "weights": [NAN, 0.5]}}, "speculation.weights"),
    ("weights-inf", {"speculation": {"weights": [INF]}}, "speculation.weights"),
    ("weights-above-one", {"speculation": {"weights": [2.0, -1.0]}}, "speculation.weights"),
    ("weights-too-many", {"speculation": {"weights": [0.0] * 65}}, "speculation.weights"),
    ("weights-sum-not-one", {"speculation": {"strategy": "ensemble", "weights": [0.5, 0.6]}}, "speculation.weights"),
    ("members-repeated", {"speculation": {"strategy": "se", "members": ["target", "target"]}}, "speculation.members"),
    ("gammas-zero", {"speculation": {"strategy": "sd", "gammas": [0]}}, "speculation.gammas"),
    ("gammas-huge", {"speculation": {"gammas": [2**40]}}, "speculation.gammas"),
    ("members-empty-name", {"speculation": {"members": ["target", ""]}}, "speculation.members"),
    ("members-long-name", {"speculation": {"members": ["m" * 129]}}, "speculation.members"),
    ("gamma-huge", {"speculation": {"gamma": 2**62}}, "speculation.gamma"),
    ("num-drafts-negative", {"speculation": {"num_drafts": -3}}, "speculation.num_drafts"),
    ("method-unknown-long", {"speculation": {"method": "m" * 200}}, "speculation.method"),
]

HTTP_NAMES = {"sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
              "sampling.seed": "seed", "sampling.max_tokens": "max_tokens", "sampling.stop": "stop"}


def _http(overrides: dict) -> InvalidRequestError:
    body = {"prompt": "x", **overrides}
    with pytest.raises(InvalidRequestError) as caught:
        parsed = parse_body(CompletionRequest, json.dumps(body).encode())  # NaN / Infinity as JSON tokens
        http_generation_request(parsed, "cmpl-1", {})
    return caught.value


def _grpc(overrides: dict) -> InvalidRequestError:
    speculation = overrides.get("speculation", {})
    sampling = {key: value for key, value in overrides.items() if key != "speculation"}
    with pytest.raises(InvalidRequestError) as caught:
        request = specserve_pb2.GenerateRequest(
            prompt="x",
            sampling=specserve_pb2.SamplingOptions(**sampling),
            speculation=specserve_pb2.SpeculationOptions(**speculation),
        )
        grpc_generation_request(request, "grpc-1", {})
    return caught.value


@pytest.mark.parametrize("overrides, field", [case[1:] for case in BAD_VALUES], ids=[case[0] for case in BAD_VALUES])
def test_bad_values_are_refused_by_both_protocols_naming_the_field(overrides, field):
    http_error = _http(overrides)
    assert http_error.field == HTTP_NAMES.get(field, field), http_error
    grpc_error = grpc_service.grpc_field(_grpc(overrides))
    assert grpc_error.field == field, grpc_error


def test_http_only_values_beyond_int64_are_refused():
    for name in ("seed", "top_k", "max_tokens"):
        assert _http({name: 2**64}).field == name
    assert _http({"prompt": [2**63]}).field == "prompt"


def test_prompt_size_limit_applies_to_text_ids_and_chat():
    body = CompletionRequest(prompt="abcdef")
    with pytest.raises(InvalidRequestError) as caught:
        http_generation_request(body, "cmpl-1", {}, max_prompt_chars=5)
    assert caught.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as caught:
        http_generation_request(CompletionRequest(prompt=[1] * 6), "cmpl-1", {}, max_prompt_chars=5)
    assert caught.value.field == "prompt"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}])
    with pytest.raises(InvalidRequestError) as caught:
        http_generation_request(chat, "chatcmpl-1", {}, max_prompt_chars=5)
    assert caught.value.field == "messages"
    with pytest.raises(InvalidRequestError) as caught:
        grpc_generation_request(specserve_pb2.GenerateRequest(prompt_ids=[1] * 6), "g", {}, max_prompt_chars=5)
    assert caught.value.field == "prompt_ids"
    http_generation_request(body, "cmpl-1", {}, max_prompt_chars=6)  # at the limit: accepted


def test_good_values_pass():
    request = grpc_generation_request(
        specserve_pb2.GenerateRequest(
            prompt="x",
            sampling=specserve_pb2.SamplingOptions(temperature=MIN_POSITIVE_TEMPERATURE, top_p=1.0, seed=INT64_MAX,
                                                   top_k=INT64_MAX, stop=["s" * 256] * 8),
            speculation=specserve_pb2.SpeculationOptions(mu=0.0, weights=[0.25, 0.75], gammas=[1, 32]),
        ),
        "grpc-1",
        {},
    )
    assert request.sampling.seed == INT64_MAX and request.speculation.gammas == [1, 32]
    assert http_generation_request(CompletionRequest(prompt="x", temperature=0), "c", {}).sampling.temperature == 0


@pytest.mark.parametrize("bias", [{1: NAN}, {1: INF}, {1: -101.0}, {-1: 1.0}, {i: 0.0 for i in range(1025)}],
                         ids=["nan", "inf", "below-range", "negative-id", "too-many"])
def test_logit_bias_is_bounded(bias):
    with pytest.raises(InvalidRequestError) as caught:
        GenerationRequest.parse({"request_id": "r", "prompt": "x", "sampling": {"logit_bias": bias}}, max_prompt_chars=100)
    assert caught.value.field == "sampling.logit_bias"
    GenerationRequest.parse({"request_id": "r", "prompt": "x", "sampling": {"logit_bias": {1: -100.0, 2: 100.0}}}, 100)


def test_grpc_request_id_model_and_names_are_bounded():
    assert check_request_id("request_id", "my-request-1:a.b_c") == "my-request-1:a.b_c"
    for bad in ("", "has space", "new\nline", "x" * 129, "slash/id", "ünï"):
        with pytest.raises(InvalidRequestError):
            check_request_id("request_id", bad)
    assert grpc_service.client_request_id(specserve_pb2.GenerateRequest()) is None
    with pytest.raises(InvalidRequestError) as caught:
        grpc_service.client_request_id(specserve_pb2.GenerateRequest(request_id="a b"))
    assert caught.value.field == "request_id"
    with pytest.raises(InvalidRequestError) as caught:
        grpc_generation_request(specserve_pb2.GenerateRequest(prompt="x", model="m" * 129), "g", {})
    assert caught.value.field == "model"
    with pytest.raises(InvalidRequestError) as caught:
        grpc_generation_request(
            specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(strategy="s" * 129)), "g", {}
        )
    assert caught.value.field == "speculation.strategy"


# ------------------------------------------------------------------ undecodable gRPC bytes


@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff\xff", b"\x1a\x02\xff\xfe", b"\x1a\x10abc", b"\x0a", b"\x2a\x05\x08"],
    ids=["garbage", "invalid-utf8-prompt", "truncated-string", "truncated-tag", "truncated-submessage"],
)
def test_undecodable_bytes_become_invalid_argument_naming_the_request(data):
    decoded = grpc_service.decode_request(data)
    assert isinstance(decoded, grpc_service.UndecodableRequest) and decoded.size == len(data)
    with pytest.raises(InvalidRequestError) as caught:
        grpc_service.check_decoded(decoded)
    assert caught.value.field == "request" and "not a valid specserve.GenerateRequest" in caught.value.message


def test_decodable_bytes_decode_as_before():
    request = specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(max_tokens=3))
    decoded = grpc_service.decode_request(request.SerializeToString())
    assert decoded == request and grpc_service.check_decoded(decoded) is decoded
    assert grpc_service.decode_request(b"") == specserve_pb2.GenerateRequest()


def test_undecodable_marker_pickles():
    import pickle

    marker = grpc_service.UndecodableRequest(size=3, reason="DecodeError")
    assert pickle.loads(pickle.dumps(marker)) == marker  # Serve's proxy pickles it to the replica


class _RecordingServer:
    def __init__(self):
        self.generic = []
        self.registered = {}

    def add_generic_rpc_handlers(self, handlers):
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service, handlers):
        self.registered[service] = handlers


def test_registration_is_the_stubs_registration_with_the_tolerant_deserializer():
    ours, stubs = _RecordingServer(), _RecordingServer()
    servicer = specserve_pb2_grpc.SpecServeServicer()
    grpc_service.add_SpecServeServicer_to_server(servicer, ours)
    specserve_pb2_grpc.add_SpecServeServicer_to_server(servicer, stubs)
    assert set(ours.registered) == set(stubs.registered) == {"specserve.SpecServe"}
    for name, handler in ours.registered["specserve.SpecServe"].items():
        original = stubs.registered["specserve.SpecServe"][name]
        assert handler.request_deserializer is grpc_service.decode_request
        assert handler._replace(request_deserializer=None) == original._replace(request_deserializer=None)
    (generic,) = ours.generic
    assert generic.service_name() == "specserve.SpecServe"
    for method in ("Generate", "GenerateStream"):
        details = type("Details", (), {"method": f"/specserve.SpecServe/{method}"})()
        assert generic.service(details).request_deserializer is grpc_service.decode_request


def test_registration_path_is_what_serve_imports():
    from ray.serve._private.utils import import_attr

    assert import_attr(grpc_service.SERVICER_REGISTRATION) is grpc_service.add_SpecServeServicer_to_server
