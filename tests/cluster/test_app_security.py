"""API key and error bodies on a served application, both protocols.

A second application (``specserve-keyed``, target + draft, ``security.api_key`` set) is added
to the session's Serve config and removed at the end, as in test_app_replicas.py. Its tests
run in file order: authentication first, then its model group is broken on purpose (a worker
killed, then the coordinator) to check that server errors reach clients as a message and a
request id only, while the replica's log keeps the detail under that id.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time

import grpc
import httpx
import openai
import pytest
import ray

from cluster.serve_command import deploy
from protos import specserve_pb2, specserve_pb2_grpc

from .conftest import serve_document, specserve_application
from .test_errors import assert_no_internals

APP = "specserve-keyed"
ROUTE = "/keyed"
KEY = "test-key-Zx9/+=-0123456789"
WRONG_KEY = "test-key-Zx9/+=-0123456780"
BODY = {"prompt": "def f(", "max_tokens": 3, "temperature": 0}
REQUEST_ID = re.compile(r"\(request id ([\w.:-]+)\)")


@pytest.fixture(scope="module")
def keyed_app(serve_app, tiny_checkpoints):
    args = {
        "models": {
            "target": {"path": str(tiny_checkpoints["target"]), "role": "target"},
            "draft": {"path": str(tiny_checkpoints["draft"]), "role": "draft"},
        },
        "defaults": {"strategy": "sd", "method": "block", "gamma": 3},
        "resources": {"cpus_per_model": 0.25, "torch_threads": 1},
        "security": {"api_key": KEY},
    }
    both = serve_document(serve_app.document["applications"] + [specserve_application(APP, ROUTE, args)])
    both.update({key: serve_app.document[key] for key in ("http_options", "grpc_options")})
    deploy("<keyed app>", serve_app.addresses, both)
    yield serve_app
    deploy("<session app only>", serve_app.addresses, serve_app.document)  # deletes specserve-keyed


@pytest.fixture(scope="module")
def http(keyed_app):
    with httpx.Client(base_url=f"{keyed_app.http_url}{ROUTE}", timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def stub(keyed_app):
    with grpc.insecure_channel(keyed_app.grpc_target) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield specserve_pb2_grpc.SpecServeStub(channel), channel


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def grpc_metadata(*extra: tuple[str, str]) -> tuple:
    return (("application", APP), *extra)


GRPC_REQUEST = specserve_pb2.GenerateRequest(
    prompt="def f(", sampling=specserve_pb2.SamplingOptions(max_tokens=3, temperature=0.0)
)


# ------------------------------------------------------------------ HTTP


@pytest.mark.parametrize("headers", [{}, bearer(WRONG_KEY), {"authorization": f"Basic {KEY}"},
                                     {"x-api-key": WRONG_KEY}, {"authorization": "Bearer"}],
                         ids=["missing", "wrong", "not-bearer", "wrong-x-api-key", "empty"])
def test_http_without_the_right_key_is_401_everywhere_but_health(http, headers):
    for method, path, body in [("POST", "/v1/completions", BODY),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("GET", "/v1/models", None), ("GET", "/v1/status", None)]:
        response = http.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, (path, response.text)
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert KEY not in response.text and WRONG_KEY not in response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.headers["specserve-request-id"]
    assert http.get("/health", headers=headers).json()["status"] == "ok"  # open on purpose


def test_http_with_the_right_key_is_served(http):
    for headers in (bearer(KEY), {"Authorization": f"bearer {KEY}"}, {"x-api-key": KEY}):
        response = http.post("/v1/completions", json=BODY, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    assert http.get("/v1/models", headers=bearer(KEY)).json()["data"][0]["id"] == APP
    assert http.get("/v1/status", headers=bearer(KEY)).json()["model"] == APP
    # An unauthenticated bad request is refused for the key, not for the body.
    assert http.post("/v1/completions", content=b"\xff", headers={"content-type": "application/json"}).status_code == 401


def test_the_openai_client_sends_the_key(keyed_app):
    base_url = f"{keyed_app.http_url}{ROUTE}/v1"
    client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)
    completion = client.completions.create(model=APP, prompt="def f(", max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key=WRONG_KEY, max_retries=0).completions.create(model=APP, prompt="x")


def test_the_session_application_without_a_key_stays_open(keyed_app):
    response = httpx.post(f"{keyed_app.http_url}/v1/completions", json=BODY, timeout=120)
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------ gRPC


@pytest.mark.parametrize(
    "extra",
    [(), (("authorization", f"Bearer {WRONG_KEY}"),), (("x-api-key", WRONG_KEY),), (("authorization", KEY),)],
    ids=["missing", "wrong-bearer", "wrong-x-api-key", "no-scheme"],
)
def test_grpc_without_the_right_key_is_unauthenticated(stub, extra):
    stub, channel = stub
    calls = [
        lambda: stub.Generate(GRPC_REQUEST, metadata=grpc_metadata(*extra), timeout=60),
        lambda: list(stub.GenerateStream(GRPC_REQUEST, metadata=grpc_metadata(*extra), timeout=60)),
        # Undecodable bytes are refused for the key first.
        lambda: channel.unary_unary("/specserve.SpecServe/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)(b"\xff\xff", metadata=grpc_metadata(*extra),
                                                                       timeout=60),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in caught.value.details() and KEY not in caught.value.details()


def test_grpc_with_the_right_key_is_served(stub):
    stub, channel = stub
    for extra in (("authorization", f"Bearer {KEY}"), ("x-api-key", KEY)):
        response = stub.Generate(GRPC_REQUEST, metadata=grpc_metadata(extra), timeout=120)
        assert response.usage.completion_tokens == 3
        messages = list(stub.GenerateStream(GRPC_REQUEST, metadata=grpc_metadata(extra), timeout=120))
        assert messages[-1].finished
    raw = channel.unary_unary("/specserve.SpecServe/Generate", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as caught:
        raw(b"\xff\xff", metadata=grpc_metadata(("x-api-key", KEY)), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("request: ")


# ------------------------------------------------------------------ error bodies


def _logged(request_id: str, needles: tuple[str, ...], timeout_s: float = 30.0) -> bool:
    """Whether a log file of this Ray session has a line with ``request_id`` and, within the
    next lines, one of ``needles`` (the detail the client did not get)."""
    logs = pathlib.Path(ray._private.worker._global_node.get_logs_dir_path())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in logs.rglob("*"):
            if not path.is_file() or path.suffix not in (".log", ".err", ".out"):
                continue
            text = path.read_text(errors="replace")
            index = text.find(request_id)
            while index >= 0:
                if any(needle in text[index : index + 20000] for needle in needles):
                    return True
                index = text.find(request_id, index + 1)
        time.sleep(1.0)
    return False


def _check_server_error_body(text: str, actor_ids: list[str]) -> str:
    """The body names a request id and nothing internal; returns the request id."""
    found = REQUEST_ID.search(text)
    assert found, text
    request_id = found.group(1)
    assert_no_internals(text.replace(request_id, ""))
    for actor_id in actor_ids:
        assert actor_id not in text
    return request_id


def test_server_errors_carry_a_request_id_and_no_internals(http, stub):
    stub, _ = stub
    status = http.get("/v1/status", headers=bearer(KEY)).json()
    actor_ids = [status["coordinator"], *status["workers"].values(), status["replica_actor"]]
    node_ip = ray.util.get_node_ip_address()

    # 1. A model worker dies: the health check, requests on both protocols fail cleanly.
    _crash(status["workers"]["draft"])
    deadline = time.monotonic() + 60
    while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "unavailable"
    health_id = _check_server_error_body(health.json()["error"], actor_ids)
    assert health.json()["request_id"] == health_id == health.headers["specserve-request-id"]
    assert node_ip not in health.text
    print(f"\nworker killed: GET /health -> {health.status_code} {health.text}")

    response = http.post("/v1/completions", json=BODY, headers=bearer(KEY))
    assert response.status_code in (500, 503), response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    request_id = _check_server_error_body(error["message"], actor_ids)
    assert response.headers["specserve-request-id"] == request_id
    assert node_ip not in response.text
    assert _logged(request_id, ("Traceback", "ActorDiedError", "RayActorError", "actor_id")), request_id
    print(f"worker killed: POST /v1/completions -> {response.status_code} {response.text}")

    with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}, headers=bearer(KEY)) as streamed:
        text = streamed.read().decode()
    assert streamed.status_code in (200, 500, 503)
    _check_server_error_body(text, actor_ids)

    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(GRPC_REQUEST, metadata=grpc_metadata(("x-api-key", KEY)), timeout=60)
    assert caught.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    grpc_id = _check_server_error_body(caught.value.details(), actor_ids)
    print(f"worker killed: Generate -> {caught.value.code().name} {caught.value.details()!r}")
    assert ("specserve-request-id", grpc_id) in tuple(caught.value.trailing_metadata() or ())
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(GRPC_REQUEST, metadata=grpc_metadata(("x-api-key", KEY)), timeout=60))
    assert caught.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    _check_server_error_body(caught.value.details(), actor_ids)

    # 2. The coordinator dies too: 503 / UNAVAILABLE, still nothing internal.
    _crash(status["coordinator"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = http.post("/v1/completions", json=BODY, headers=bearer(KEY))
        if response.status_code == 503:
            break
        time.sleep(0.5)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "unavailable"
    _check_server_error_body(response.json()["error"]["message"], actor_ids)
    health = http.get("/health")
    assert health.status_code == 503
    _check_server_error_body(health.json()["error"], actor_ids)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(GRPC_REQUEST, metadata=grpc_metadata(("x-api-key", KEY)), timeout=60)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    _check_server_error_body(caught.value.details(), actor_ids)
    print(f"coordinator killed: POST /v1/completions -> {response.status_code} {response.text}")
    print(f"coordinator killed: Generate -> {caught.value.code().name} {caught.value.details()!r}")


def _crash(actor_id: str) -> None:
    """Kill the process of one of the keyed application's actors (SIGKILL: a crash)."""
    pid = ray._private.state.actors()[actor_id]["Pid"]
    os.kill(pid, signal.SIGKILL)
