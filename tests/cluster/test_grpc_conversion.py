"""Proto <-> GenerationRequest/Chunk conversion of cluster/grpc_service.py (no server)."""

from __future__ import annotations

import pytest

from actors.api import GenerationChunk, InvalidRequestError, RequestStats
from cluster import grpc_service
from protos import specserve_pb2 as pb


def test_only_fields_the_client_set_override_the_defaults():
    request = pb.GenerateRequest(
        prompt="hi",
        sampling=pb.SamplingOptions(temperature=0.0, stop=["\n"]),
        speculation=pb.SpeculationOptions(strategy="se", members=["a", "b"], gammas=[2, 3]),
    )
    generation = grpc_service.to_generation_request(request, "g-1", sampling_defaults={"max_tokens": 5, "temperature": 0.9})
    assert generation.sampling.temperature == 0.0 and generation.sampling.max_tokens == 5
    assert generation.sampling.stop == ["\n"]
    assert generation.speculation.strategy == "se"
    assert generation.speculation.members == ["a", "b"] and generation.speculation.gammas == [2, 3]
    assert generation.speculation.gamma is None and generation.speculation.weights is None


def _with_raw_field(message: bytes, field_number: int, wire_type: int, payload: bytes) -> bytes:
    key = bytes([(field_number << 3) | wire_type])
    if wire_type == 2:
        payload = bytes([len(payload)]) + payload
    return message + key + payload


@pytest.mark.parametrize(
    "raw, field",
    [
        # sampling (field 5) whose max_tokens (field 1, int64) arrives length-delimited
        (_with_raw_field(b"\x1a\x01x", 5, 2, _with_raw_field(b"", 1, 2, b"ten")), "sampling.max_tokens"),
        # speculation (field 6) whose strategy (field 1, string) arrives as a varint
        (_with_raw_field(b"\x1a\x01x", 6, 2, _with_raw_field(b"", 1, 0, b"\x07")), "speculation.strategy"),
        # prompt (field 3, string) as a 64-bit value
        (_with_raw_field(b"", 3, 1, b"\x00" * 8), "prompt"),
        # a field number the proto does not define
        (_with_raw_field(b"\x1a\x01x", 15, 0, b"\x01"), "#15"),
    ],
)
def test_wrong_wire_types_and_unknown_fields_are_rejected_by_name(raw, field):
    request = pb.GenerateRequest.FromString(raw)  # protobuf itself accepts these silently
    with pytest.raises(InvalidRequestError) as caught:
        grpc_service.to_generation_request(request, "g", {})
    assert caught.value.field == field


@pytest.mark.parametrize(
    "request_message, field",
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt=""), "prompt"),
        (pb.GenerateRequest(prompt="x", prompt_ids=[1]), "prompt"),
        (pb.GenerateRequest(prompt_ids=[1, -1]), "prompt_ids"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(top_p=2.0)), "sampling.top_p"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(top_k=-1)), "sampling.top_k"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(ensemble="median")), "speculation.ensemble"),
        (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(mu=-1.0)), "speculation.mu"),
    ],
)
def test_invalid_values_name_the_proto_field(request_message, field):
    with pytest.raises(InvalidRequestError) as caught:
        grpc_service.to_generation_request(request_message, "g", {})
    assert caught.value.field == field


def test_coordinator_sampling_fields_get_the_proto_path():
    assert grpc_service.grpc_field(InvalidRequestError("max_tokens", "m")).field == "sampling.max_tokens"
    assert grpc_service.grpc_field(InvalidRequestError("stop", "m")).field == "sampling.stop"
    assert grpc_service.grpc_field(InvalidRequestError("speculation.gamma", "m")).field == "speculation.gamma"


def test_final_chunk_carries_usage_and_speculation_stats():
    stats = RequestStats(strategy="multi_draft", method="spectr", prompt_tokens=4, completion_tokens=6, target_calls=2,
                         model_calls={"target": 2, "draft": 8}, accepted_lengths=[3, 1], block_efficiency=3.0)
    middle = grpc_service.chunk_to_response(GenerationChunk(request_id="r", token_ids=[1, 2], text="ab"), "m")
    assert not middle.finished and not middle.HasField("usage") and middle.finish_reason == ""
    final = grpc_service.chunk_to_response(
        GenerationChunk(request_id="r", token_ids=[3], text="c", finished=True, finish_reason="stop", stats=stats), "m"
    )
    assert final.finished and final.finish_reason == "stop"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens) == (4, 6, 10)
    assert dict(final.speculation.model_calls) == {"target": 2, "draft": 8}
    assert list(final.speculation.accepted_lengths) == [3, 1] and final.speculation.block_efficiency == 3.0
