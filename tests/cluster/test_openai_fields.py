"""The OpenAI API as clients really use it: prompt lists, ``n``, ``echo``, penalties,
``logit_bias``, ``logprobs``, and the fields answered 400.

The first part needs no server: request parsing and mapping (cluster/schemas.py,
cluster/schemas/to_generation.py, cluster/responses/) and the log-probability rendering, with
GenerationChunk objects built by hand. The second drives the
session's Serve application with the official ``openai`` client and with LangChain's OpenAI
classes (``langchain-openai``), which send prompt lists, zero penalties and ``n`` by default.
"""

from __future__ import annotations

import json
import math

import langchain_openai
import openai
import pytest

from actors.request_schema import GenerationChunk, InvalidRequestError, RequestStats, TokenLogprob
from cluster.schemas.to_generation import to_generation_requests
from cluster.responses import (
    LOGPROB_FLOOR,
    ChoiceStream,
    CompletionAccumulator,
    LogprobsRenderer,
    TokenTexts,
    completion_response,
    merged_speculation,
    usage_chunk,
)
from cluster.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, http_field, parse_body

MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def parse(model, body: dict):
    return parse_body(model, json.dumps(body).encode())


def field_of(model, body: dict) -> str:
    """The field named by the error of ``body``: parsing, or checking its values."""
    with pytest.raises(InvalidRequestError) as caught:
        to_generation_requests(parse(model, body), "r", {})
    return caught.value.field


# ------------------------------------------------------------------ parsing and mapping


#: What LangChain's OpenAI (completions) class sends by default, and its chat class.
LANGCHAIN_COMPLETIONS_DEFAULTS = {
    "temperature": 0.7, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0, "n": 1, "seed": None,
    "logprobs": None, "max_tokens": 4,
}
HARMLESS_DEFAULTS = {"best_of": 1, "suffix": None, "logprobs": False, "logit_bias": {}, "user": "u-1", "echo": False,
                     "stream": None, "stream_options": None, "n": None}


@pytest.mark.parametrize("extra", [LANGCHAIN_COMPLETIONS_DEFAULTS, HARMLESS_DEFAULTS], ids=["langchain", "neutral"])
def test_harmless_defaults_are_accepted(extra):
    body = parse(CompletionRequest, {"prompt": ["a", "b"], **extra})
    specs, requests = to_generation_requests(body, "cmpl-1", {})
    assert [spec.index for spec in specs] == [0, 1]
    sampling = requests[0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias, sampling.logprobs) == (0, 0, {}, None)


def test_chat_harmless_defaults_are_accepted():
    body = parse(ChatCompletionRequest, {
        "messages": MESSAGES, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
        "tools": None, "tool_choice": "none", "functions": [], "parallel_tool_calls": False,
        "response_format": {"type": "text"}, "max_completion_tokens": 3, "user": "someone",
    })
    assert to_generation_requests(body, "c", {})[1][0].sampling.max_tokens == 3


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": MAX_CHOICES + 1}, "n"),
        ({"prompt": ["a"] * 9, "n": 8}, "n"),
        ({"prompt": "x", "n": 2, "seed": 2**63 - 1}, "seed"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ],
)
def test_unsupported_or_invalid_completion_fields_are_named(body, field):
    assert field_of(CompletionRequest, body) == field


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "nope"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "maybe"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "stream": True},
         "stream"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"echo": True}, "echo"),
        ({"suffix": None}, "suffix"),
    ],
)
def test_unsupported_chat_fields_are_named(extra, field):
    assert field_of(ChatCompletionRequest, {"messages": MESSAGES, **extra}) == field


def test_non_finite_numbers_are_named():
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        body = parse_body(CompletionRequest, b'{"prompt": "x", "%s": NaN}' % name.encode())
        with pytest.raises(InvalidRequestError) as caught:  # values: with every other field
            to_generation_requests(body, "c", {})
        assert caught.value.field == name
    body = parse_body(CompletionRequest, b'{"prompt": "x", "logit_bias": {"3": 1e400}}')
    with pytest.raises(InvalidRequestError) as caught:  # values: with every other field
        to_generation_requests(body, "c", {})
    assert caught.value.field == "logit_bias"


