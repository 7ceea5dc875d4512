"""Serving fixtures: ONE specserve Serve application per test session, on the shared Ray
instance of ``tests/conftest.py``.

The application is deployed the way users deploy it: a Ray Serve config document (the
``deploy/*.yaml`` format, ``import_path: cluster.app:build_app``) applied by
``cluster.serving.serve_command`` (what ``specserve serve`` runs), with the HTTP and gRPC proxies on
free 127.0.0.1 ports and the real Coordinator and ModelWorkers over the tiny checkpoints.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from cluster.config import API_KEY_ENV
from cluster.serving.local_ports import free_local_ports

APP_NAME = "specserve"

# The session application serves without an API key (tests that need one deploy their own
# application with `security.api_key`); a key in the developer's environment would otherwise
# reach the replicas through the Ray processes started by the tests.
os.environ.pop(API_KEY_ENV, None)


@dataclass(frozen=True)
class ServeEndpoints:
    """Where the session's Serve application answers, and the config it was deployed from."""

    http_url: str
    grpc_target: str
    model: str
    document: dict[str, Any] = field(repr=False)
    addresses: Any = field(repr=False)


def serve_document(applications: list[dict[str, Any]]) -> dict[str, Any]:
    """A Ray Serve config document (the deploy/*.yaml format) with these applications."""
    return {"proxy_location": "HeadOnly", "applications": copy.deepcopy(applications)}


def specserve_application(name: str, route_prefix: str, args: dict, num_replicas: int = 1) -> dict[str, Any]:
    """One specserve application entry of a Serve config."""
    return {
        "name": name,
        "route_prefix": route_prefix,
        "import_path": "cluster.app:build_app",
        "args": copy.deepcopy(args),
        "deployments": [{"name": "SpecServeIngress", "num_replicas": num_replicas}],
    }


#: Context of the tiny target in the session app (its RoPE has no length limit): long enough
#: that a target-only (`ar`) request can run for seconds, which the disconnect test needs.
LONG_TARGET_CONTEXT = 2048


@pytest.fixture(scope="session")
def serve_app(ray_session, tiny_app_args) -> ServeEndpoints:
    """The specserve application over the tiny checkpoints, deployed once per session."""
    from ray import serve

    from cluster.serving.serve_command import deploy, resolve_addresses, with_addresses

    args = copy.deepcopy(tiny_app_args)
    args["models"]["target"]["max_context"] = LONG_TARGET_CONTEXT
    document = serve_document([specserve_application(APP_NAME, "/", args)])
    http_port, grpc_port = free_local_ports(2)
    addresses = resolve_addresses(document, host="127.0.0.1", http_port=http_port, grpc_port=grpc_port)
    document = with_addresses(document, addresses)
    deploy("<tests>", addresses, document)
    yield ServeEndpoints(
        http_url=addresses.http_url,
        grpc_target=addresses.grpc_target,
        model=APP_NAME,
        document=document,
        addresses=addresses,
    )
    serve.shutdown()


class GreedyReference:
    """The tiny target model run directly with transformers (no Ray, no server): its greedy
    continuation is what every lossless strategy must return at temperature 0."""

    def __init__(self, checkpoint_dir):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def continuation(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy (argmax) continuation of ``max_tokens`` tokens, past EOS, with a KV cache."""
        torch = self._torch
        generated: list[int] = []
        with torch.inference_mode():
            output = self.model(torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(max_tokens):
                next_id = int(output.logits[0, -1].argmax())  # [V] -> token
                generated.append(next_id)
                output = self.model(
                    torch.tensor([[next_id]]), past_key_values=output.past_key_values, use_cache=True
                )
        return generated


@pytest.fixture(scope="session")
def greedy_reference(tiny_checkpoints) -> GreedyReference:
    import torch

    torch.set_num_threads(1)
    return GreedyReference(tiny_checkpoints["target"])
