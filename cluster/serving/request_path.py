"""What both protocols of one ingress replica use to take a request in: :class:`RequestPath`.

The HTTP routes (:class:`cluster.serving.ingress.SpecServeIngress`) and the gRPC methods
(:class:`cluster.serving.grpc_ingress.GrpcMethods`) admit a request the same way: the API key, a
request id, the served model's name, the deployment's sampling defaults and limits, the
replica's tokenizer and its model group's coordinator. The replica builds one RequestPath and
hands it to the gRPC methods as their constructor argument, so neither protocol reads the
other's private members.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from actors.invalid_request import InvalidRequestError
from cluster.serving.errors import ModelNotFound
from cluster.serving.replica_tokenizer import ReplicaTokenizer

logger = logging.getLogger(__name__)

#: Longest model name quoted back in a "not served here" error.
MAX_SHOWN_MODEL_CHARS = 64


@dataclass(frozen=True)
class RequestPath:
    """One replica's request path, shared by its HTTP routes and gRPC methods.

    ``api_key``: the key every call but ``GET /health`` must present (None: open);
    ``model_name``: the served model id; ``coordinator``: the model group's coordinator handle;
    ``tokens``: the replica's tokenizer (chat prompts, log-probability texts);
    ``max_prompt_chars``: ``limits.max_prompt_chars``; ``max_choices``: choices (prompts x
    ``n``) a request may ask for; ``sampling_defaults``: the deployment's values of unset
    sampling fields."""

    api_key: str | None
    model_name: str
    coordinator: Any
    tokens: ReplicaTokenizer
    max_prompt_chars: int
    max_choices: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def new_request_id(prefix: str, client_id: str | None = None) -> str:
        """The client's own id when it sent one, else ``<prefix>-<random hex>``."""
        return client_id or f"{prefix}-{uuid.uuid4().hex}"

    def check_model(self, model: str | None) -> None:
        """Raise :class:`cluster.serving.errors.ModelNotFound` when ``model`` is set and is not
        the served model."""
        if model and model != self.model_name:
            limit = MAX_SHOWN_MODEL_CHARS
            shown = model if len(model) <= limit else model[:limit - 3] + "..."
            raise ModelNotFound(f"model {shown!r} is not served here; served model: {self.model_name!r}")

    def count_if_invalid(self, error: BaseException) -> None:
        """Count a request this replica refused as invalid (400 / INVALID_ARGUMENT) before it
        reached the coordinator, in the group's ``specserve_requests{status="invalid"}``
        (a fire-and-forget call; bad requests are rare and cheap to report)."""
        if not isinstance(error, InvalidRequestError):
            return
        try:
            self.coordinator.count_invalid.remote()
        except Exception as failure:  # noqa: BLE001 - metrics never fail a request
            logger.debug("could not count an invalid request: %s", failure)