def test_prompt_lists_and_n_give_choices_in_openai_order_with_seed_plus_i():
    body = parse(CompletionRequest, {"prompt": ["a", "b", "c"], "n": 2, "seed": 10, "temperature": 0.5})
    specs, requests = to_generation_requests(body, "cmpl-9", {})
    assert [(s.index, s.prompt_index, s.sample_index) for s in specs] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 2, 0), (5, 2, 1)]
    assert [r.prompt for r in requests] == ["a", "a", "b", "b", "c", "c"]
    assert [r.sampling.seed for r in requests] == [10, 11, 10, 11, 10, 11]
    assert [r.request_id for r in requests] == [f"cmpl-9-{i}" for i in range(6)]
    assert {r.sampling.temperature for r in requests} == {0.5}
    token_lists = to_generation_requests(parse(CompletionRequest, {"prompt": [[1, 2], [3]]}), "r", {})[1]
    assert [r.prompt_ids for r in token_lists] == [[1, 2], [3]]
    one = to_generation_requests(parse(CompletionRequest, {"prompt": [5, 6]}), "r", {})[1]
    assert [r.request_id for r in one] == ["r"] and one[0].prompt_ids == [5, 6]
    unseeded = to_generation_requests(parse(CompletionRequest, {"prompt": "x", "n": 3}), "r", {})[1]
    assert [r.sampling.seed for r in unseeded] == [None] * 3


def test_penalties_logit_bias_and_logprobs_reach_the_sampling_params():
    body = parse(CompletionRequest, {"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,
                                     "repetition_penalty": 1.2, "logit_bias": {"7": -100, "12": 2.5}, "logprobs": 3})
    sampling = to_generation_requests(body, "r", {})[1][0].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sampling.logit_bias == {7: -100.0, 12: 2.5} and sampling.logprobs == 3
    chat = lambda extra: to_generation_requests(parse(ChatCompletionRequest, {"messages": MESSAGES, **extra}), "r", {})[1][0]  # noqa: E731
    assert chat({"logprobs": True, "top_logprobs": 4}).sampling.logprobs == 4
    assert chat({"logprobs": True}).sampling.logprobs == 0
    assert chat({"logprobs": False, "top_logprobs": 0}).sampling.logprobs is None


def test_coordinator_errors_on_the_new_fields_keep_their_http_names():
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs"):
        assert http_field(InvalidRequestError(name, "not supported by this server yet")).field == name
        assert http_field(InvalidRequestError(f"sampling.{name}", "bad")).field == name


def test_chat_content_parts_and_developer_role():
    body = parse(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "import "}, {"type": "text", "text": "os"}]},
    ]})
    assert to_generation_requests(body, "r", {})[1][0].prompt == "system: Be brief.\nuser: import os\nassistant:"
    assert field_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) \
        == "messages.0.content"


# ------------------------------------------------------------------ log-probability rendering

#: A toy vocabulary: ids -> raw bytes; 3 and 4 are the two halves of "é" (0xC3 0xA9).
VOCAB = {1: b"Hello", 2: b" world", 3: b"\xc3", 4: b"\xa9", 5: b"!", 6: b" there"}
TEXTS = TokenTexts(lambda token_id: VOCAB[token_id])


def entries() -> list[TokenLogprob]:
    return [
        TokenLogprob(token_id=1, logprob=-0.5, top=[(1, -0.5), (6, -1.5)]),
        TokenLogprob(token_id=3, logprob=-1.25, top=[(2, -0.25), (5, -2.0)]),  # chosen token not among the top
        TokenLogprob(token_id=4, logprob=0.0, top=[(4, 0.0), (5, -math.inf)]),
        TokenLogprob(token_id=5, logprob=-math.inf, top=[]),
    ]


