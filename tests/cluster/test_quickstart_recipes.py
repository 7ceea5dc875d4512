"""docs/quickstart.md's recipes, run as written against a served deployment (the session's Serve
application), so the page and the server cannot drift apart.

Each fenced ``python`` block whose first line is ``# recipe: <name>`` runs with the page's
``client`` (an ``openai.OpenAI`` whose HTTP exchanges are recorded) after the page's addresses are
swapped for the test server's; the ``curl`` body of the first request is posted too. Every
recorded exchange must answer 200 with the documented shape: an OpenAI completion or chat
completion (or their chunks) whose ``speculation`` names the strategy, rule and proposer the
request asked for, and a complete JSON document where a schema constrained a choice that
stopped. The two-GPU YAML block must be the application of ``deploy/two-gpu.example.yaml``.
"""

from __future__ import annotations

import json
import pathlib
import re

import httpx
import pytest
import yaml

from cluster.config.loading import parse_app_args, read_serve_config

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "quickstart.md"
DOC_HTTP = "http://127.0.0.1:8000"
DOC_GRPC = "127.0.0.1:9000"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RECIPE = re.compile(r"# recipe: ([\w-]+)\n")
CURL_BODY = re.compile(r"curl -s " + re.escape(DOC_HTTP) + r"(/\S+) .*?-d '(.*?)'", re.S)


def blocks(language: str) -> list[str]:
    """The page's fenced blocks of one language, in order."""
    return [body for lang, body in FENCE.findall(PAGE.read_text(encoding="utf-8")) if lang == language]


def recipes() -> dict[str, str]:
    """name -> code of every ``# recipe:`` python block."""
    found = {}
    for code in blocks("python"):
        match = RECIPE.match(code)
        if match is not None:
            assert match.group(1) not in found, f"two recipes named {match.group(1)}"
            found[match.group(1)] = code
    return found


class Recorder:
    """The HTTP exchanges of a client: each request's JSON body and its response, read in full."""

    def __init__(self):
        self.exchanges: list[tuple[httpx.Request, httpx.Response]] = []

    def response(self, response: httpx.Response) -> None:
        response.read()  # the client reads the cached body afterwards, streamed or not
        self.exchanges.append((response.request, response))


def sse_payloads(text: str) -> list[dict]:
    """The JSON payloads of a server-sent-event body (``[DONE]`` left out)."""
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-200:]
    return [json.loads(line) for line in lines[:-1]]


def check_speculation(asked: dict, stats: dict, default_strategy: str) -> None:
    """The response's statistics name the strategy, rule and proposer the request asked for."""
    assert stats["strategy"] == asked.get("strategy", default_strategy)
    for key in ("method", "proposer"):
        if key in asked:
            assert stats[key] == asked[key], (key, stats)
    assert stats["target_calls"] >= 1 and stats["block_efficiency"] > 0


def check_exchange(request: httpx.Request, response: httpx.Response, default_strategy: str) -> None:
    """200 and the documented shape of a completion or chat completion, streamed or not."""
    assert response.status_code == 200, response.text
    body = json.loads(request.content)
    asked = body.get("speculation", {})
    chat = request.url.path.endswith("/chat/completions")
    if body.get("stream"):
        payloads = sse_payloads(response.text)
        assert {p["object"] for p in payloads} == {"chat.completion.chunk" if chat else "text_completion"}
        last = [p for p in payloads if p["choices"] and p["choices"][0].get("finish_reason")][-1]
        check_speculation(asked, last["speculation"], default_strategy)
        return
    answer = response.json()
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    assert len(answer["choices"]) == body.get("n", 1)
    assert answer["usage"]["completion_tokens"] >= 1
    check_speculation(asked, answer["speculation"], default_strategy)
    for choice in answer["choices"]:
        text = choice["message"]["content"] if chat else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
        schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
        if schema is not None and choice["finish_reason"] == "stop":
            document = json.loads(text)  # a complete document: valid against the schema
            assert set(schema["required"]) <= set(document) <= set(schema["properties"])


def run_block(code: str, namespace: dict, serve_app) -> None:
    """Run a page block with the page's addresses pointing at the test server."""
    code = code.replace(DOC_HTTP, serve_app.http_url).replace(DOC_GRPC, serve_app.grpc_target)
    exec(compile(code, str(PAGE), "exec"), namespace)  # the page's own code, run as a reader would


def test_the_page_has_a_recipe_for_every_strategy():
    code = "\n".join(recipes().values())
    for strategy in ("ar", "sd", "multi_draft", "ensemble", "se"):
        assert f'"strategy": "{strategy}"' in code or f'strategy="{strategy}"' in code, strategy
    for method in ("token", "block", "greedy_block", "spectr"):
        assert f'"{method}"' in code, method
    assert '"proposer": "draft"' in code and '"json_schema"' in code


@pytest.mark.parametrize("name", sorted(recipes()))
def test_recipe_is_served_with_the_documented_shape(name, serve_app, tiny_app_args):
    from openai import OpenAI

    recorder = Recorder()
    http_client = httpx.Client(event_hooks={"response": [recorder.response]}, timeout=120.0)
    client = OpenAI(base_url=f"{serve_app.http_url}/v1", api_key="unused", http_client=http_client)
    namespace = {"client": client}
    with http_client:
        run_block(recipes()[name], namespace, serve_app)
    if name == "grpc":
        assert namespace["reply"].finished and namespace["reply"].finish_reason in ("stop", "length")
        return
    assert recorder.exchanges, f"recipe {name} sent no request"
    for request, response in recorder.exchanges:
        check_exchange(request, response, tiny_app_args["defaults"]["strategy"])


def test_first_request_curl_body_is_served(serve_app, tiny_app_args):
    sent = [CURL_BODY.search(code) for code in blocks("bash")]
    sent = [match for match in sent if match is not None]
    assert sent, "no curl request on the page"
    with httpx.Client(base_url=serve_app.http_url, timeout=120.0) as http:
        for path, body in (match.groups() for match in sent):
            response = http.post(path, json=json.loads(body))
            check_exchange(response.request, response, tiny_app_args["defaults"]["strategy"])


def test_two_gpu_yaml_block_is_the_example_files_application():
    (block,) = [code for code in blocks("yaml") if "Llama-3.1-8B" in code]
    applications = yaml.safe_load(block)
    assert applications == read_serve_config(REPO / "deploy" / "two-gpu.example.yaml")["applications"]
    parse_app_args(applications[0]["args"])  # valid args, as the file's


def test_recipe_blocks_are_found():
    # Negative control of the extraction: a marked block is a recipe, an unmarked one is not.
    text = "```python\n# recipe: a\nx = 1\n```\n\n```python\ny = 2\n```\n"
    found = [body for lang, body in FENCE.findall(text) if lang == "python" and RECIPE.match(body)]
    assert found == ["# recipe: a\nx = 1\n"]
