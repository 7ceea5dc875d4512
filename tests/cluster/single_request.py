"""The coordinator request of a one-choice HTTP body or gRPC request (tests build them one at
a time; the server builds every choice with ``to_generation_requests``)."""

from __future__ import annotations

from typing import Any

from cluster import grpc_service
from cluster.config import DEFAULT_MAX_PROMPT_CHARS
from cluster.schemas.to_generation import to_generation_requests


def http_generation_request(body: Any, request_id: str, sampling_defaults: dict[str, Any],
                            max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS):
    """The coordinator request of a body with a single choice (one prompt, n = 1)."""
    _, requests = to_generation_requests(body, request_id, sampling_defaults, max_prompt_chars)
    assert len(requests) == 1, f"the body has {len(requests)} choices"
    return requests[0]


def grpc_generation_request(request: Any, request_id: str, sampling_defaults: dict[str, Any],
                            max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS):
    """The coordinator request of a gRPC request's first sample."""
    return grpc_service.to_generation_requests(request, request_id, sampling_defaults, max_prompt_chars)[1][0]
