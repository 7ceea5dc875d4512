"""Proto <-> GenerationRequest/Chunk conversion of cluster/grpc_service/ (no server)."""

from __future__ import annotations

import pytest

from actors.request_schema import GenerationChunk, InvalidRequestError, RequestStats
from cluster import grpc_service
from protos import specserve_pb2 as pb
from tests.cluster.single_request import grpc_generation_request


def test_only_fields_the_client_set_override_the_defaults():
    request = pb.GenerateRequest(
        prompt="hi",
        sampling=pb.SamplingOptions(temperature=0.0, stop=["\n"]),
        speculation=pb.SpeculationOptions(strategy="se", members=["a", "b"], gammas=[2, 3]),
    )
    generation = grpc_generation_request(request, "g-1", sampling_defaults={"max_tokens": 5, "temperature": 0.9})
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
        grpc_generation_request(request, "g", {})
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
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(structured_outputs=pb.StructuredOutputs(
            regex="(("))), "sampling.structured_outputs.regex"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(structured_outputs=pb.StructuredOutputs(
            json='{"type": "nonsense"}'))), "sampling.structured_outputs.json"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(structured_outputs=pb.StructuredOutputs(
            json="not json"))), "sampling.structured_outputs.json"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(structured_outputs=pb.StructuredOutputs(
            grammar="start: nope"))), "sampling.structured_outputs.grammar"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(structured_outputs=pb.StructuredOutputs())),
         "sampling.structured_outputs"),
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(structured_outputs=pb.StructuredOutputs(
            regex="a", choice=["b"]))), "sampling.structured_outputs"),
    ],
)
def test_invalid_values_name_the_proto_field(request_message, field):
    with pytest.raises(InvalidRequestError) as caught:
        grpc_generation_request(request_message, "g", {})
    assert caught.value.field == field


def test_coordinator_sampling_fields_get_the_proto_path():
    assert grpc_service.grpc_field(InvalidRequestError("max_tokens", "m")).field == "sampling.max_tokens"
    assert grpc_service.grpc_field(InvalidRequestError("stop", "m")).field == "sampling.stop"
    assert grpc_service.grpc_field(InvalidRequestError("speculation.gamma", "m")).field == "speculation.gamma"


def test_final_chunk_carries_usage_and_speculation_stats():
    stats = RequestStats(strategy="multi_draft", method="spectr", prompt_tokens=4, completion_tokens=6, target_calls=2,
                         model_calls={"target": 2, "draft": 8}, accepted_lengths=[3, 1], draft_lengths=[4, 2],
                         block_efficiency=3.0)
    middle = grpc_service.chunk_to_response(GenerationChunk(request_id="r", token_ids=[1, 2], text="ab"), "m")
    assert not middle.finished and not middle.HasField("usage") and middle.finish_reason == ""
    final = grpc_service.chunk_to_response(
        GenerationChunk(request_id="r", token_ids=[3], text="c", finished=True, finish_reason="stop", stats=stats), "m"
    )
    assert final.finished and final.finish_reason == "stop"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens) == (4, 6, 10)
    assert dict(final.speculation.model_calls) == {"target": 2, "draft": 8}
    assert list(final.speculation.accepted_lengths) == [3, 1] and final.speculation.block_efficiency == 3.0
    assert list(final.speculation.draft_lengths) == [4, 2]


def test_n_samples_are_seeded_seed_plus_i_with_their_own_ids():
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(n=3, seed=7, temperature=0.5))
    specs, generations = grpc_service.to_generation_requests(request, "g-1", {})
    assert [spec.index for spec in specs] == [0, 1, 2]
    assert [g.request_id for g in generations] == ["g-1-0", "g-1-1", "g-1-2"]
    assert [g.sampling.seed for g in generations] == [7, 8, 9]
    assert grpc_service.to_generation_requests(pb.GenerateRequest(prompt="hi"), "g-2", {})[1][0].request_id == "g-2"


def test_penalties_logit_bias_and_logprobs_map_onto_sampling_params():
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={3: -100.0, 9: 2.0},
        logprobs=True, top_logprobs=4))
    sampling = grpc_generation_request(request, "g", {}).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.1)
    assert sampling.logit_bias == {3: -100.0, 9: 2.0} and sampling.logprobs == 4
    only_tokens = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(logprobs=True))
    assert grpc_generation_request(only_tokens, "g", {}).sampling.logprobs == 0
    neutral = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingOptions(
        presence_penalty=0.0, frequency_penalty=0.0, logprobs=False, top_logprobs=0, n=1))
    sampling = grpc_generation_request(neutral, "g", {}).sampling
    assert (sampling.presence_penalty, sampling.logprobs, sampling.logit_bias) == (0.0, None, {})