def test_token_texts_show_partial_characters_as_bytes():
    assert TEXTS.text_of(2) == " world" and TEXTS.bytes_of(2) == b" world"
    assert TEXTS.text_of(3) == "bytes:\\xc3"
    assert TEXTS.text_of(4) == "bytes:\\xa9"


def test_completions_logprobs_have_openais_shape():
    rendered = LogprobsRenderer(TEXTS, chat=False).render(entries())
    assert rendered == {
        "tokens": ["Hello", "bytes:\\xc3", "bytes:\\xa9", "!"],
        "token_logprobs": [-0.5, -1.25, 0.0, LOGPROB_FLOOR],
        "top_logprobs": [
            {"Hello": -0.5, " there": -1.5},
            {" world": -0.25, "!": -2.0, "bytes:\\xc3": -1.25},  # the chosen token is always there
            {"bytes:\\xa9": 0.0, "!": LOGPROB_FLOOR},
            {"!": LOGPROB_FLOOR},
        ],
        # "Hello" is 5 characters; both halves of "é" point at it; "!" follows it.
        "text_offset": [0, 5, 5, 6],
    }
    json.dumps(rendered, allow_nan=False)  # JSON-safe: no infinities


def test_chat_logprobs_have_openais_shape():
    rendered = LogprobsRenderer(TEXTS, chat=True).render(entries()[:2])
    assert rendered == {"content": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"), "top_logprobs": [
            {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
            {"token": " there", "logprob": -1.5, "bytes": list(b" there")},
        ]},
        {"token": "bytes:\\xc3", "logprob": -1.25, "bytes": [0xC3], "top_logprobs": [
            {"token": " world", "logprob": -0.25, "bytes": list(b" world")},
            {"token": "!", "logprob": -2.0, "bytes": [0x21]},
        ]},
    ]}


def test_streamed_logprobs_continue_the_text_offsets_across_chunks():
    stream = ChoiceStream("cmpl-1", "m", 1, chat=False, logprobs=TEXTS)
    first = stream.render(GenerationChunk(request_id="r", token_ids=[1, 3], text="Hello", logprobs=entries()[:2]))
    last = stream.render(GenerationChunk(request_id="r", token_ids=[4, 5], text="é!", logprobs=entries()[2:],
                                         finished=True, finish_reason="length", stats=_stats(4)))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 5]
    assert last["choices"][0]["logprobs"]["text_offset"] == [5, 6]
    assert last["choices"][0]["logprobs"]["tokens"] == ["bytes:\\xa9", "!"]
    assert last["usage"]["completion_tokens"] == 4
    chat = ChoiceStream("chatcmpl-1", "m", 1, chat=True, logprobs=TEXTS, index=3, single=False)
    delta = chat.render(GenerationChunk(request_id="r", token_ids=[1], text="Hello", logprobs=entries()[:1]))
    assert delta["choices"][0]["index"] == 3 and delta["choices"][0]["delta"]["role"] == "assistant"
    assert [item["token"] for item in delta["choices"][0]["logprobs"]["content"]] == ["Hello"]
    no_logprobs = ChoiceStream("c", "m", 1, chat=False).render(GenerationChunk(request_id="r", token_ids=[1], text="x"))
    assert no_logprobs["choices"][0]["logprobs"] is None


def test_token_texts_of_the_embedded_byte_level_tokenizer_round_trip():
    from transformers import AutoTokenizer

    from models import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("target"))
    texts = TokenTexts.from_tokenizer(tokenizer)
    text = "def naïve(x):\n    return '你好' + x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(texts.bytes_of(token_id) for token_id in ids) == text.encode()
    assert "".join(texts.text_of(token_id) for token_id in ids[:2]) == tokenizer.decode(ids[:2])
    offsets = LogprobsRenderer(texts, chat=False).render(
        [TokenLogprob(token_id=token_id, logprob=-1.0) for token_id in ids])["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    assert all(text[:offset].encode() == b"".join(texts.bytes_of(t) for t in ids[:i])
               for i, offset in enumerate(offsets) if not texts.text_of(ids[i]).startswith("bytes:"))


