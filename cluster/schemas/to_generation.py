"""HTTP bodies -> :class:`~actors.request_schema.GenerationRequest` s, one per choice.

A completions ``prompt`` may be one prompt (a string or a list of token ids) or a list of them
(strings or token-id lists); each prompt gets ``n`` independent samples, and the choice of
sample ``i`` of prompt ``p`` has ``index = p * n + i`` (OpenAI's and vLLM's order). Every
choice is its own coordinator request (:class:`ChoiceSpec`, request id ``<id>-<index>`` when
there is more than one); with a ``seed``, sample ``i`` of every prompt uses ``seed + i``. A
chat body's one prompt is its conversation through the model's chat template
(:mod:`cluster.schemas.chat_prompt`). gRPC (:mod:`cluster.grpc_service`) builds its choices with the
same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.request_schema import (
    GenerationRequest,
    InvalidRequestError,
    SpeculationParams,
)
from cluster.config import DEFAULT_MAX_PROMPT_CHARS
from cluster.schemas import (
    HTTP_CHAT_FIELD_NAMES,
    HTTP_FIELD_NAMES,
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    check_sample_seeds,
)

def build_generation_request(
    *,
    request_id: str,
    prompt: str | list[int],
    sampling_defaults: dict[str, Any],
    sampling_overrides: dict[str, Any],
    speculation: SpeculationParams | dict[str, Any] | None,
    field_names: dict[str, str] | None = None,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    prediction: str | list[int] | None = None,
) -> GenerationRequest:
    """Merge deployment sampling defaults with the request's overrides into a GenerationRequest,
    every field checked by its constraints (:meth:`actors.request_schema.GenerationRequest.parse`).

    Raises :class:`InvalidRequestError` (field renamed through ``field_names``) when the merged
    request is invalid.
    """
    sampling = {**sampling_defaults, **sampling_overrides}
    if isinstance(speculation, SpeculationParams):
        speculation = speculation.model_dump(exclude_unset=True)
    fields: dict[str, Any] = {
        "request_id": request_id,
        "sampling": sampling,
        "speculation": speculation or {},
    }
    if prediction is not None:
        fields["prediction"] = prediction
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    else:
        fields["prompt_ids"] = prompt
    try:
        return GenerationRequest.parse(fields, max_prompt_chars)
    except InvalidRequestError as error:
        field = (field_names or {}).get(error.field, error.field)
        if field == error.field:
            raise
        raise InvalidRequestError(field, error.message) from None


@dataclass(frozen=True)
class ChoiceSpec:
    """One choice of a request: sample ``sample_index`` of prompt ``prompt_index``."""

    index: int  # prompt_index * n + sample_index
    prompt_index: int
    sample_index: int
    prompt: str | list[int]
    request_id: str  # the coordinator request's id


def choice_request_id(request_id: str, index: int, choices: int) -> str:
    """The coordinator request id of choice ``index``: the request's own id when it has one
    choice, else ``<id>-<index>``."""
    return request_id if choices == 1 else f"{request_id}-{index}"


def choice_specs(request_id: str, prompts: Sequence[str | list[int]], n: int) -> list[ChoiceSpec]:
    """The choices of ``prompts`` x ``n`` samples, in index order (``prompt_index * n + sample_index``)."""
    total = len(prompts) * n
    return [
        ChoiceSpec(
            index=p * n + i,
            prompt_index=p,
            sample_index=i,
            prompt=prompt,
            request_id=choice_request_id(request_id, p * n + i, total),
        )
        for p, prompt in enumerate(prompts)
        for i in range(n)
    ]


def sample_request(first: GenerationRequest, spec: ChoiceSpec) -> GenerationRequest:
    """The coordinator request of ``spec``, from ``first`` (sample 0 of the same prompt, already
    validated): its own request id, and seed ``first``'s seed + ``spec.sample_index`` (no seed:
    each sample's is picked by the coordinator). Seeds were checked with
    :func:`check_sample_seeds`."""
    if spec.sample_index == 0:
        return first.model_copy(update={"request_id": spec.request_id})
    sampling = first.sampling
    if sampling.seed is not None:
        sampling = sampling.model_copy(update={"seed": sampling.seed + spec.sample_index})
    return first.model_copy(update={"request_id": spec.request_id, "sampling": sampling})


def check_choices(prompts: int, n: int, max_choices: int, prompt_field: str, n_field: str) -> None:
    """``prompts`` x ``n`` choices must not exceed ``max_choices`` (the deployment's
    ``limits.max_concurrent_requests``, at most :data:`MAX_CHOICES`): every choice of a request
    is decoded at once."""
    if prompts * n > max_choices:
        field = n_field if n > 1 else prompt_field
        raise InvalidRequestError(
            field, f"{prompts} prompt(s) x n = {n} is {prompts * n} choices; this deployment serves at most "
            f"{max_choices} per request (limits.max_concurrent_requests)"
        )


def to_generation_requests(
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    sampling_defaults: dict[str, Any],
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    max_choices: int = MAX_CHOICES,
    chat_prompt: str | list[int] | None = None,
) -> tuple[list[ChoiceSpec], list[GenerationRequest]]:
    """The choices of an HTTP body and their coordinator requests, every one validated; at most
    ``max_choices`` of them. A chat body's prompt is ``chat_prompt`` (:func:`cluster.schemas.chat_prompt.chat_prompt`;
    None: the fallback rendering)."""
    chat = isinstance(body, ChatCompletionRequest)
    prompts = [chat_prompt] if chat and chat_prompt is not None else body.prompts()
    check_choices(len(prompts), body.samples, max_choices, "prompt", "n")
    overrides = body.sampling_overrides()
    specs = choice_specs(request_id, prompts, body.samples)
    field_names = HTTP_CHAT_FIELD_NAMES if chat else HTTP_FIELD_NAMES
    requests: list[GenerationRequest] = []
    first: GenerationRequest | None = None  # sample 0 of the current prompt
    for spec in specs:
        if spec.sample_index == 0:
            try:
                first = build_generation_request(
                    request_id=spec.request_id,
                    prompt=spec.prompt,
                    sampling_defaults=sampling_defaults,
                    sampling_overrides=overrides,
                    speculation=body.speculation,
                    field_names=field_names,
                    max_prompt_chars=max_prompt_chars,
                    prediction=body.predicted_text,
                )
            except InvalidRequestError as error:
                if len(prompts) > 1 and error.field == "prompt":
                    raise InvalidRequestError("prompt", f"prompt {spec.prompt_index}: {error.message}") from None
                raise
            check_sample_seeds("seed", first.sampling.seed, body.samples)
        assert first is not None
        requests.append(sample_request(first, spec))
    return specs, requests


__all__ = [
    "ChoiceSpec",
    "build_generation_request",
    "check_choices",
    "choice_request_id",
    "choice_specs",
    "sample_request",
    "to_generation_requests",
]