@pytest.mark.parametrize(
    "options, field",
    [
        (pb.SamplingOptions(n=0), "sampling.n"),
        (pb.SamplingOptions(n=65), "sampling.n"),
        (pb.SamplingOptions(n=2, seed=2**63 - 1), "sampling.seed"),
        (pb.SamplingOptions(presence_penalty=float("nan")), "sampling.presence_penalty"),
        (pb.SamplingOptions(frequency_penalty=float("-inf")), "sampling.frequency_penalty"),
        (pb.SamplingOptions(frequency_penalty=2.5), "sampling.frequency_penalty"),
        (pb.SamplingOptions(repetition_penalty=0.0), "sampling.repetition_penalty"),
        (pb.SamplingOptions(repetition_penalty=float("inf")), "sampling.repetition_penalty"),
        (pb.SamplingOptions(logit_bias={5: float("nan")}), "sampling.logit_bias"),
        (pb.SamplingOptions(logit_bias={5: 101.0}), "sampling.logit_bias"),
        (pb.SamplingOptions(logit_bias={-1: 1.0}), "sampling.logit_bias"),
        (pb.SamplingOptions(top_logprobs=2), "sampling.top_logprobs"),
        (pb.SamplingOptions(logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
        (pb.SamplingOptions(logprobs=True, top_logprobs=-1), "sampling.top_logprobs"),
    ],
)
def test_new_sampling_options_are_checked_by_name(options, field):
    with pytest.raises(InvalidRequestError) as caught:
        grpc_service.to_generation_requests(pb.GenerateRequest(prompt="x", sampling=options), "g", {})
    assert caught.value.field == field


def test_choices_beyond_the_deployment_limit_are_refused():
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingOptions(n=5))
    with pytest.raises(InvalidRequestError) as caught:
        grpc_service.to_generation_requests(request, "g", {}, max_choices=4)
    assert caught.value.field == "sampling.n"


def test_coordinator_errors_on_new_fields_get_the_proto_path():
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs"):
        assert grpc_service.grpc_field(InvalidRequestError(name, "not supported by this server yet")).field \
            == f"sampling.{name}"


def test_unary_response_has_every_choice_and_stream_messages_their_index_and_logprobs():
    from actors.request_schema import TokenLogprob
    from cluster.responses import CompletionAccumulator, TokenTexts

    texts = TokenTexts(lambda token_id: {1: b"a", 2: b"\xc3", 3: b"\xa9"}[token_id])
    results = []
    for index, tokens in enumerate(([1, 2], [3])):
        result = CompletionAccumulator(index, counts_prompt=index == 0)
        stats = RequestStats(strategy="sd", method="block", prompt_tokens=4, completion_tokens=len(tokens),
                             target_calls=1, model_calls={"target": 1})
        result.add(GenerationChunk(request_id=f"r-{index}", token_ids=tokens, text="x" * len(tokens), finished=True,
                                   finish_reason="length", stats=stats,
                                   logprobs=[TokenLogprob(token_id=t, logprob=-0.5, top=[(1, -0.25)]) for t in tokens]))
        results.append(result)
    response = grpc_service.final_response("r", "m", results, texts, wall_s=1.0)
    assert [c.index for c in response.choices] == [0, 1]
    assert list(response.token_ids) == [1, 2] and response.text == "xx"  # choice 0 in the top-level fields
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (4, 3)  # the prompt counted once
    assert response.speculation.target_calls == 2 and response.speculation.block_efficiency == 1.5
    assert response.choices[1].usage.completion_tokens == 1
    logprob = response.choices[0].logprobs[1]
    assert (logprob.token_id, logprob.logprob, logprob.token, logprob.bytes) == (2, -0.5, "bytes:\\xc3", b"\xc3")
    assert [(top.token_id, top.token) for top in logprob.top_logprobs] == [(1, "a")]
    message = grpc_service.chunk_to_response(
        GenerationChunk(request_id="r-1", token_ids=[3], text="", logprobs=[TokenLogprob(token_id=3, logprob=-1.0)]),
        "m", index=1, request_id="r", texts=texts)
    assert (message.index, message.request_id, message.logprobs[0].bytes) == (1, "r", b"\xa9")
    plain = grpc_service.chunk_to_response(GenerationChunk(request_id="r", token_ids=[1], text="a"), "m")
    assert plain.index == 0 and len(plain.logprobs) == 0


def test_gamma_auto_and_gamma_max():
    request = pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(gamma_auto=True, gamma_max=6))
    generation = grpc_generation_request(request, "g-2", sampling_defaults={})
    assert generation.speculation.gamma == "auto" and generation.speculation.gamma_max == 6
    fixed = pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(gamma_auto=False, gamma=3))
    assert grpc_generation_request(fixed, "g-3", sampling_defaults={}).speculation.gamma == 3
    both = pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(gamma_auto=True, gamma=3))
    with pytest.raises(InvalidRequestError) as raised:
        grpc_generation_request(both, "g-4", sampling_defaults={})
    assert raised.value.field == "speculation.gamma_auto"
