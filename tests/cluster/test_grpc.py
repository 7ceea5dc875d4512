"""gRPC through Ray Serve's gRPC proxy: a real grpcio client with the committed stubs against
the session's Serve application (same replica, coordinator and workers as the HTTP tests)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from protos import specserve_pb2, specserve_pb2_grpc

PROMPT = "import sys\n"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def channel(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return specserve_pb2_grpc.SpecServeStub(channel)


@pytest.fixture(scope="module")
def metadata(serve_app):
    # Routes to the application by name; needed as soon as a second application is deployed.
    return (("application", serve_app.model),)


@pytest.fixture(scope="module")
def expected_ids(greedy_reference) -> list[int]:
    return greedy_reference.continuation(greedy_reference.encode(PROMPT), MAX_TOKENS)


def greedy_request(**speculation) -> specserve_pb2.GenerateRequest:
    return specserve_pb2.GenerateRequest(
        prompt=PROMPT,
        sampling=specserve_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        speculation=specserve_pb2.SpeculationOptions(**speculation),
    )


def test_unary_generate_equals_target_greedy(stub, metadata, serve_app, expected_ids, greedy_reference):
    response = stub.Generate(greedy_request(), metadata=metadata, timeout=120)
    assert list(response.token_ids) == expected_ids
    assert response.finished and response.finish_reason == "length"
    assert response.model == serve_app.model and response.request_id.startswith("grpc-")
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.prompt_tokens == len(greedy_reference.encode(PROMPT))
    assert response.usage.total_tokens == response.usage.prompt_tokens + MAX_TOKENS
    assert (response.speculation.strategy, response.speculation.method) == ("sd", "block")
    assert response.speculation.block_efficiency == pytest.approx(MAX_TOKENS / response.speculation.target_calls)
    assert len(response.speculation.accepted_lengths) >= 1


def test_gamma_auto_equals_target_greedy(stub, metadata, expected_ids):
    response = stub.Generate(greedy_request(gamma_auto=True, gamma_max=5), metadata=metadata, timeout=120)
    assert list(response.token_ids) == expected_ids
    blocks = [d for d in response.speculation.draft_lengths if d]  # 0: a plain step (engine.goodput_gamma)
    assert len(blocks) == len(response.speculation.accepted_lengths) and all(1 <= d <= 5 for d in blocks)


def test_client_request_id_is_kept(stub, metadata):
    request = greedy_request()
    request.request_id = "my-request-1"
    assert stub.Generate(request, metadata=metadata, timeout=120).request_id == "my-request-1"


def test_server_streaming_matches_unary(stub, metadata, expected_ids):
    messages = list(stub.GenerateStream(greedy_request(strategy="multi_draft", method="spectr_gbv", num_drafts=2), metadata=metadata, timeout=120))
    assert messages and messages[-1].finished
    assert all(not message.finished for message in messages[:-1])
    assert [token for message in messages for token in message.token_ids] == expected_ids
    final = messages[-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == MAX_TOKENS
    assert (final.speculation.strategy, final.speculation.method) == ("multi_draft", "spectr_gbv")


def test_prompt_ids_and_unset_options_use_deployment_defaults(stub, metadata, greedy_reference):
    prompt_ids = greedy_reference.encode(PROMPT)
    request = specserve_pb2.GenerateRequest(
        prompt_ids=prompt_ids, sampling=specserve_pb2.SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    response = stub.Generate(request, metadata=metadata, timeout=120)
    assert list(response.token_ids) == greedy_reference.continuation(prompt_ids, 4)
    assert response.speculation.strategy == "sd"  # deploy default


def _wrong_type_request() -> bytes:
    """A GenerateRequest whose sampling.max_tokens (field 1, int64) is sent as a string."""
    valid = specserve_pb2.GenerateRequest(prompt="x").SerializeToString()
    bad_sampling = b"\x0a\x05eight"  # field 1, wire type 2 (length-delimited)
    return valid + b"\x2a" + bytes([len(bad_sampling)]) + bad_sampling  # field 5 = sampling


BAD_REQUESTS = [
    ("missing-prompt", specserve_pb2.GenerateRequest(), "prompt"),
    ("empty-prompt", specserve_pb2.GenerateRequest(prompt=""), "prompt"),
    ("prompt-and-ids", specserve_pb2.GenerateRequest(prompt="x", prompt_ids=[1]), "prompt"),
    ("max-tokens-zero", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(max_tokens=0)), "sampling.max_tokens"),
    ("max-tokens-beyond-context", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(max_tokens=5000)), "sampling.max_tokens"),
    ("temperature-negative", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(temperature=-1.0)), "sampling.temperature"),
    ("top-p-zero", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(top_p=0.0)), "sampling.top_p"),
    ("seed-negative", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(seed=-5)), "sampling.seed"),
    ("prompt-too-long", specserve_pb2.GenerateRequest(prompt_ids=[5] * 300), "prompt"),
    ("unknown-strategy", specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(strategy="beam")), "speculation.strategy"),
    ("unknown-method", specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(strategy="multi_draft", method="block")), "speculation.method"),
    ("gamma-too-large", specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(gamma=64)), "speculation.gamma"),
    ("num-drafts-zero", specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(num_drafts=0)), "speculation.num_drafts"),
    ("unknown-proposer", specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(strategy="se", proposer="nobody")), "speculation.proposer"),
    ("gammas-with-a-model-proposer", specserve_pb2.GenerateRequest(prompt="x", speculation=specserve_pb2.SpeculationOptions(strategy="se", proposer="draft", gammas=[1, 2])), "speculation.gammas"),
    ("n-zero", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(n=0)), "sampling.n"),
    ("n-beyond-the-deployment", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(n=17)), "sampling.n"),
    ("presence-penalty-nan", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(presence_penalty=float("nan"))), "sampling.presence_penalty"),
    ("logit-bias-inf", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(logit_bias={3: float("inf")})), "sampling.logit_bias"),
    ("top-logprobs-without-logprobs", specserve_pb2.GenerateRequest(prompt="x", sampling=specserve_pb2.SamplingOptions(top_logprobs=2)), "sampling.top_logprobs"),
]


@pytest.mark.parametrize("name, request_message, field", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_bad_input_is_invalid_argument_naming_the_field(stub, metadata, rpc, name, request_message, field):
    with pytest.raises(grpc.RpcError) as caught:
        if rpc == "Generate":
            stub.Generate(request_message, metadata=metadata, timeout=60)
        else:
            list(stub.GenerateStream(request_message, metadata=metadata, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}: "), caught.value.details()


def test_n_samples_unary_and_streamed(stub, metadata, expected_ids):
    request = greedy_request()
    request.sampling.n = 3
    request.sampling.presence_penalty = 0.0  # neutral values of the new options are served
    request.sampling.frequency_penalty = 0.0
    request.sampling.logprobs = False
    response = stub.Generate(request, metadata=metadata, timeout=120)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [list(choice.token_ids) for choice in response.choices] == [expected_ids] * 3  # greedy: alike
    assert list(response.token_ids) == expected_ids and response.finished
    assert response.usage.completion_tokens == 3 * MAX_TOKENS
    assert response.usage.prompt_tokens == response.choices[0].usage.prompt_tokens  # the prompt once
    assert response.speculation.target_calls == sum(c.speculation.target_calls for c in response.choices)
    messages = list(stub.GenerateStream(request, metadata=metadata, timeout=120))
    tokens: dict[int, list[int]] = {}
    for message in messages:
        tokens.setdefault(message.index, []).extend(message.token_ids)
    assert tokens == {0: expected_ids, 1: expected_ids, 2: expected_ids}
    assert sorted(m.index for m in messages if m.finished) == [0, 1, 2]
    assert len({m.request_id for m in messages}) == 1 and messages[0].request_id.startswith("grpc-")


def test_sampled_choices_follow_seed_plus_i(stub, metadata):
    def tokens(n: int, seed: int) -> list[list[int]]:
        request = specserve_pb2.GenerateRequest(
            prompt=PROMPT, sampling=specserve_pb2.SamplingOptions(max_tokens=6, temperature=1.0, seed=seed, n=n,
                                                                  ignore_eos=True))
        return [list(choice.token_ids) for choice in stub.Generate(request, metadata=metadata, timeout=120).choices]

    pair = tokens(2, seed=11)
    assert pair == [tokens(1, seed=11)[0], tokens(1, seed=12)[0]]


def test_logprobs_and_penalties_are_served_or_named(stub, metadata):
    """Engine support is arriving field by field: INVALID_ARGUMENT naming the field, or the answer."""
    cases = [
        ("sampling.logprobs", specserve_pb2.SamplingOptions(logprobs=True, top_logprobs=2)),
        ("sampling.presence_penalty", specserve_pb2.SamplingOptions(presence_penalty=0.5)),
        ("sampling.repetition_penalty", specserve_pb2.SamplingOptions(repetition_penalty=1.3)),
        ("sampling.logit_bias", specserve_pb2.SamplingOptions(logit_bias={5: -100.0})),
    ]
    for field, options in cases:
        options.max_tokens = 3
        options.temperature = 0.0
        options.ignore_eos = True
        try:
            response = stub.Generate(specserve_pb2.GenerateRequest(prompt=PROMPT, sampling=options),
                                     metadata=metadata, timeout=120)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith(f"{field}: not supported"), error.details()
            continue
        assert len(response.token_ids) == 3
        if field == "sampling.logprobs":
            assert len(response.logprobs) == 3 and all(len(entry.top_logprobs) == 2 for entry in response.logprobs)


def test_wrong_wire_type_is_invalid_argument(channel, metadata):
    raw_generate = channel.unary_unary(
        "/specserve.SpecServe/Generate",
        request_serializer=lambda payload: payload,
        response_deserializer=specserve_pb2.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as caught:
        raw_generate(_wrong_type_request(), metadata=metadata, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.max_tokens: wrong type")


def test_unknown_model_is_not_found(stub, metadata):
    request = greedy_request()
    request.model = "gpt-4"
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, metadata=metadata, timeout=60)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_concurrent_grpc_and_http_requests_all_complete(stub, metadata, serve_app, expected_ids):
    def one(index: int) -> list[int]:
        if index % 3 == 0:
            return [t for m in stub.GenerateStream(greedy_request(), metadata=metadata, timeout=180) for t in m.token_ids]
        if index % 3 == 1:
            return list(stub.Generate(greedy_request(), metadata=metadata, timeout=180).token_ids)
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{serve_app.http_url}/v1/completions", json=body, timeout=180)
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(max_workers=9) as pool:
        results = list(pool.map(one, range(9)))
    assert results == [expected_ids] * 9


def test_cancelled_stream_does_not_disturb_the_server(stub, metadata, serve_app, expected_ids):
    """A client that cancels a GenerateStream mid-way: the server keeps serving, and the
    request's sessions are released (Ray Serve 2.60's gRPC proxy does not forward the cancel
    to the replica, so they are released when the request ends; see docs/serving.md)."""
    long_request = specserve_pb2.GenerateRequest(
        prompt="x",
        sampling=specserve_pb2.SamplingOptions(max_tokens=120, temperature=0.0, ignore_eos=True),
        speculation=specserve_pb2.SpeculationOptions(strategy="ar"),
    )
    call = stub.GenerateStream(long_request, metadata=metadata, timeout=120)
    first = next(call)
    assert not first.finished
    call.cancel()
    assert list(stub.Generate(greedy_request(), metadata=metadata, timeout=120).token_ids) == expected_ids
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=serve_app.http_url, timeout=30) as http:
        while True:
            status = http.get("/v1/status").json()
            if not status["active_requests"] and not any(status["sessions"].values()):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.1)


def test_serve_health_service_answers(channel):
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    health = serve_pb2_grpc.RayServeAPIServiceStub(channel).Healthz(serve_pb2.HealthzRequest(), timeout=30)
    assert health.message == "success"


def test_prompt_logprobs_unary_and_streamed(stub, metadata, greedy_reference):
    """sampling.prompt_logprobs: each prompt token after the first under the target's raw law
    (a transformers forward), with rank and alternatives; max_tokens 0 scores the prompt alone."""
    torch = greedy_reference._torch
    ids = greedy_reference.encode(PROMPT)
    with torch.inference_mode():
        rows = torch.log_softmax(greedy_reference.model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]
    options = specserve_pb2.SamplingOptions(max_tokens=0, prompt_logprobs=2)
    request = specserve_pb2.GenerateRequest(prompt_ids=ids, sampling=options)
    response = stub.Generate(request, metadata=metadata, timeout=120)
    assert list(response.token_ids) == [] and response.finish_reason == "length"
    entries = response.choices[0].prompt_logprobs
    assert [entry.token_id for entry in entries] == ids[1:]
    for j, entry in enumerate(entries):
        assert abs(entry.logprob - rows[j, ids[j + 1]].item()) < 1e-4
        assert entry.rank == int((rows[j] > rows[j, ids[j + 1]]).sum()) + 1 and len(entry.top_logprobs) == 2
    assert list(response.prompt_logprobs) == list(entries)
    options = specserve_pb2.SamplingOptions(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    stream = list(stub.GenerateStream(specserve_pb2.GenerateRequest(prompt_ids=ids, sampling=options),
                                      metadata=metadata, timeout=120))
    assert [e.logprob for e in stream[0].prompt_logprobs] == [e.logprob for e in entries]
    assert all(not message.prompt_logprobs for message in stream[1:])
