"""cluster.serving.errors.client_error: what a client is told about a failure, and what the log keeps
(no Ray cluster needed; the served bodies are checked in test_app_security.py)."""

from __future__ import annotations

import logging
import re

import grpc
import pytest

from actors.request_schema import InvalidRequestError
from cluster.serving.errors import (
    MAX_CLIENT_MESSAGE_CHARS,
    ModelGroupUnavailable,
    ModelNotFound,
    RequestFailed,
    Unauthenticated,
    clean_text,
    client_error,
)

#: What must never reach a client: traceback lines, IPv4 addresses, Ray actor / node / task
#: ids (hex), "pid=", terminal colour codes and other control characters.
INTERNALS = re.compile(
    r"Traceback|File \"|\bline \d+|\b\d{1,3}(?:\.\d{1,3}){3}\b|actor_id|\bpid[=:]|\bip[=:]|[0-9a-f]{24,}|\x1b|[\x00-\x08\x0b-\x1f\x7f]"
)

RAY_STYLE_FAILURE = (
    "\x1b[36mray::ModelWorker.score()\x1b[39m (pid=4242, ip=10.1.2.3, actor_id=5a3b1c9d8e7f60514233aabbccddeeff01000000, "
    "repr=<actors.worker.model_worker.ModelWorker object at 0x7f00>)\n"
    "Traceback (most recent call last):\n"
    '  File "/work/actors/worker/model_worker.py", line 120, in score\n'
    "    raise ValueError('temperature must be finite')\n"
    "ValueError: temperature must be finite"
)


def assert_no_internals(text: str) -> None:
    found = INTERNALS.search(text)
    assert found is None, f"internal detail {found.group()!r} in {text!r}"


def test_the_internals_pattern_catches_a_ray_error():
    assert INTERNALS.search(RAY_STYLE_FAILURE)


@pytest.mark.parametrize(
    "error, status, code",
    [
        (RequestFailed(f"the model group reported: {RAY_STYLE_FAILURE}"), 500, grpc.StatusCode.INTERNAL),
        (RuntimeError(RAY_STYLE_FAILURE), 500, grpc.StatusCode.INTERNAL),
        (KeyError("10.0.0.1"), 500, grpc.StatusCode.INTERNAL),
        (ModelGroupUnavailable(f"model group unavailable: {RAY_STYLE_FAILURE}"), 503, grpc.StatusCode.UNAVAILABLE),
        (TimeoutError(), 503, grpc.StatusCode.UNAVAILABLE),
    ],
    ids=["request-failed", "unexpected", "key-error", "unavailable", "timeout"],
)
def test_server_errors_reach_the_client_as_a_message_and_the_request_id(caplog, error, status, code):
    request_id = "cmpl-test-1"
    with caplog.at_level(logging.ERROR, logger="cluster.serving.errors"):
        failure = client_error(error, request_id)
    assert (failure.http_status, failure.grpc_code, failure.request_id) == (status, code, request_id)
    assert failure.error_type == "server_error" and failure.param is None
    assert request_id in failure.message
    assert_no_internals(failure.message.replace(request_id, ""))
    # The server log has the detail, under the same id.
    (record,) = caplog.records
    assert request_id in record.getMessage()
    assert record.exc_info is not None
    assert str(error) in record.getMessage() or type(error).__name__ in record.getMessage()


def test_client_errors_keep_their_message_cleaned_and_bounded():
    failure = client_error(InvalidRequestError("sampling.temperature", "must be a finite number (got inf)"), "r1")
    assert (failure.http_status, failure.grpc_code, failure.param) == (400, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature")
    assert failure.message == "sampling.temperature: must be a finite number (got inf)"
    echoed = client_error(InvalidRequestError("prompt", "bad \x1b[31mred\x1b[0m\nnext" + "y" * 2000), "r2")
    assert "\x1b" not in echoed.message and "\n" not in echoed.message
    assert len(echoed.message) <= MAX_CLIENT_MESSAGE_CHARS
    assert client_error(InvalidRequestError("body", "invalid JSON"), "r3").param is None
    assert client_error(Unauthenticated("missing or invalid API key"), "r4").grpc_code == grpc.StatusCode.UNAUTHENTICATED
    assert client_error(Unauthenticated("missing or invalid API key"), "r4").http_status == 401
    not_found = client_error(ModelNotFound("model 'gpt-4' is not served here"), "r5")
    assert (not_found.http_status, not_found.grpc_code, not_found.param) == (404, grpc.StatusCode.NOT_FOUND, "model")


def test_clean_text():
    assert clean_text("\x1b[1;31mboom\x1b[0m\ttab\x00nul") == "boom tab nul"
    assert clean_text("z" * 10, limit=5) == "zz..."


def test_limits_map_to_429_and_504_naming_the_limit():
    import grpc

    from actors.coordination.admission import OverloadedError
    from cluster.serving.errors import RequestTimedOut, client_error

    busy = client_error(OverloadedError("server busy: 16 running (limit max_concurrent_requests=16)"), "req-1")
    assert (busy.http_status, busy.grpc_code) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max_concurrent_requests" in busy.message
    late = client_error(RequestTimedOut("the request ran past limits.request_timeout_s=600 s"), "req-2")
    assert (late.http_status, late.grpc_code) == (504, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "request_timeout_s" in late.message
