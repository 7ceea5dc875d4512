"""Fuzzing the served application on both protocols: random field values (NaN, infinities,
huge, negative, wrong types, odd strings) and random bytes, a few hundred calls per protocol
from fixed seeds, sent over loopback to the session's Serve application.

No call may end in a server error (HTTP 5xx, an ``error`` event in a stream, gRPC INTERNAL /
UNKNOWN / anything but OK, INVALID_ARGUMENT and NOT_FOUND), a refusal must name the field,
and afterwards the server must be healthy: ``/health`` answers, a greedy request returns the
target's own continuation, and no request or KV-cache session is left behind.

Generated requests keep ``max_tokens`` small (a valid one asks for at most 4 tokens), so the
calls that pass validation are cheap. ``FUZZ_SUMMARY`` collects the outcome counts (printed
with ``pytest -s``).
"""

from __future__ import annotations

import collections
import json
import math
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest

from protos import specserve_pb2, specserve_pb2_grpc

HTTP_SEED = 20240611
GRPC_SEED = 20240612
#: Calls per protocol: every (field, edge value) pair once, the rest drawn at random.
HTTP_CALLS = 400
GRPC_CALLS = 400
WORKERS = 4
CALL_TIMEOUT_S = 60.0
#: Wall-clock bound of each fuzz test (pytest-timeout); a run takes well under it.
FUZZ_TIMEOUT_S = 600

HEALTH_PROMPT = "def main(argv=None):\n"
HEALTH_TOKENS = 6

FUZZ_SUMMARY: dict[str, dict] = {}

