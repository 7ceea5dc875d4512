"""The requests real clients send: guidellm's and ``vllm bench serve``'s bodies, the OpenAI
client with vLLM's sampling extensions and OpenAI's extra fields, predicted outputs and prompt
lookup, and the 400s of their bad values.

guidellm pins an older click than this project's (``pip install --dry-run guidellm`` would
downgrade it), so it is not a test dependency: its exact request bodies (read from its
``backends/openai/request_handlers.py``, 0.8.1: ``stream_options`` with
``continuous_usage_stats``, ``stop: null``, ``ignore_eos``, ``max_completion_tokens`` on chat)
are sent here with a real HTTP client (httpx), at 1 and 8 concurrent streams; docs/serving.md
shows the manual guidellm run. ``vllm bench serve``'s bodies are those of its
``benchmarks/lib/endpoint_request_func.py``.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from actors.request_schema import InvalidRequestError
from cluster.schemas.to_generation import to_generation_requests
from cluster.schemas import ChatCompletionRequest, CompletionRequest, parse_body

PROMPT = "class Counter(dict):\n"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
MAX_TOKENS = 6


def _field_of(model, body: dict) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        to_generation_requests(parse_body(model, json.dumps(body).encode()), "r", {})
    return caught.value.field


# ------------------------------------------------------------------ parsing, no server


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"prediction": {"type": "image", "content": "x"}}, "prediction.type"),
        ({"prediction": {"type": "content", "content": 123}}, "prediction.content"),
        ({"prediction": {"type": "content"}}, "prediction.content"),
        ({"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction.extra"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"stream_options": {"include_usage": True, "continuous": True}}, "stream_options.continuous"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"not_a_field": 1}, "not_a_field"),
    ],
)
def test_bad_values_of_the_new_fields_are_named(extra, field):
    """(speculation values are resolved against the deployment: served, below)"""
    assert _field_of(CompletionRequest, {"prompt": "x", **extra}) == field
    assert _field_of(ChatCompletionRequest, {"messages": MESSAGES, **extra}) == field


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"continue_final_message": True}, "continue_final_message"),  # needs add_generation_prompt false
        ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # user last
    ],
)
def test_continue_final_message_needs_an_open_assistant_turn(extra, field):
    assert _field_of(ChatCompletionRequest, {"messages": MESSAGES, **extra}) == field


def test_the_extensions_reach_the_sampling_params_and_openai_extras_are_ignored():
    body = parse_body(ChatCompletionRequest, json.dumps({
        "messages": MESSAGES, "max_tokens": 8, "min_p": 0.05, "min_tokens": 2, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "include_stop_str_in_output": True, "truncate_prompt_tokens": 12,
        "store": False, "metadata": {"team": "a"}, "service_tier": "auto", "reasoning_effort": "low",
        "modalities": ["text"], "user": "u", "prediction": {"type": "content", "content": [{"type": "text", "text": "ab"}]},
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }).encode())
    (request,) = to_generation_requests(body, "c", {})[1]
    sampling = request.sampling
    assert (sampling.min_p, sampling.min_tokens, sampling.skip_special_tokens, sampling.spaces_between_special_tokens,
            sampling.include_stop_str_in_output, sampling.truncate_prompt_tokens) == (0.05, 2, False, False, True, 12)
    assert request.prediction == "ab" and body.continuous_usage


# ------------------------------------------------------------------ served

GUIDELLM_CHAT = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": MAX_TOKENS, "stop": None, "ignore_eos": True}
GUIDELLM_COMPLETIONS = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                        "max_tokens": MAX_TOKENS, "stop": None, "ignore_eos": True}


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _post(http_url: str, path: str, body: dict) -> list[dict]:
    with httpx.Client(timeout=120) as client:
        return _events(client.post(f"{http_url}/v1/{path}", json=body))


@pytest.mark.parametrize("streams", [1, 8])
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_guidellm_bodies_stream_usage_in_every_chunk(serve_app, path, streams):
    """guidellm's bodies at 1 and 8 concurrent streams: every chunk has a usage whose completion
    tokens grow to max_tokens (ignore_eos), the last chunk is the usage chunk."""
    chat = path.startswith("chat")
    body = {"model": serve_app.model, **(GUIDELLM_CHAT if chat else GUIDELLM_COMPLETIONS)}
    body.update({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda _: _post(serve_app.http_url, path, body), range(streams)))
    for events in results:
        usages = [event["usage"] for event in events]
        counts = [usage["completion_tokens"] for usage in usages]
        assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
        assert all(usage["prompt_tokens"] > 0 for usage in usages)
        assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"


def test_vllm_bench_serve_bodies_are_accepted(serve_app):
    completions = _post(serve_app.http_url, "completions", {
        "model": serve_app.model, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": MAX_TOKENS,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    })
    assert completions[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    chat = _post(serve_app.http_url, "chat/completions", {
        "model": serve_app.model, "messages": MESSAGES, "max_completion_tokens": MAX_TOKENS, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    })
    assert chat[-1]["usage"]["completion_tokens"] == MAX_TOKENS


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


EVERY_FIELD = {
    "min_p": 0.05, "min_tokens": 3, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "truncate_prompt_tokens": 5, "ignore_eos": True, "return_token_ids": True,
}


def test_openai_client_with_every_field(client, serve_app, greedy_reference):
    """Chat and completions with every accepted field set; truncate_prompt_tokens keeps the last
    5 prompt tokens (the usage says so, and the greedy output is the one of those 5)."""
    ids = greedy_reference.encode(PROMPT)
    completion = client.completions.create(
        model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, user="u",
        extra_body=EVERY_FIELD,
    )
    assert completion.usage.prompt_tokens == 5
    assert completion.choices[0].model_extra["token_ids"] == greedy_reference.continuation(ids[-5:], MAX_TOKENS)
    chat = client.chat.completions.create(
        model=serve_app.model, messages=[{"role": "user", "content": "def add(a, b):"},
                                         {"role": "assistant", "content": "    return"}],
        max_completion_tokens=MAX_TOKENS, temperature=0.7, seed=3, store=False, metadata={"k": "v"},
        service_tier="auto", modalities=["text"], reasoning_effort="low", user="u",
        prediction={"type": "content", "content": "    return a + b\n"},
        extra_body={**EVERY_FIELD, "truncate_prompt_tokens": None, "add_generation_prompt": False,
                    "continue_final_message": True},
    )
    assert chat.usage.completion_tokens == MAX_TOKENS
    details = chat.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0


def test_a_prediction_serves_the_greedy_output_and_reports_its_tokens(client, serve_app, greedy_reference):
    """At temperature 0 with a prediction of the target's greedy text the output is the greedy
    output, and the usage's prediction counts are the speculation block's. (The tiny random
    model writes partial UTF-8 characters, so its text does not tokenize back to its tokens and
    little of it is accepted; tests/actors/coordination/test_coordinator_reference.py checks the
    counts of token-id predictions against the reference loop, docs/benchmarks.md the speed-up
    on the embedded family.)"""
    ids = greedy_reference.encode(PROMPT)
    greedy = greedy_reference.continuation(ids, 16)
    prediction = greedy_reference.decode(greedy)
    completion = client.completions.create(
        model=serve_app.model, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "prediction": {"type": "content", "content": prediction},
                    "speculation": {"strategy": "sd", "gamma": 7}},
    )
    assert completion.choices[0].model_extra["token_ids"] == greedy
    details = completion.usage.completion_tokens_details
    speculation = completion.model_extra["speculation"]
    assert details.accepted_prediction_tokens == speculation["accepted_proposed"]["prediction"]
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens \
        == speculation["proposed_tokens"]["prediction"] > 0


def test_prompt_lookup_serves_the_greedy_output(client, serve_app, greedy_reference):
    prompt = "import os\nimport sys\nimport os\nimport"
    ids = greedy_reference.encode(prompt)
    completion = client.completions.create(
        model=serve_app.model, prompt=prompt, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "speculation": {"strategy": "sd", "proposer": "ngram", "gamma": 4, "prompt_lookup_min": 1}},
    )
    assert completion.choices[0].model_extra["token_ids"] == greedy_reference.continuation(ids, 10)
    assert completion.model_extra["speculation"]["proposed_tokens"]["ngram"] > 0


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"prediction": {"type": "image", "content": "x"}}, "prediction.type"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"speculation": {"proposer": "ngram", "method": "greedy_block"}}, "speculation.method"),
        ({"speculation": {"proposer": "ngram", "strategy": "multi_draft"}}, "speculation.proposer"),
        ({"speculation": {"prompt_lookup_min": 5, "prompt_lookup_max": 3}}, "speculation.prompt_lookup_min"),
        ({"modalities": ["audio"]}, "modalities"),
    ],
)
def test_bad_values_are_400_naming_the_field(client, serve_app, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert caught.value.body["param"] == param


def test_grpc_takes_the_same_fields(serve_app, greedy_reference):
    import grpc

    from protos import specserve_pb2, specserve_pb2_grpc

    ids = greedy_reference.encode(PROMPT)
    greedy = greedy_reference.continuation(ids, 12)
    metadata = (("application", serve_app.model),)
    with grpc.insecure_channel(serve_app.grpc_target) as channel:
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        response = stub.Generate(specserve_pb2.GenerateRequest(
            prompt=PROMPT, prediction=greedy_reference.decode(greedy),
            sampling=specserve_pb2.SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True, min_p=0.1,
                                                   min_tokens=2, skip_special_tokens=True,
                                                   include_stop_str_in_output=False),
            speculation=specserve_pb2.SpeculationOptions(strategy="sd", gamma=5, prompt_lookup_min=2),
        ), metadata=metadata, timeout=120)
        assert list(response.token_ids) == greedy
        assert response.usage.accepted_prediction_tokens == response.speculation.accepted_proposed["prediction"]
        assert response.usage.accepted_prediction_tokens + response.usage.rejected_prediction_tokens \
            == response.speculation.proposed_tokens["prediction"] > 0
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(specserve_pb2.GenerateRequest(
                prompt=PROMPT, sampling=specserve_pb2.SamplingOptions(max_tokens=4, min_p=2.0)), metadata=metadata,
                timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.min_p" in caught.value.details()