def _stats(completion_tokens: int, target_calls: int = 2, prompt_tokens: int = 3) -> RequestStats:
    return RequestStats(strategy="sd", method="block", prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        target_calls=target_calls, model_calls={"target": target_calls, "draft": 4},
                        accepted_lengths=[1, 2], block_efficiency=completion_tokens / target_calls, time_target_s=0.5)


def _result(index: int, text: str, counts_prompt: bool, tokens: int, prefix: str = "") -> CompletionAccumulator:
    result = CompletionAccumulator(index, prefix, counts_prompt)
    result.add(GenerationChunk(request_id=f"r-{index}", token_ids=[1] * tokens, text=text, finished=True,
                               finish_reason="length", stats=_stats(tokens),
                               logprobs=[TokenLogprob(token_id=1, logprob=-0.1)] * tokens))
    return result


def test_several_choices_render_in_index_order_with_summed_usage_and_stats():
    results = [_result(0, "a", True, 4, prefix="P:"), _result(1, "b", False, 2, prefix="P:"), _result(2, "c", True, 6)]
    body = completion_response("cmpl-1", "m", 1, results, chat=False, logprobs=TEXTS, wall_s=2.0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["P:a", "P:b", "c"]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}  # each prompt once
    assert body["choices"][0]["logprobs"]["text_offset"] == [2, 7, 12, 17]  # after the echoed "P:"
    assert body["choices"][1]["speculation"]["target_calls"] == 2
    merged = body["speculation"]
    assert merged["target_calls"] == 6 and merged["model_calls"] == {"target": 6, "draft": 12}
    assert merged["accepted_lengths"] == [1, 2] * 3 and merged["block_efficiency"] == 2.0
    assert merged["tokens_per_second"] == 6.0 and merged["time_target_s"] == 1.5
    assert merged == merged_speculation(results, 2.0)
    chat = completion_response("chatcmpl-1", "m", 1, results[:1], chat=True, logprobs=TEXTS)
    assert chat["choices"][0]["message"]["content"] == "P:a" and len(chat["choices"][0]["logprobs"]["content"]) == 4
    assert "speculation" not in chat["choices"][0] and chat["speculation"]["target_calls"] == 2
    usage = usage_chunk("cmpl-1", "m", 1, results, chat=False, wall_s=2.0)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 18


# ------------------------------------------------------------------ served, with real clients

PROMPT = "class Counter(dict):\n"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy(greedy_reference):
    def continuation(prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        ids = greedy_reference.encode(prompt) if isinstance(prompt, str) else prompt
        return greedy_reference.continuation(ids, max_tokens)

    return continuation


GREEDY = {"ignore_eos": True, "return_token_ids": True}


def test_prompt_list_with_n_returns_prompts_times_n_choices_in_order(client, serve_app, greedy, greedy_reference):
    prompts = [PROMPT, "import os\n"]
    completion = client.completions.create(
        model=serve_app.model, prompt=prompts, n=2, max_tokens=MAX_TOKENS, temperature=0, extra_body=GREEDY,
        frequency_penalty=0, presence_penalty=0, best_of=2, logit_bias={}, user="tester",
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    expected = [greedy(prompts[0])] * 2 + [greedy(prompts[1])] * 2  # index = prompt_index * n + sample_index
    assert [choice.model_extra["token_ids"] for choice in completion.choices] == expected
    assert completion.usage.completion_tokens == 4 * MAX_TOKENS
    assert completion.usage.prompt_tokens == sum(len(greedy_reference.encode(prompt)) for prompt in prompts)
    assert completion.model_extra["speculation"]["target_calls"] == sum(
        choice.model_extra["speculation"]["target_calls"] for choice in completion.choices)


def test_n_samples_are_independent_requests_seeded_seed_plus_i(client, serve_app):
    def sample(n: int, seed: int) -> list[list[int]]:
        completion = client.completions.create(
            model=serve_app.model, prompt=PROMPT, n=n, seed=seed, max_tokens=6, temperature=1.0, extra_body=GREEDY,
        )
        return [choice.model_extra["token_ids"] for choice in completion.choices]

    pair = sample(2, seed=40)
    assert pair[0] == sample(1, seed=40)[0] and pair[1] == sample(1, seed=41)[0]


def test_echo_token_id_prompts_and_stop_lists(client, serve_app, greedy, greedy_reference):
    echoed = client.completions.create(model=serve_app.model, prompt=PROMPT, echo=True, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body=GREEDY)
    choice = echoed.choices[0]
    assert choice.text.startswith(PROMPT) and choice.model_extra["token_ids"] == greedy(PROMPT)
    ids = greedy_reference.encode(PROMPT)
    from_ids = client.completions.create(model=serve_app.model, prompt=[ids, ids[:3]], echo=True, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body=GREEDY)
    echoes = [greedy_reference.decode(ids), greedy_reference.decode(ids[:3])]
    assert [c.text[: len(echo)] for c, echo in zip(from_ids.choices, echoes)] == echoes
    assert from_ids.choices[1].model_extra["token_ids"] == greedy(ids[:3])
    full = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body=GREEDY).choices[0].text
    stop = full[3:5]
    stopped = client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                        stop=["\u00a7never", stop], extra_body=GREEDY).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and full.startswith(stopped.text)