INT64_MAX = 2**63 - 1
#: A refusal names the field first: ``<field path>: <message>`` (``body``/``request`` for a
#: body or message that cannot be parsed at all).
FIELD_FIRST = re.compile(r"^[A-Za-z_#][\w.#]*: ")


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is (``NaN``, ``Infinity``, ``1e400``)."""

    text: str


def to_json(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{to_json(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(item) for item in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: "Infinity", -math.inf: "-Infinity"}.get(value, "NaN")
    return json.dumps(value)


# ------------------------------------------------------------------ value pools

SPECIAL_NUMBERS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("1e-400"),
                   Raw("5e-324"), Raw("-0.0"), Raw("1e308")]
INTS = [-(2**63), -1, 0, 1, 2, 3, 4, 8, 31, 32, 33, 255, 256, 4096, 2**31, 2**53 + 1, INT64_MAX, 2**63, 2**64, 10**30]
FLOATS = [0.0, 1e-7, 1e-6, 0.3, 0.5, 1.0, 1.5, 2.0, -0.5, -1.0, 1e6, 1e-300]
STRINGS = ["", "x", " ", "def f(", "sd", "ar", "multi_draft", "ensemble", "se", "beam", "token", "block",
           "greedy_block", "spectr", "sequential_gbv", "spectr_gbv", "weighted", "contrastive", "target", "draft",
           "partner", "partner2", "specserve", "gpt-4", "\u0000", "\n\r\t", "é✓你好", "\U0001F600", "\x1b[31mred",
           "../../etc/passwd", "a" * 3000, "${jndi:x}", "null"]
#: ``max_tokens`` values: every valid one is small (an unset max_tokens would ask for 64).
MAX_TOKENS = [-1, 0, 1, 2, 3, 4, 2**31, INT64_MAX, 2**63, 10**30, Raw("NaN"), Raw("1e400"), "3", 2.0, 2.5, True, [2]]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if kind < 0.15:
        return rng.choice([None, True, False])
    if kind < 0.35:
        return rng.choice(INTS)
    if kind < 0.5:
        return rng.choice(FLOATS)
    if kind < 0.65:
        return rng.choice(SPECIAL_NUMBERS)
    if kind < 0.85 or depth >= 2:
        return rng.choice(STRINGS)
    if kind < 0.93:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(STRINGS[:12]) or "k": random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def numbers(rng: random.Random):
    return rng.choice([rng.choice(INTS), rng.choice(FLOATS), rng.choice(SPECIAL_NUMBERS)])


def number_list(rng: random.Random):
    return [numbers(rng) for _ in range(rng.choice([0, 1, 2, 3, 70]))]


SMALL_SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
#: Structured outputs: valid, invalid and pathological constraints (each refused by name or served).
RESPONSE_FORMATS = [
    {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL_SCHEMA}},
    {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}},
    {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "format": "nope"}}},
    {"type": "json_schema", "json_schema": {"schema": SMALL_SCHEMA}}, {"type": "json_schema"}, {"type": "xml"},
    {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}, "json", [], None,
]
STRUCTURED_OUTPUTS = [
    {"regex": "[0-9]{2}"}, {"regex": "(("}, {"regex": "(a{1000}){1000}"}, {"regex": ""}, {"choice": ["yes", "no"]},
    {"choice": []}, {"choice": [""]}, {"choice": [1]}, {"grammar": 'start: "x" | "y"'}, {"grammar": "start: nope"},
    {"grammar": "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1} | \"x\"" for i in range(400)) + '\nr400: "y"'},
    {"json": SMALL_SCHEMA}, {"json": "{"}, {"json": {"type": "nope"}}, {"regex": "a", "choice": ["b"]}, {"other": 1}, {},
    {"choice": [f"w{i:07d}" for i in range(12_000)]},
]
FIELD_VALUES = {
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "seed": numbers,
    "ignore_eos": lambda rng: rng.choice([True, False, 1, "true", None]),
    "stop": lambda rng: rng.choice([rng.choice(STRINGS), [rng.choice(STRINGS) for _ in range(rng.choice([1, 2, 9]))], 5]),
    "stream": lambda rng: rng.choice([True, False, "yes", 1]),
    "stream_options": lambda rng: rng.choice([{"include_usage": True}, {"include_usage": "x"}, {"other": 1}, [], None]),
    "n": lambda rng: rng.choice([1, 2, 0, -1, 1.0, "1"]),
    "user": lambda rng: rng.choice(STRINGS),
    "model": lambda rng: rng.choice(["specserve", "gpt-4", "", None, 5, "a" * 3000]),
    "return_token_ids": lambda rng: rng.choice([True, False, "no"]),
    "logprobs": lambda rng: rng.choice([True, 5]),  # not a field: refused as unknown
    "response_format": lambda rng: rng.choice(RESPONSE_FORMATS),
    "structured_outputs": lambda rng: rng.choice(STRUCTURED_OUTPUTS),
    "tools": lambda rng: rng.choice([[{"type": "function", "function": {"name": "f", "parameters": SMALL_SCHEMA}}],
                                     [{"type": "function"}], [{"type": "function", "function": {"name": ""}}], {}]),
    "tool_choice": lambda rng: rng.choice(["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                                           {"type": "function"}, "always", 3]),
}
SPECULATION_VALUES = {
    "strategy": lambda rng: rng.choice(STRINGS[:12] + [5, None]),
    "method": lambda rng: rng.choice(STRINGS[4:17] + ["m" * 500, 3]),
    "gamma": numbers,
    "num_drafts": numbers,
    "ensemble": lambda rng: rng.choice(["weighted", "contrastive", "other", 1]),
    "weights": lambda rng: rng.choice([number_list(rng), [0.5, 0.5], [Raw("NaN"), 0.5], [1.0, 0.0], "0.5"]),
    "mu": numbers,
    "gammas": lambda rng: rng.choice([number_list(rng), [2, 2], [0, 40]]),
    "members": lambda rng: rng.choice([["target", "partner"], ["target", "nobody"], ["target"], [""], [1, 2],
                                       ["target", "partner", "partner2"], [rng.choice(STRINGS) for _ in range(3)]]),
    "depth": lambda rng: 3,  # not a field
}


def random_prompt(rng: random.Random):
    return rng.choice([
        rng.choice(STRINGS),
        [rng.choice([0, 1, 5, 100, 319, 320, 2**31, INT64_MAX, 2**63, -1]) for _ in range(rng.randint(0, 4))],
        [5] * 300,
        [[1, 2]],
        ["a", "b"],
        random_value(rng),
    ])


def speculation_value(rng: random.Random):
    if rng.random() < 0.1:
        return random_value(rng)
    names = rng.sample(sorted(SPECULATION_VALUES), rng.randint(1, 4))
    return {name: SPECULATION_VALUES[name](rng) if rng.random() < 0.8 else random_value(rng) for name in names}


#: Edge values of a number field: non-finite, denormal, beyond int64, negative, wrong types.
EDGE_NUMBERS = SPECIAL_NUMBERS + [-(2**63) - 1, -1, 0, 1e-7, 2**63, 2**64, 10**30, 1e308, "1", True, None, [1]]
SINGLE_FIELDS = {
    "temperature": EDGE_NUMBERS + [0.7, 2.0],
    "top_p": EDGE_NUMBERS + [0.9, 1e-300],
    "top_k": EDGE_NUMBERS + [5, INT64_MAX],
    "seed": EDGE_NUMBERS + [7, INT64_MAX],
    "max_tokens": MAX_TOKENS,
    "stop": ["", [""], ["a"] * 9, ["s" * 300], [1], "\n", ["x", "y"], None],
    "n": [0, 2, -1, 1.0, "1", None],
    "prompt": ["", [], [-1], [2**63], [10**30], [319], [320], [5] * 300, ["a"], [[1]], "a" * 3000, "\u0000", 5, None],
    "speculation.strategy": ["ar", "sd", "multi_draft", "ensemble", "se", "beam", "", None, 3],
    "speculation.method": ["token", "block", "greedy_block", "spectr", "sequential_gbv", "spectr_gbv", "m" * 500, ""],
    "speculation.gamma": EDGE_NUMBERS + [32, 33],
    "speculation.num_drafts": EDGE_NUMBERS + [8, 9],
    "speculation.mu": EDGE_NUMBERS + [0.5],
    "speculation.weights": [[Raw("NaN"), 0.5], [Raw("Infinity")], [Raw("1e400"), 0.0], [0.5, 0.5], [2.0, -1.0],
                            [0.0] * 70, [], "0.5", [None]],
    "speculation.gammas": [[0], [2**40], [2**64], [2, 2], [1] * 70, [Raw("NaN")], []],
    "speculation.members": [["target", "partner"], ["target", ""], ["m" * 200], ["target"] * 70, [1], []],
    "speculation.ensemble": ["weighted", "contrastive", "", "other"],
    "response_format": RESPONSE_FORMATS,
    "structured_outputs": STRUCTURED_OUTPUTS,
}


#: The strategy that uses a speculation field (set with it, so the value is not ignored).
FIELD_STRATEGY = {"weights": "ensemble", "gammas": "se", "members": "se", "mu": "se", "ensemble": "se",
                  "num_drafts": "multi_draft"}


def with_field(body: dict, name: str, value, with_strategy: bool = True) -> dict:
    """``body`` with one field (``speculation.<name>`` inside ``speculation``) set to ``value``."""
    if name.startswith("speculation."):
        field = name.split(".", 1)[1]
        strategy = FIELD_STRATEGY.get(field)
        speculation = {"strategy": strategy} if strategy and with_strategy else {}
        if field == "mu" and with_strategy:
            speculation["ensemble"] = "contrastive"
        speculation[field] = value
        body["speculation"] = speculation
    elif name == "prompt" and "messages" in body:
        body["messages"] = [{"role": "user", "content": value}]
    else:
        body[name] = value
    return body


def http_base(chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": "import os"}], "max_tokens": 2, "temperature": 0}
    return {"prompt": "x", "max_tokens": 2, "temperature": 0}


def http_edge_cases() -> list[tuple[str, str, bytes, bool]]:
    """Every (field, edge value) pair of SINGLE_FIELDS once, in a valid completion body."""
    return [("one-field", "/v1/completions", to_json(with_field(http_base(False), name, value)).encode(), False)
            for name in sorted(SINGLE_FIELDS) for value in SINGLE_FIELDS[name]]


def http_case(rng: random.Random) -> tuple[str, str, bytes, bool]:
    """(kind, path, body bytes, streaming) of one fuzzed HTTP request."""
    chat = rng.random() < 0.3
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = rng.random()
    if kind < 0.1:
        return "random-bytes", path, rng.randbytes(rng.randint(0, 200)), False
    if kind < 0.15:  # a valid body cut short, or a JSON value that is not an object
        valid = to_json({"prompt": "x", "max_tokens": 2})
        cut = rng.choice([valid[: rng.randint(0, len(valid) - 1)].encode(), b"[1, 2]", b"3", b'"x"', b"null"])
        return "not-an-object", path, cut, False
    body = http_base(chat)
    if rng.random() < 0.2:
        body["stream"] = True
    if kind < 0.45:
        name = rng.choice(sorted(SINGLE_FIELDS))
        value = rng.choice(SINGLE_FIELDS[name]) if rng.random() < 0.85 else random_value(rng)
        body = with_field(body, name, value, with_strategy=rng.random() < 0.7)
        return "one-field", path, to_json(body).encode(), body.get("stream") is True
    if chat and rng.random() < 0.3:
        body["messages"] = rng.choice([[], [{"role": "robot", "content": "x"}], [{"role": "user"}],
                                       [{"role": "user", "content": random_value(rng)}], random_value(rng)])
    if chat and rng.random() < 0.2:
        body["max_completion_tokens"] = rng.choice(MAX_TOKENS)
    if not chat and rng.random() < 0.3:
        body["prompt"] = random_prompt(rng)
    for name in rng.sample(sorted(FIELD_VALUES) + ["max_tokens", "speculation"] * 2, rng.choice([1, 2, 3, 4])):
        if name == "max_tokens":
            body["max_tokens"] = rng.choice(MAX_TOKENS)
        elif name == "speculation":
            body["speculation"] = speculation_value(rng)
        else:
            body[name] = FIELD_VALUES[name](rng) if rng.random() < 0.8 else random_value(rng)
    return "many-fields", path, to_json(body).encode(), body.get("stream") is True


def sse_payloads(text: str) -> list:
    payloads = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def assert_server_is_healthy(http_url: str, channel, metadata, greedy_reference) -> None:
    """/health answers, a greedy request returns the target's continuation on both protocols,
    and no request or KV-cache session is left behind."""
    prompt_ids = greedy_reference.encode(HEALTH_PROMPT)
    expected = greedy_reference.continuation(prompt_ids, HEALTH_TOKENS)
    with httpx.Client(base_url=http_url, timeout=CALL_TIMEOUT_S) as http:
        assert http.get("/health").json()["status"] == "ok"
        body = {"prompt": prompt_ids, "max_tokens": HEALTH_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == expected
        request = specserve_pb2.GenerateRequest(
            prompt_ids=prompt_ids,
            sampling=specserve_pb2.SamplingOptions(max_tokens=HEALTH_TOKENS, temperature=0.0, ignore_eos=True),
        )
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        assert list(stub.Generate(request, metadata=metadata, timeout=CALL_TIMEOUT_S).token_ids) == expected
        deadline = time.monotonic() + 60
        while True:
            status = http.get("/v1/status").json()
            if not status["active_requests"] and not any(status["sessions"].values()):
                break
            assert time.monotonic() < deadline, f"requests or sessions left behind: {status}"
            time.sleep(0.1)


def http_violation(status: int, text: str, streaming: bool) -> str | None:
    """What is wrong with one HTTP answer, or None."""
    if status >= 500:
        return "server error"
    if "Traceback" in text:
        return "traceback in the body"
    try:
        if status >= 400:
            error = json.loads(text)["error"]
            if set(error) != {"message", "type", "param", "code"} or error["type"] != "invalid_request_error":
                return "not an OpenAI client-error body"
            if status == 400 and error["param"] is not None and not error["message"].startswith(f"{error['param']}: "):
                return "the message does not name the field"
        elif streaming:
            payloads = sse_payloads(text)
            if not payloads or payloads[-1] != "[DONE]":
                return "stream not ended by [DONE]"
            if any(isinstance(p, dict) and "error" in p for p in payloads):
                return "error event in the stream"
        elif not json.loads(text)["choices"]:
            return "no choices"
    except (ValueError, KeyError, TypeError) as error:
        return f"unreadable body ({type(error).__name__})"
    return None


@pytest.fixture(scope="module")
def channel(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


@pytest.fixture(scope="module")
def metadata(serve_app):
    return (("application", serve_app.model),)


# ------------------------------------------------------------------ HTTP


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_http_fuzz_never_gets_a_server_error(serve_app, channel, metadata, greedy_reference):
    rng = random.Random(HTTP_SEED)
    cases = http_edge_cases()
    cases += [http_case(rng) for _ in range(HTTP_CALLS - len(cases))]
    rng.shuffle(cases)

    def call(case):
        _, path, body, streaming = case
        with httpx.Client(base_url=serve_app.http_url, timeout=CALL_TIMEOUT_S) as http:
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            return case, response.status_code, response.text

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        results = list(pool.map(call, cases))
    elapsed = time.monotonic() - started

    statuses: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    violations: list[str] = []
    for (kind, path, body, streaming), status, text in results:
        statuses[status] += 1
        kinds[kind] += 1
        problem = http_violation(status, text, streaming)
        if problem:
            violations.append(f"{problem}: {path} {body[:200]!r} -> {status} {text[:300]}")
    FUZZ_SUMMARY["http"] = {"calls": len(results), "kinds": dict(sorted(kinds.items())),
                            "statuses": dict(sorted(statuses.items())),
                            "violations": len(violations), "seconds": round(elapsed, 1)}
    print(f"\nHTTP fuzz: {FUZZ_SUMMARY['http']}")
    assert not violations, f"{len(violations)} bad answers, e.g.\n" + "\n".join(violations[:20])
    assert statuses[200] >= 10, "the fuzz should also produce some valid requests"
    assert_server_is_healthy(serve_app.http_url, channel, metadata, greedy_reference)


# ------------------------------------------------------------------ gRPC

GRPC_INTS = [-(2**63), -(2**31), -1, 0, 1, 2, 3, 4, 8, 32, 33, 255, 256, 2**31, 2**62, INT64_MAX]
GRPC_MAX_TOKENS = [-(2**63), -1, 0, 1, 2, 3, 4, 2**40, INT64_MAX]
DOUBLES = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e-320, -0.0, 0.0, 1e-7, 1e-6, 0.5, 1.0, 1.5, 2.0, -1.0]
GRPC_STRINGS = [s for s in STRINGS if "\ud800" not in s]
REQUEST_IDS = ["", "ok-1", "fuzz:2.a_b", "has space", "x" * 200, "ü", "a/b", "\n"]


def _strings(rng: random.Random) -> list[str]:
    return [rng.choice(GRPC_STRINGS) for _ in range(rng.choice([0, 1, 2, 3, 9]))]


def grpc_message(rng: random.Random) -> specserve_pb2.GenerateRequest:
    """A GenerateRequest with random fields set (every set option drawn from typed pools)."""
    request = specserve_pb2.GenerateRequest()
    if rng.random() < 0.3:
        request.request_id = rng.choice(REQUEST_IDS)
    if rng.random() < 0.2:
        request.model = rng.choice(["specserve", "gpt-4", "m" * 300, ""])
    prompt_kind = rng.random()
    if prompt_kind < 0.6:
        request.prompt = rng.choice(GRPC_STRINGS)
    elif prompt_kind < 0.85:
        request.prompt_ids.extend(rng.choice([[], [1, 2], [-1], [INT64_MAX], [5] * 300, [0, 319, 320], [2**40]]))
    elif prompt_kind < 0.93:
        request.prompt = "x"
        request.prompt_ids.append(1)
    sampling = request.sampling
    sampling.max_tokens = rng.choice(GRPC_MAX_TOKENS) if rng.random() < 0.4 else 2
    if rng.random() < 0.5:
        sampling.temperature = rng.choice(DOUBLES)
    else:
        sampling.temperature = 0.0
    for name in ("top_p",):
        if rng.random() < 0.4:
            setattr(sampling, name, rng.choice(DOUBLES))
    for name in ("top_k", "seed"):
        if rng.random() < 0.4:
            setattr(sampling, name, rng.choice(GRPC_INTS))
    if rng.random() < 0.3:
        sampling.stop.extend(_strings(rng))
    if rng.random() < 0.3:
        sampling.ignore_eos = rng.random() < 0.5
    if rng.random() < 0.6:
        speculation = request.speculation
        speculation.SetInParent()
        if rng.random() < 0.6:
            speculation.strategy = rng.choice(GRPC_STRINGS[:12] + ["s" * 200])
        if rng.random() < 0.4:
            speculation.method = rng.choice(GRPC_STRINGS[4:17])
        for name in ("gamma", "num_drafts"):
            if rng.random() < 0.4:
                setattr(speculation, name, rng.choice(GRPC_INTS))
        if rng.random() < 0.3:
            speculation.ensemble = rng.choice(["weighted", "contrastive", "other", ""])
        if rng.random() < 0.3:
            speculation.weights.extend(rng.choice([[0.5, 0.5], [math.nan, 0.5], [math.inf], [1.0, 0.0],
                                                   [rng.choice(DOUBLES) for _ in range(rng.choice([1, 2, 70]))]]))
        if rng.random() < 0.3:
            speculation.mu = rng.choice(DOUBLES)
        if rng.random() < 0.3:
            speculation.gammas.extend(rng.choice([[2, 2], [0, 40], [rng.choice(GRPC_INTS) for _ in range(rng.choice([1, 3, 70]))]]))
        if rng.random() < 0.3:
            speculation.members.extend(rng.choice([["target", "partner"], ["target", "nobody"], [""], _strings(rng)]))
    return request


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Flip, drop, insert or truncate bytes of a serialized message."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        action = rng.random()
        if action < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif action < 0.6 and data:
            del data[rng.randrange(len(data))]
        elif action < 0.8:
            data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        elif data:
            data = data[: rng.randrange(len(data))]
    return bytes(data)


GRPC_SINGLE_FIELDS = {
    "sampling.temperature": DOUBLES,
    "sampling.top_p": DOUBLES,
    "sampling.top_k": GRPC_INTS,
    "sampling.seed": GRPC_INTS,
    "sampling.max_tokens": GRPC_MAX_TOKENS,
    "sampling.stop": [[""], ["a"] * 9, ["s" * 300], ["x", "y"], ["\u0000"]],
    "prompt": GRPC_STRINGS,
    "prompt_ids": [[], [1, 2], [-1], [INT64_MAX], [5] * 300, [319], [320], [2**40], [-(2**63)]],
    "request_id": REQUEST_IDS,
    "model": ["specserve", "gpt-4", "m" * 300, ""],
    "speculation.strategy": GRPC_STRINGS[:12] + ["s" * 200],
    "speculation.method": GRPC_STRINGS[4:17] + ["m" * 200],
    "speculation.ensemble": ["weighted", "contrastive", "other", ""],
    "speculation.gamma": GRPC_INTS,
    "speculation.num_drafts": GRPC_INTS,
    "speculation.mu": DOUBLES,
    "speculation.weights": [[0.5, 0.5], [math.nan, 0.5], [math.inf, 0.0], [-math.inf, 1.0], [2.0, -1.0], [0.0] * 70,
                            [5e-324, 1.0]],
    "speculation.gammas": [[2, 2], [0, 2], [2**40, 1], [1] * 70, [-(2**63), 1], [INT64_MAX, 1]],
    "speculation.members": [["target", "partner"], ["target", ""], ["m" * 200], ["target"] * 70, ["target", "nobody"]],
    "sampling.structured_outputs": [
        specserve_pb2.StructuredOutputs(regex="[0-9]{2}"), specserve_pb2.StructuredOutputs(regex="(("),
        specserve_pb2.StructuredOutputs(json="{"), specserve_pb2.StructuredOutputs(json='{"type": "nope"}'),
        specserve_pb2.StructuredOutputs(choice=["a", ""]), specserve_pb2.StructuredOutputs(grammar="start: nope"),
        specserve_pb2.StructuredOutputs(json_object=True), specserve_pb2.StructuredOutputs(json_object=False),
        specserve_pb2.StructuredOutputs(), specserve_pb2.StructuredOutputs(regex="a", choice=["b"]),
    ],
}


def grpc_with_field(name: str, value, with_strategy: bool = True) -> specserve_pb2.GenerateRequest:
    """A valid request (2 greedy tokens) with one field set to ``value``."""
    request = specserve_pb2.GenerateRequest(
        prompt="x", sampling=specserve_pb2.SamplingOptions(max_tokens=2, temperature=0.0)
    )
    if name in ("prompt_ids",):
        request.ClearField("prompt")
    message, field = request, name
    if "." in name:
        part, field = name.split(".")
        message = getattr(request, part)
        if part == "speculation" and with_strategy and field in FIELD_STRATEGY:
            message.strategy = FIELD_STRATEGY[field]
            if field == "mu":
                message.ensemble = "contrastive"
    if isinstance(value, list):
        getattr(message, field).extend(value)
    elif isinstance(value, specserve_pb2.StructuredOutputs):
        getattr(message, field).CopyFrom(value)
    else:
        setattr(message, field, value)
    return request


def grpc_edge_cases() -> list[tuple[str, str, object]]:
    """Every (field, edge value) pair of GRPC_SINGLE_FIELDS once (unary Generate)."""
    return [("Generate", "one-field", grpc_with_field(name, value))
            for name in sorted(GRPC_SINGLE_FIELDS) for value in GRPC_SINGLE_FIELDS[name]]


def grpc_one_bad_field(rng: random.Random) -> specserve_pb2.GenerateRequest:
    name = rng.choice(sorted(GRPC_SINGLE_FIELDS))
    return grpc_with_field(name, rng.choice(GRPC_SINGLE_FIELDS[name]), with_strategy=rng.random() < 0.7)


def grpc_case(rng: random.Random) -> tuple[str, str, object]:
    """(rpc, kind, payload): payload is a GenerateRequest or raw bytes."""
    kind = rng.random()
    rpc = "GenerateStream" if rng.random() < 0.25 else "Generate"
    if kind < 0.35:
        return rpc, "one-field", grpc_one_bad_field(rng)
    if kind < 0.6:
        return rpc, "many-fields", grpc_message(rng)
    if kind < 0.8:
        return rpc, "random-bytes", rng.randbytes(rng.randint(0, 120))
    base = grpc_one_bad_field(rng) if rng.random() < 0.5 else grpc_message(rng)
    base.sampling.max_tokens = 2
    return rpc, "mutated-bytes", mutate(rng, base.SerializeToString())


ALLOWED_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_grpc_fuzz_never_gets_internal_or_unknown(serve_app, channel, metadata, greedy_reference):
    rng = random.Random(GRPC_SEED)
    cases = grpc_edge_cases()
    cases += [grpc_case(rng) for _ in range(GRPC_CALLS - len(cases))]
    rng.shuffle(cases)
    identity = lambda payload: payload  # noqa: E731 - raw bytes in, raw bytes out
    raw = {
        "Generate": channel.unary_unary("/specserve.SpecServe/Generate", request_serializer=identity,
                                        response_deserializer=identity),
        "GenerateStream": channel.unary_stream("/specserve.SpecServe/GenerateStream", request_serializer=identity,
                                               response_deserializer=identity),
    }

    def call(case):
        rpc, kind, payload = case
        data = payload.SerializeToString() if isinstance(payload, specserve_pb2.GenerateRequest) else payload
        try:
            if rpc == "Generate":
                raw[rpc](data, metadata=metadata, timeout=CALL_TIMEOUT_S)
            else:
                for _ in raw[rpc](data, metadata=metadata, timeout=CALL_TIMEOUT_S):
                    pass
        except grpc.RpcError as error:
            return case, error.code(), error.details() or ""
        return case, grpc.StatusCode.OK, ""

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        results = list(pool.map(call, cases))
    elapsed = time.monotonic() - started

    codes: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    violations: list[str] = []
    for (rpc, kind, payload), code, details in results:
        codes[code.name] += 1
        kinds[kind] += 1
        problem = None
        if code not in ALLOWED_CODES:
            problem = f"status {code.name}"
        elif "Traceback" in details:
            problem = "traceback in the details"
        elif code == grpc.StatusCode.INVALID_ARGUMENT and not FIELD_FIRST.match(details):
            problem = "the details do not name the field"
        if problem:
            violations.append(f"{problem}: {rpc} {kind} {str(payload)[:200]!r} -> {code.name} {details[:300]!r}")
    FUZZ_SUMMARY["grpc"] = {"calls": len(results), "kinds": dict(sorted(kinds.items())),
                            "codes": dict(sorted(codes.items())), "violations": len(violations),
                            "seconds": round(elapsed, 1)}
    print(f"\ngRPC fuzz: {FUZZ_SUMMARY['grpc']}")
    assert not violations, f"{len(violations)} bad answers, e.g.\n" + "\n".join(violations[:20])
    assert codes["OK"] >= 10, "the fuzz should also produce some valid requests"
    undecodable = [d for (_, kind, _), code, d in results if kind == "random-bytes" and code.name == "INVALID_ARGUMENT"]
    assert any(d.startswith("request: ") for d in undecodable), "random bytes should include undecodable messages"
    assert_server_is_healthy(serve_app.http_url, channel, metadata, greedy_reference)
