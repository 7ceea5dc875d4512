"""API key and error bodies on a served application, both protocols.

A second application (``specserve-keyed``, target + draft, ``security.api_key`` set) is added
to the session's Serve config and removed at the end, as in test_app_replicas.py. Its tests
run in file order: authentication first, then its model group is broken on purpose (a worker
killed, then the coordinator) to check that server errors reach clients as a message and a
request id only, while the replica's log keeps the detail under that id.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import ray

from cluster.serving.serve_command import deploy
from protos import specserve_pb2, specserve_pb2_grpc

from tests.cluster.conftest import serve_document, specserve_application
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
                               ("GET", "/v1/models", None), ("GET", "/v1/status", None), ("GET", "/metrics", None),
                               ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/redoc", None)]:
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
    assert "specserve_requests_total" in http.get("/metrics", headers=bearer(KEY)).text
    schema = http.get("/openapi.json", headers=bearer(KEY)).json()
    assert {"/v1/completions", "/v1/chat/completions", "/health"} <= set(schema["paths"])
    assert not {"/docs", "/redoc", "/openapi.json"} & set(schema["paths"])
    docs = http.get("/docs", headers={"x-api-key": KEY})
    assert docs.status_code == 200 and "swagger-ui" in docs.text and f"{ROUTE}/openapi.json" in docs.text
    redoc = http.get("/redoc", headers=bearer(KEY))
    assert redoc.status_code == 200 and "redoc" in redoc.text and f"{ROUTE}/openapi.json" in redoc.text
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
    for path in ("/openapi.json", "/docs", "/redoc"):  # without a key, the schema's pages are open too
        assert httpx.get(f"{keyed_app.http_url}{path}", timeout=120).status_code == 200, path


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


def _check_server_error_body(text: str, actor_ids: list[str], node_ip: str) -> str:
    """The body names a request id and nothing internal; returns the request id."""
    found = REQUEST_ID.search(text)
    assert found, text
    request_id = found.group(1)
    assert_no_internals(text.replace(request_id, ""))
    assert node_ip not in text
    for actor_id in actor_ids:
        assert actor_id not in text
    return request_id


def _crash(actor_id: str) -> None:
    """Kill the process of one of the keyed application's actors (SIGKILL: a crash)."""
    pid = ray._private.state.actors()[actor_id]["Pid"]
    os.kill(pid, signal.SIGKILL)


#: A target-only request long enough (one target call per token) to be in flight when its
#: actor is killed; the keyed application's context is 256 tokens.
LONG = {"prompt": "x", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "speculation": {"strategy": "ar"}}
LONG_GRPC = specserve_pb2.GenerateRequest(
    prompt="x",
    sampling=specserve_pb2.SamplingOptions(max_tokens=240, temperature=0.0, ignore_eos=True),
    speculation=specserve_pb2.SpeculationOptions(strategy="ar"),
)


def _wait_until_in_flight(http, count: int, timeout_s: float = 60.0) -> None:
    """Poll the replica's status until ``count`` requests are admitted or queued."""
    deadline = time.monotonic() + timeout_s
    while len(http.get("/v1/status", headers=bearer(KEY)).json()["active_requests"]) < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests in flight after {timeout_s} s"
        time.sleep(0.05)