def test_echo_of_undecodable_token_ids_is_400_naming_the_prompt(client, serve_app):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=serve_app.model, prompt=[[1, 2], [2**40]], echo=True, max_tokens=2)
    assert caught.value.body["param"] == "prompt"


def test_streamed_choices_are_interleaved_by_index_with_a_usage_chunk(client, serve_app, greedy):
    prompts = [PROMPT, "import os\n"]
    stream = client.completions.create(
        model=serve_app.model, prompt=prompts, n=2, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY,
    )
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 4 * MAX_TOKENS
    by_index: dict[int, list[int]] = {}
    finished = []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index.setdefault(choice.index, []).extend(choice.model_extra["token_ids"])
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3]
    assert by_index == {0: greedy(prompts[0]), 1: greedy(prompts[0]), 2: greedy(prompts[1]), 3: greedy(prompts[1])}


def test_chat_with_n_max_completion_tokens_and_streamed_usage(client, serve_app):
    whole = client.chat.completions.create(
        model=serve_app.model, messages=MESSAGES, n=2, max_completion_tokens=MAX_TOKENS, temperature=0,
        presence_penalty=0, frequency_penalty=0, logprobs=False, user="tester", extra_body=GREEDY,
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy: the same sample
    assert whole.usage.completion_tokens == 2 * MAX_TOKENS
    stream = list(client.chat.completions.create(
        model=serve_app.model, messages=MESSAGES, n=2, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=GREEDY,
    ))
    content: dict[int, str] = {}
    for chunk in stream[:-1]:
        (choice,) = chunk.choices
        content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
    assert content == {0: whole.choices[0].message.content, 1: whole.choices[1].message.content}
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 2 * MAX_TOKENS


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"max_tokens": 0, "echo": True}, "max_tokens"),  # 0 needs logprobs (the prompt is scored)
    ],
)
def test_unsupported_completion_fields_are_400_naming_them(client, serve_app, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=serve_app.model, prompt=PROMPT, **{"max_tokens": 2, **kwargs})
    assert caught.value.body["param"] == param


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                           "format": "nope"}}}},
         "response_format.json_schema.schema"),
    ],
)
def test_unsupported_chat_fields_are_400_naming_them(client, serve_app, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=2, **kwargs)
    assert caught.value.body["param"] == param


def _not_yet_or(check, call, param):
    """Engine support is arriving field by field: either the coordinator's 400 naming the field,
    or an answer that ``check`` accepts."""
    try:
        response = call()
    except openai.BadRequestError as error:
        assert error.body["param"] == param and "not supported" in error.body["message"], error.body
        return
    check(response)


