"""The official ``openai`` Python client against the session's Serve application."""

from __future__ import annotations

import openai
import pytest

PROMPT = "class Counter(dict):\n"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected_ids(greedy_reference) -> list[int]:
    return greedy_reference.continuation(greedy_reference.encode(PROMPT), MAX_TOKENS)


GREEDY = {"ignore_eos": True, "return_token_ids": True}


def test_models_list(client, serve_app):
    assert [model.id for model in client.models.list()] == [serve_app.model]


def test_completion_with_speculation_extension(client, serve_app, expected_ids):
    completion = client.completions.create(
        model=serve_app.model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={**GREEDY, "speculation": {"strategy": "sd", "method": "token", "gamma": 2}},
    )
    choice = completion.choices[0]
    assert choice.model_extra["token_ids"] == expected_ids
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == MAX_TOKENS
    speculation = completion.model_extra["speculation"]
    assert (speculation["strategy"], speculation["method"]) == ("sd", "token")
    assert all(0 <= n <= 2 for n in speculation["accepted_lengths"])


def test_streaming_completion(client, serve_app, expected_ids):
    stream = client.completions.create(
        model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=GREEDY
    )
    chunks = list(stream)
    assert [t for chunk in chunks for t in chunk.choices[0].model_extra["token_ids"]] == expected_ids
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_streaming_and_not(client, serve_app):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(
        model=serve_app.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, seed=3, extra_body=GREEDY
    )
    stream = client.chat.completions.create(
        model=serve_app.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert whole.choices[0].message.role == "assistant"
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_sampled_requests_are_reproducible_with_a_seed(client, serve_app):
    def sample():
        return client.completions.create(
            model=serve_app.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234,
            extra_body={**GREEDY, "top_k": 50},
        ).choices[0].model_extra["token_ids"]

    assert sample() == sample()


def test_errors_raise_openai_exceptions_naming_the_param(client, serve_app):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=4, top_p=1.5)
    assert caught.value.body["param"] == "top_p"
    assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=serve_app.model, prompt=PROMPT, max_tokens=4, extra_body={"speculation": {"strategy": "greedy"}}
        )
    assert caught.value.body["param"] == "speculation.strategy"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt=PROMPT, max_tokens=4)
