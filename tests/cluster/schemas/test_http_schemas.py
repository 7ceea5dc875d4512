"""The OpenAI request schemas and response builders (cluster/schemas/, cluster/responses/) (no server)."""

from __future__ import annotations

import json

import pytest

from actors.request_schema import GenerationChunk, InvalidRequestError, RequestStats
from cluster.schemas.chat_prompt import render_chat_prompt
from cluster.responses import (
    CompletionAccumulator,
    completion_response,
    invalid_request_body,
    sse_event,
    stream_chunk,
)
from cluster.schemas import ChatCompletionRequest, CompletionRequest, http_field, parse_body
from tests.cluster.single_request import http_generation_request


def parse(model, body: dict):
    return parse_body(model, json.dumps(body).encode())


def test_request_becomes_a_generation_request_with_defaults_for_unset_fields():
    body = parse(CompletionRequest, {"prompt": "hi", "temperature": 0, "stop": "\n", "speculation": {"gamma": 3}})
    request = http_generation_request(body, "cmpl-1", sampling_defaults={"max_tokens": 16, "temperature": 0.7})
    assert request.request_id == "cmpl-1" and request.prompt == "hi"
    assert request.sampling.max_tokens == 16  # deployment default
    assert request.sampling.temperature == 0.0  # explicit 0 wins over the default
    assert request.sampling.stop == ["\n"]
    assert request.speculation.gamma == 3 and request.speculation.strategy is None


def test_token_id_prompts_are_accepted():
    request = http_generation_request(parse(CompletionRequest, {"prompt": [1, 2, 3]}), "r", {})
    assert request.prompt_ids == [1, 2, 3] and request.prompt is None


def test_chat_template_is_role_colon_content_lines_then_assistant():
    body = parse(ChatCompletionRequest, {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert render_chat_prompt(body.messages) == "system: S\nuser: U\nassistant:"
    assert http_generation_request(body, "r", {}).prompt == "system: S\nuser: U\nassistant:"


def test_max_completion_tokens_is_an_alias_that_must_not_conflict():
    body = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5})
    assert http_generation_request(body, "r", {}).sampling.max_tokens == 5
    with pytest.raises(InvalidRequestError) as caught:
        parse(
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5},
        )
    assert caught.value.field == "max_completion_tokens"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "top_k": -1}, "top_k"),
        ({"prompt": "x", "stop": ["a", 3]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "speculation": {"weights": "half"}}, "speculation.weights"),
    ],
)
def test_invalid_fields_are_named(body, field):
    with pytest.raises(InvalidRequestError) as caught:  # parsing, or checking the values
        http_generation_request(parse(CompletionRequest, body), "r", {})
    assert caught.value.field == field


def test_error_body_is_openai_shaped_and_names_the_field():
    body = invalid_request_body(InvalidRequestError("speculation.gamma", "must be in [1, 32], got 40"))
    assert body == {
        "error": {
            "message": "speculation.gamma: must be in [1, 32], got 40",
            "type": "invalid_request_error",
            "param": "speculation.gamma",
            "code": "invalid_value",
        }
    }
    assert invalid_request_body(InvalidRequestError("body", "invalid JSON"))["error"]["param"] is None


def test_coordinator_field_names_are_translated_to_http_names():
    assert http_field(InvalidRequestError("prompt_ids", "bad")).field == "prompt"
    assert http_field(InvalidRequestError("sampling.top_p", "bad")).field == "top_p"
    assert http_field(InvalidRequestError("speculation.gamma", "bad")).field == "speculation.gamma"


def _stats() -> RequestStats:
    return RequestStats(strategy="sd", method="block", prompt_tokens=3, completion_tokens=2, target_calls=1,
                        accepted_lengths=[1], block_efficiency=2.0)


def test_completion_response_has_usage_and_speculation_blocks():
    result = CompletionAccumulator()
    result.add(GenerationChunk(request_id="r", token_ids=[7], text="a"))
    result.add(GenerationChunk(request_id="r", token_ids=[8], text="b", finished=True, finish_reason="length", stats=_stats()))
    body = completion_response("cmpl-r", "specserve", 1, result, chat=False, token_ids=True)
    assert body["choices"] == [{"index": 0, "text": "ab", "finish_reason": "length", "logprobs": None, "token_ids": [7, 8]}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert body["speculation"]["block_efficiency"] == 2.0 and body["speculation"]["accepted_lengths"] == [1]
    assert "prompt_tokens" not in body["speculation"]
    chat = completion_response("chatcmpl-r", "specserve", 1, result, chat=True)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ab"}


def test_stream_chunks_and_sse_framing():
    first = stream_chunk("c", "m", 1, GenerationChunk(request_id="r", text="a"), chat=True, first=True)
    assert first["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
    assert first["choices"][0]["finish_reason"] is None and "usage" not in first
    last = stream_chunk(
        "c", "m", 1, GenerationChunk(request_id="r", text="b", finished=True, finish_reason="stop", stats=_stats()),
        chat=False, first=False,
    )
    assert last["choices"][0]["finish_reason"] == "stop" and last["usage"]["total_tokens"] == 5
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
