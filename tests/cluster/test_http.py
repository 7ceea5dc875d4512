"""The OpenAI-compatible HTTP endpoint of the real Serve application, driven with httpx.

Every request goes HTTP proxy -> SpecServeIngress -> Coordinator -> ModelWorkers (tiny
checkpoints). At temperature 0 every lossless strategy must return the target's own greedy
continuation, computed here with transformers directly (``greedy_reference``).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

PROMPT = "def main(argv=None):\n"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def http(serve_app):
    with httpx.Client(base_url=serve_app.http_url, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def expected_ids(greedy_reference) -> list[int]:
    return greedy_reference.continuation(greedy_reference.encode(PROMPT), MAX_TOKENS)


def greedy_body(**overrides) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body.update(overrides)
    return body


def sse_payloads(lines) -> list:
    """The JSON payloads of a server-sent-event stream, and "[DONE]" as a string."""
    payloads = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def assert_text_matches(text: str, token_ids: list[int], reference) -> None:
    decoded = reference.decode(token_ids)
    if "\ufffd" not in decoded:  # a cut multi-byte character is withheld, not replaced
        assert text == decoded


def test_health_models_and_status(http, serve_app):
    assert http.get("/health").json()["status"] == "ok"
    models = http.get("/v1/models").json()
    assert [model["id"] for model in models["data"]] == [serve_app.model]
    status = http.get("/v1/status").json()
    assert set(status["workers"]) == {"target", "draft", "partner", "partner2"}
    assert status["defaults"]["strategy"] == "sd"


def test_completion_equals_target_greedy_with_stats(http, serve_app, expected_ids, greedy_reference):
    response = http.post("/v1/completions", json=greedy_body(model=serve_app.model))
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == serve_app.model
    assert choice["token_ids"] == expected_ids
    assert choice["finish_reason"] == "length"
    assert_text_matches(choice["text"], expected_ids, greedy_reference)
    usage, speculation = body["usage"], body["speculation"]
    assert usage["prompt_tokens"] == len(greedy_reference.encode(PROMPT))
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    assert (speculation["strategy"], speculation["method"]) == ("sd", "block")
    assert speculation["target_calls"] >= 1
    assert speculation["block_efficiency"] == pytest.approx(MAX_TOKENS / speculation["target_calls"])
    assert len(speculation["accepted_lengths"]) >= 1
    assert all(0 <= n <= 4 for n in speculation["accepted_lengths"])


@pytest.mark.parametrize("strategy,method", [("sd", "greedy_block"), ("multi_draft", "spectr")])
def test_gamma_auto_equals_target_greedy_and_reports_its_blocks(http, expected_ids, strategy, method):
    speculation = {"strategy": strategy, "method": method, "gamma": "auto", "gamma_max": 6}
    response = http.post("/v1/completions", json=greedy_body(speculation=speculation))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["token_ids"] == expected_ids
    drafted, accepted = body["speculation"]["draft_lengths"], body["speculation"]["accepted_lengths"]
    blocks = [d for d in drafted if d]  # 0: a plain step (engine.goodput_gamma), no verification
    plain_forwards = sum(1 for d in drafted if not d)  # each samples up to 4 tokens on the target
    assert len(blocks) == len(accepted) and len(blocks) <= body["speculation"]["target_calls"]
    assert body["speculation"]["target_calls"] <= len(blocks) + 4 * plain_forwards
    assert all(1 <= d <= 6 and 0 <= a <= d for d, a in zip(blocks, accepted))
    bad = http.post("/v1/completions", json=greedy_body(speculation={"gamma": "fast"}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculation.gamma"


def test_streaming_completion_sends_sse_chunks_then_done(http, expected_ids, greedy_reference):
    body = greedy_body(stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response.iter_lines())
    assert payloads[-1] == "[DONE]"
    usage_chunk = payloads[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS
    chunks = payloads[:-2]
    assert chunks and all(chunk["object"] == "text_completion" for chunk in chunks)
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == "length"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    token_ids = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]
    assert token_ids == expected_ids
    assert_text_matches("".join(chunk["choices"][0]["text"] for chunk in chunks), expected_ids, greedy_reference)
    assert chunks[-1]["speculation"]["strategy"] == "sd"


def test_chat_completion_uses_the_models_chat_template(http, greedy_reference):
    """The prompt is the tokenizer's apply_chat_template tokens (with the request's
    chat_template_kwargs), not the fallback format and not tokenized twice."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    prompt_ids = list(greedy_reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, brief=True)["input_ids"])
    assert prompt_ids[0] == greedy_reference.tokenizer.bos_token_id
    expected = greedy_reference.continuation(prompt_ids, 8)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "chat_template_kwargs": {"brief": True}}
    chat = http.post("/v1/chat/completions", json=body).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["token_ids"] == expected
    assert chat["usage"]["prompt_tokens"] == len(prompt_ids)
    plain = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": None}).json()
    assert plain["usage"]["prompt_tokens"] < len(prompt_ids)  # without "(brief)"
    refused = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": False}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        payloads = sse_payloads(response.iter_lines())
    chunks = payloads[:-1]
    assert payloads[-1] == "[DONE]"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]] == expected
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "speculation",
    [
        {"strategy": "ar"},
        {"strategy": "sd", "method": "token", "gamma": 3},
        {"strategy": "sd", "method": "greedy_block", "gamma": 5},
        {"strategy": "multi_draft", "method": "spectr", "num_drafts": 2, "gamma": 3},
        {"strategy": "multi_draft", "method": "spectr_gbv", "num_drafts": 3, "gamma": 4},
    ],
    ids=lambda spec: "-".join(str(value) for value in spec.values()),
)
def test_speculation_extension_selects_the_strategy_losslessly(http, expected_ids, speculation):
    body = http.post("/v1/completions", json=greedy_body(speculation=speculation)).json()
    assert body["choices"][0]["token_ids"] == expected_ids, body
    assert body["speculation"]["strategy"] == speculation["strategy"]
    assert body["speculation"]["method"] == speculation.get("method")
    if speculation["strategy"] == "ar":
        assert body["speculation"]["target_calls"] == MAX_TOKENS
        assert body["speculation"]["block_efficiency"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "speculation",
    [
        {"strategy": "ensemble", "ensemble": "weighted", "members": ["target", "partner"], "weights": [0.5, 0.5]},
        {"strategy": "se", "method": "token", "members": ["target", "partner", "partner2"], "gammas": [2, 2, 2]},
        {"strategy": "se", "ensemble": "contrastive", "mu": 0.5, "members": ["target", "partner"]},
    ],
    ids=["ensemble-2", "se-3", "se-contrastive"],
)
def test_ensemble_strategies_are_served(http, speculation):
    response = http.post("/v1/completions", json=greedy_body(max_tokens=6, speculation=speculation))
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"][0]["token_ids"]) == 6
    assert body["speculation"]["strategy"] == speculation["strategy"]
    assert set(body["speculation"]["model_calls"]) <= set(speculation["members"])


