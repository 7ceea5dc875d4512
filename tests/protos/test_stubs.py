"""The committed gRPC stubs are exactly what grpcio-tools generates from protos/specserve.proto."""

from __future__ import annotations

import pathlib

from protos import generate, specserve_pb2, specserve_pb2_grpc

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto(tmp_path):
    generated = generate.generate_stubs(tmp_path)
    for name, path in zip(generate.GENERATED_FILES, generated):
        committed = (REPO / name).read_text()
        assert path.read_text() == committed, f"{name} is stale: run `make protos`"


def test_service_has_unary_generate_and_server_streaming_generate_stream():
    service = specserve_pb2.DESCRIPTOR.services_by_name["SpecServe"]
    methods = {method.name: method for method in service.methods}
    assert set(methods) == {"Generate", "GenerateStream"}
    assert not methods["Generate"].client_streaming and not methods["Generate"].server_streaming
    assert not methods["GenerateStream"].client_streaming and methods["GenerateStream"].server_streaming
    assert methods["Generate"].input_type.full_name == "specserve.GenerateRequest"
    assert methods["GenerateStream"].output_type.full_name == "specserve.GenerateResponse"


def test_servicer_registration_function_is_importable_by_its_serve_path():
    from ray.serve._private.utils import import_attr

    from cluster.serving.ingress import GRPC_SERVICER_FUNCTION

    assert import_attr(GRPC_SERVICER_FUNCTION) is specserve_pb2_grpc.add_SpecServeServicer_to_server


def test_every_sampling_and_speculation_option_has_presence():
    for message in (specserve_pb2.SamplingOptions, specserve_pb2.SpeculationOptions):
        for field in message.DESCRIPTOR.fields:
            assert field.is_repeated or field.has_presence, f"{message.DESCRIPTOR.name}.{field.name}"
