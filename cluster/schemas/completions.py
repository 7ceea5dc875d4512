"""The body of ``POST /v1/completions``: one prompt or a list of them (text or token ids),
``echo``, log-probabilities of the output and of the prompt."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from actors.request_schema import MAX_TOP_LOGPROBS, InvalidRequestError, TopLogprobs
from actors.invalid_request import check_value
from cluster.schemas.fields import MAX_CHOICES, SampleCount, GenerationFields, pydantic_check


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _check_token_ids(ids: list[int], which: str = "") -> None:
    if not ids:  # their values: actors.request_schema.GenerationRequest.prompt_ids
        raise ValueError(f"{which}must not be empty")


class CompletionRequest(GenerationFields):
    """Body of ``POST /v1/completions``."""

    prompt: Any = Field(
        ..., description="A prompt (non-empty string or list of token ids) or a list of them (strings or token-id lists)."
    )
    echo: bool | None = Field(
        None, description="Prepend the prompt's text to each choice's text (with logprobs: and the prompt tokens' "
        "log-probabilities to its logprobs, the first one null)."
    )
    suffix: str | None = Field(None, description="Text after the completion (insertion): only null is accepted.")
    best_of: SampleCount | None = Field(None, description="Samples to draw per prompt: only n (or null) is accepted.")
    logprobs: Any = Field(
        None, description=f"Log-probabilities of each generated token with this many alternatives (0..{MAX_TOP_LOGPROBS})."
    )
    prompt_logprobs: TopLogprobs | None = Field(
        None, description="Each prompt token's log-probability with this many alternatives, as each choice's "
        f"`prompt_logprobs` (vLLM's extension; 0..{MAX_TOP_LOGPROBS})."
    )

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if isinstance(value, list) and value:
            if _is_token_ids(value):
                _check_token_ids(value)
                return value
            if len(value) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts (got {len(value)})")
            if all(isinstance(item, str) for item in value):
                for index, item in enumerate(value):
                    if not item:
                        raise ValueError(f"prompt {index} must not be empty")
                return value
            if all(_is_token_ids(item) for item in value):
                for index, item in enumerate(value):
                    _check_token_ids(item, f"prompt {index}: ")
                return value
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("not supported by this server (no insertion); send null or leave it out")
        return None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> int | None:
        """An integer (OpenAI's), or false / null for none."""
        if value is None or value is False:
            return None
        return pydantic_check(check_value, TopLogprobs, value)

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token (``echo`` with ``logprobs``), or None."""
        return self.logprobs if self.echo else None

    def prompt_logprobs_count(self) -> int | None:
        wanted = [count for count in (self.echo_logprobs, self.prompt_logprobs) if count is not None]
        return max(wanted) if wanted else None

    def check_fields(self) -> None:
        super().check_fields()
        if self.best_of is not None and self.best_of != self.samples:
            if self.best_of < self.samples:
                raise InvalidRequestError("best_of", f"must be at least n ({self.samples}), got {self.best_of}")
            raise InvalidRequestError(
                "best_of", f"best_of > n is not supported: every sample is returned (got best_of {self.best_of}, "
                f"n {self.samples}); set it to n or leave it out"
            )