LONG_PROMPT_IDS = [5] * 300  # the tiny models' context is 256 tokens

BAD_REQUESTS = [
    ("invalid-json", b'{"prompt": "x", ', None),
    ("not-an-object", b"[1, 2]", None),
    ("unknown-field", {"prompt": "x", "frequency_penalties": 1.0}, "frequency_penalties"),
    ("frequency-penalty-out-of-range", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("suffix", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("best-of-above-n", {"prompt": "x", "best_of": 2}, "best_of"),
    ("missing-prompt", {"max_tokens": 4}, "prompt"),
    ("empty-prompt", {"prompt": ""}, "prompt"),
    ("prompt-list-mixed", {"prompt": ["a", [1, 2]]}, "prompt"),
    ("prompt-list-with-an-empty-one", {"prompt": ["a", ""]}, "prompt"),
    ("max-tokens-zero", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("max-tokens-negative", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("max-tokens-beyond-context", {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("temperature-negative", {"prompt": "x", "temperature": -0.1}, "temperature"),
    ("top-p-zero", {"prompt": "x", "top_p": 0}, "top_p"),
    ("top-p-above-one", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("n-zero", {"prompt": "x", "n": 0}, "n"),
    ("n-beyond-the-deployment", {"prompt": "x", "n": 17}, "n"),  # limits.max_concurrent_requests: 16
    ("prompt-too-long", {"prompt": LONG_PROMPT_IDS, "max_tokens": 1}, "prompt"),
    ("unknown-strategy", {"prompt": "x", "speculation": {"strategy": "beam"}}, "speculation.strategy"),
    ("unknown-method", {"prompt": "x", "speculation": {"strategy": "sd", "method": "spectr"}}, "speculation.method"),
    ("unknown-speculation-field", {"prompt": "x", "speculation": {"depth": 3}}, "speculation.depth"),
    ("gamma-zero", {"prompt": "x", "speculation": {"gamma": 0}}, "speculation.gamma"),
    ("gamma-too-large", {"prompt": "x", "speculation": {"gamma": 33}}, "speculation.gamma"),
    ("num-drafts-too-large", {"prompt": "x", "speculation": {"strategy": "multi_draft", "num_drafts": 9}}, "speculation.num_drafts"),
    ("unknown-member", {"prompt": "x", "speculation": {"strategy": "se", "members": ["target", "nobody"]}}, "speculation.members"),
    ("unknown-proposer", {"prompt": "x", "speculation": {"strategy": "se", "proposer": "nobody"}}, "speculation.proposer"),
    ("gammas-with-a-model-proposer", {"prompt": "x", "speculation": {"strategy": "se", "proposer": "draft", "gammas": [1, 2]}},
     "speculation.gammas"),
    ("weights-not-summing-to-one",
     {"prompt": "x", "speculation": {"strategy": "ensemble", "members": ["target", "partner"], "weights": [0.9, 0.9]}},
     "speculation.weights"),
]


@pytest.mark.parametrize("name, body, param", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_is_400_naming_the_field(http, name, body, param):
    if isinstance(body, bytes):
        response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["message"].startswith(f"{param}: ")


def test_bad_chat_input_is_400(http):
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ]
    for body, param in cases:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_unknown_model_is_404_and_the_server_keeps_serving(http, expected_ids):
    response = http.post("/v1/completions", json=greedy_body(model="gpt-4"))
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"
    assert http.post("/v1/completions", json=greedy_body()).json()["choices"][0]["token_ids"] == expected_ids


def test_concurrent_requests_all_complete_and_bad_ones_do_not_disturb_them(serve_app, expected_ids):
    def one(index: int):
        with httpx.Client(base_url=serve_app.http_url, timeout=180.0) as client:
            if index % 5 == 4:  # a bad request in flight among the good ones
                return client.post("/v1/completions", json=greedy_body(temperature=-1)).status_code, None
            if index % 2:
                with client.stream("POST", "/v1/completions", json=greedy_body(stream=True)) as response:
                    chunks = [p for p in sse_payloads(response.iter_lines()) if p != "[DONE]"]
                return response.status_code, [t for c in chunks for t in c["choices"][0]["token_ids"]]
            response = client.post("/v1/completions", json=greedy_body())
            return response.status_code, response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(one, range(10)))
    assert [status for status, _ in results] == [400 if i % 5 == 4 else 200 for i in range(10)]
    assert all(ids == expected_ids for i, (_, ids) in enumerate(results) if i % 5 != 4)


def _first_event_id(lines) -> str:
    """The ``id`` of the first server-sent event of a stream (blank keep-alive lines skipped)."""
    first = next(lines)
    while not first:
        first = next(lines)
    return json.loads(first[len("data: ") :])["id"]


def _wait_until_idle(http, request_id: str, timeout_s: float) -> float:
    """Seconds until no session of ``request_id`` is active and every worker is empty."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        status = http.get("/v1/status").json()
        active = [session for session in status["active_requests"] if session.startswith(request_id)]
        if not active and not any(status["sessions"].values()):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"request {request_id} still active after {timeout_s}s: {status}")


def _long_ar_body(max_tokens: int, n: int = 1) -> dict:
    """A greedy `ar` completion of ``max_tokens`` tokens that never stops early."""
    return {"prompt": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "n": n,
            "speculation": {"strategy": "ar"}}


@pytest.fixture(scope="module")
def full_long_request_s(http) -> float:
    """Seconds one 2000-token `ar` request takes to finish here (the session app's target has a
    2048 context): measured, not extrapolated from a short one, because a token at 2000 cached
    tokens costs more than one at 100 and a loaded machine slows every token alike."""
    started = time.monotonic()
    response = http.post("/v1/completions", json=_long_ar_body(2000))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2000
    return time.monotonic() - started


def test_client_disconnect_mid_stream_cancels_the_request(http, serve_app, full_long_request_s):
    # Start the 2000-token request streaming, read one chunk and hang up: its sessions must be
    # freed long before the same request, run to its end, finished.
    with httpx.Client(base_url=serve_app.http_url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json={**_long_ar_body(2000), "stream": True}) as response:
            lines = response.iter_lines()  # keep a reference: dropping it closes the response
            request_id = _first_event_id(lines)
            active = http.get("/v1/status").json()["active_requests"]
            assert any(session.startswith(request_id) for session in active), (request_id, active)
        started = time.monotonic()  # the hang-up: the connection closes as the blocks end
    _wait_until_idle(http, request_id, timeout_s=full_long_request_s)
    freed_after = time.monotonic() - started
    assert freed_after < full_long_request_s / 4, (freed_after, full_long_request_s)
    assert http.get("/health").status_code == 200


def test_client_disconnect_mid_stream_cancels_every_choice(http, serve_app, full_long_request_s):
    # As above, with n = 3: the three choices are three coordinator requests (`<id>-0`..`<id>-2`),
    # streamed interleaved; hanging up must free all of them (one choice alone takes
    # `full_long_request_s`; three take no less).
    with httpx.Client(base_url=serve_app.http_url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json={**_long_ar_body(2000, n=3), "stream": True}) as response:
            lines = response.iter_lines()
            request_id = _first_event_id(lines)
            active = http.get("/v1/status").json()["active_requests"]
            assert sum(session.startswith(request_id) for session in active) >= 1, (request_id, active)
        started = time.monotonic()  # the hang-up: the connection closes as the blocks end
    _wait_until_idle(http, request_id, timeout_s=full_long_request_s)
    freed_after = time.monotonic() - started
    assert freed_after < full_long_request_s / 4, (freed_after, full_long_request_s)
    assert http.get("/health").status_code == 200