def _crash_mid_request(http, stub, actor_id: str, actor_ids: list[str], node_ip: str) -> list[str]:
    """Start long requests on both protocols, kill ``actor_id`` while they run, and check what
    each client got: success, or a server error with a request id and nothing internal
    (the model group's actors restart, so a request may also be retried in time). Returns the
    request ids of the server errors."""
    metadata = grpc_metadata(("x-api-key", KEY))

    def http_unary():
        return http.post("/v1/completions", json=LONG, headers=bearer(KEY))

    def grpc_unary():
        try:
            return stub.Generate(LONG_GRPC, metadata=metadata, timeout=120)
        except grpc.RpcError as error:
            return error

    def grpc_stream():
        try:
            return list(stub.GenerateStream(LONG_GRPC, metadata=metadata, timeout=120))
        except grpc.RpcError as error:
            return error

    request_ids: list[str] = []
    with ThreadPoolExecutor(max_workers=3) as pool:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}, headers=bearer(KEY)) as streamed:
            lines = streamed.iter_lines()
            first = next(line for line in lines if line)
            futures = [pool.submit(http_unary), pool.submit(grpc_unary), pool.submit(grpc_stream)]
            _wait_until_in_flight(http, 4)  # the other three are decoding too
            _crash(actor_id)
            rest = "\n".join(lines)
        # The HTTP stream was cut by the crash: it ends with an error event, then [DONE].
        assert first.startswith("data: ") and rest.rstrip().endswith("data: [DONE]"), rest[-500:]
        events = [json.loads(line[len("data: "):]) for line in rest.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "error" in events[-1], events[-1]
        request_ids.append(_check_server_error_body(events[-1]["error"]["message"], actor_ids, node_ip))
        print(f"\n{actor_id[:8]} killed: stream error event {json.dumps(events[-1])}")

        response = futures[0].result()
        if response.status_code != 200:
            assert response.status_code in (500, 503), response.text
            error = response.json()["error"]
            assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
            request_id = _check_server_error_body(error["message"], actor_ids, node_ip)
            assert response.headers["specserve-request-id"] == request_id
            request_ids.append(request_id)
            print(f"{actor_id[:8]} killed: POST /v1/completions -> {response.status_code} {response.text}")
        for name, result in (("Generate", futures[1].result()), ("GenerateStream", futures[2].result())):
            if isinstance(result, grpc.RpcError):
                assert result.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), result
                request_id = _check_server_error_body(result.details(), actor_ids, node_ip)
                request_ids.append(request_id)
                if name == "Generate":
                    assert ("specserve-request-id", request_id) in tuple(result.trailing_metadata() or ())
                print(f"{actor_id[:8]} killed: {name} -> {result.code().name} {result.details()!r}")

    # /health while the group recovers: 200, or 503 with nothing internal; then healthy again.
    started = time.monotonic()
    deadline = started + 180
    while (health := http.get("/health")).status_code != 200:
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "unavailable"
        assert _check_server_error_body(body["error"], actor_ids, node_ip) == body["request_id"]
        assert health.headers["specserve-request-id"] == body["request_id"]
        assert time.monotonic() < deadline, "the model group did not recover"
        time.sleep(0.5)
    print(f"{actor_id[:8]} killed: healthy again after {time.monotonic() - started:.1f}s")
    return request_ids


def test_server_errors_carry_a_request_id_and_no_internals(http, stub):
    stub, _ = stub
    status = http.get("/v1/status", headers=bearer(KEY)).json()
    actor_ids = [status["coordinator"], *status["workers"].values(), status["replica_actor"]]
    node_ip = ray.util.get_node_ip_address()

    # A model worker crashes mid-request, then the coordinator does (of the group serving by
    # then: Serve may have replaced the replica and its group while the worker restarted).
    worker_errors = _crash_mid_request(http, stub, status["workers"]["target"], actor_ids, node_ip)
    status = http.get("/v1/status", headers=bearer(KEY)).json()
    actor_ids += [status["coordinator"], *status["workers"].values(), status["replica_actor"]]
    coordinator_errors = _crash_mid_request(http, stub, status["coordinator"], actor_ids, node_ip)
    assert worker_errors and coordinator_errors
    # The replica's log has the detail the clients did not get, under the same request id.
    assert _logged(worker_errors[0], ("Traceback", "ActorDiedError", "RayActorError", "died")), worker_errors[0]
    # Served again after both crashes.
    assert http.post("/v1/completions", json=BODY, headers=bearer(KEY)).status_code == 200