def test_penalties_logit_bias_and_logprobs_are_served_or_named(client, serve_app):
    def completion(**kwargs):
        return lambda: client.completions.create(model=serve_app.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                                 extra_body=GREEDY, **kwargs)

    def completion_logprobs(response):
        logprobs = response.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 3
        assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)

    def chat_logprobs(response):
        content = response.choices[0].logprobs.content
        assert len(content) == 3 and all(len(item.top_logprobs) == 2 for item in content)

    def generated(response):
        assert len(response.choices[0].model_extra["token_ids"]) == 3

    _not_yet_or(completion_logprobs, completion(logprobs=2), "logprobs")
    _not_yet_or(generated, completion(presence_penalty=0.5), "presence_penalty")
    _not_yet_or(generated, completion(frequency_penalty=0.5), "frequency_penalty")
    _not_yet_or(generated, completion(logit_bias={"5": -100}), "logit_bias")
    _not_yet_or(chat_logprobs, lambda: client.chat.completions.create(
        model=serve_app.model, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
        extra_body=GREEDY), "logprobs")


# ------------------------------------------------------------------ LangChain (langchain-openai)



def test_langchain_completions_class_sends_prompt_lists_and_zero_penalties(serve_app, greedy):
    llm = langchain_openai.OpenAI(
        model=serve_app.model, base_url=f"{serve_app.http_url}/v1", api_key="unused", max_tokens=MAX_TOKENS,
        temperature=0, n=2, max_retries=0, model_kwargs={"extra_body": GREEDY},
    )
    prompts = [PROMPT, "import os\n"]
    result = llm.generate(prompts)  # one request: prompt = [...], n = 2, frequency/presence_penalty = 0, logprobs = null
    assert [len(generations) for generations in result.generations] == [2, 2]
    assert result.llm_output["token_usage"]["completion_tokens"] == 4 * MAX_TOKENS
    texts = [[g.text for g in generations] for generations in result.generations]
    assert texts[0][0] == texts[0][1] and texts[1][0] == texts[1][1]  # greedy: both samples alike
    single = langchain_openai.OpenAI(
        model=serve_app.model, base_url=f"{serve_app.http_url}/v1", api_key="unused", max_tokens=MAX_TOKENS,
        temperature=0, max_retries=0, model_kwargs={"extra_body": GREEDY},
    )
    assert single.invoke(PROMPT) == texts[0][0]
    assert "".join(single.stream(PROMPT)) == texts[0][0]


def test_langchain_chat_class_invokes_and_streams(serve_app):
    chat = langchain_openai.ChatOpenAI(
        model=serve_app.model, base_url=f"{serve_app.http_url}/v1", api_key="unused", max_tokens=MAX_TOKENS,
        temperature=0, max_retries=0, stream_usage=True,
    )
    from langchain_core.messages import HumanMessage, SystemMessage

    messages = [SystemMessage("Be brief."), HumanMessage("def add(a, b):")]
    answer = chat.invoke(messages)
    assert isinstance(answer.content, str) and answer.usage_metadata["output_tokens"] <= MAX_TOKENS
    pieces = list(chat.stream(messages))
    assert "".join(piece.content for piece in pieces) == answer.content
    assert sum((piece.usage_metadata or {}).get("output_tokens", 0) for piece in pieces) == \
        answer.usage_metadata["output_tokens"]


# ------------------------------------------------------------------ prompt log-probabilities


def _reference_log_rows(greedy_reference, prompt_ids: list[int]):
    """log_softmax of the tiny target's logits at every prompt position: ``[P, V]``."""
    torch = greedy_reference._torch
    with torch.inference_mode():
        logits = greedy_reference.model(torch.tensor([prompt_ids])).logits[0].float()  # [P, V]
    return torch.log_softmax(logits, dim=-1)


def test_echo_with_logprobs_returns_the_prompt_tokens_log_probabilities(client, serve_app, greedy_reference):
    ids = greedy_reference.encode(PROMPT)
    rows = _reference_log_rows(greedy_reference, ids)  # [P, V]
    body = client.completions.create(model=serve_app.model, prompt=ids, echo=True, logprobs=2, max_tokens=1,
                                     temperature=0).model_dump()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["text_offset"][0] == 0
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [rows[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"][1:len(ids)], expected)) < 1e-4
    # The generated token follows the prompt, under the law it was drawn from (greedy: a point mass).
    assert logprobs["token_logprobs"][-1] == 0.0
    assert body["choices"][0]["text"].startswith(greedy_reference.decode(ids))
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])


def test_max_tokens_zero_scores_the_prompt_alone_streamed_or_not(client, serve_app, greedy_reference):
    ids = greedy_reference.encode(PROMPT)
    whole = client.completions.create(model=serve_app.model, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = whole.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and whole.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids)
    chunks = list(client.completions.create(model=serve_app.model, prompt=PROMPT, echo=True, logprobs=0,
                                            max_tokens=0, stream=True))
    assert chunks[0].choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT


def test_prompt_logprobs_extension_in_vllm_shape_for_an_ensemble(client, serve_app, greedy_reference, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    torch = greedy_reference._torch
    ids = greedy_reference.encode(PROMPT)
    body = client.completions.create(
        model=serve_app.model, prompt=PROMPT, max_tokens=2, temperature=0.5,
        extra_body={"prompt_logprobs": 1, "speculation": {"strategy": "ensemble", "ensemble": "weighted",
                                                          "members": ["target", "partner"], "weights": [0.25, 0.75]}},
    ).model_dump()
    block = body["choices"][0]["prompt_logprobs"]
    assert block[0] is None and len(block) == len(ids)
    partner = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["partner"], dtype=torch.float32).eval()
    with torch.inference_mode():
        partner_probs = torch.softmax(partner(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]
    # The ensemble's law at temperature 1 (the request's temperature 0.5 does not apply to the prompt).
    rows = torch.log(0.25 * _reference_log_rows(greedy_reference, ids).exp() + 0.75 * partner_probs)  # [P, V]
    for j, entry in enumerate(block[1:]):
        token = entry[str(ids[j + 1])]
        assert abs(token["logprob"] - rows[j, ids[j + 1]].item()) < 1e-4
        assert token["rank"] == int((rows[j] > rows[j, ids[j + 1]]).sum()) + 1
        assert any(item["rank"] == 1 for item in entry.values())
    assert body["choices"][0]["logprobs"] is None  # no generated-token log-probabilities were asked for


def test_chat_prompt_logprobs_extension_once_per_response(client, serve_app, greedy_reference):
    """vLLM's chat ``prompt_logprobs``: the templated prompt's tokens under the target, once
    beside the choices (not per choice); refused with stream, as vLLM does."""
    messages = [{"role": "user", "content": PROMPT}]
    ids = list(greedy_reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    rows = _reference_log_rows(greedy_reference, ids)  # [P, V]
    body = client.chat.completions.create(model=serve_app.model, messages=messages, max_tokens=1, n=2,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    block = body["prompt_logprobs"]
    assert block[0] is None and len(block) == len(ids)
    for j, entry in enumerate(block[1:]):
        assert abs(entry[str(ids[j + 1])]["logprob"] - rows[j, ids[j + 1]].item()) < 1e-4
    assert all("prompt_logprobs" not in choice and choice["logprobs"] is None for choice in body["choices"])
    scored = client.chat.completions.create(model=serve_app.model, messages=messages, max_tokens=0,
                                            extra_body={"prompt_logprobs": 0}).model_dump()
    assert scored["prompt_logprobs"] == block and scored["usage"]["completion_tokens"] == 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=serve_app.model, messages=messages, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 0})
    assert refused.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("bias", [100.5, float("nan")])
def test_logit_bias_values_are_checked_once_where_every_field_is(bias):
    """Keys are parsed with the body; values and counts are checked with every other field
    (actors.request_schema.SamplingParams), and the error names the HTTP field."""
    body = parse_body(CompletionRequest, json.dumps({"prompt": "x", "logit_bias": {"5": bias}}).encode())
    with pytest.raises(InvalidRequestError) as caught:
        to_generation_requests(body, "c", {})
    assert caught.value.field == "logit_bias"
