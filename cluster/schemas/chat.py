"""The body of ``POST /v1/chat/completions``: the conversation (rendered through the model's
chat template), tools and tool choice, log-probabilities, the template's own arguments."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from actors.request_schema import MAX_TOP_LOGPROBS, InvalidRequestError, StructuredOutput, TopLogprobs
from actors.invalid_request import shortened
from cluster.schemas.chat_prompt import check_template_kwargs, render_chat_prompt
from cluster.schemas.fields import GenerationFields, pydantic_check, text_content
from cluster.schemas.structured import parse_tool_choice, parse_tools, tool_call_schema

ChatRole = Literal["system", "developer", "user", "assistant"]


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: ChatRole = Field(..., description="system | developer | user | assistant.")
    content: Any = Field(..., description="Message text, or a list of text parts ({\"type\": \"text\", \"text\": ...}).")
    name: str | None = Field(None, description="Optional author name (not rendered).")

    @field_validator("content")
    @classmethod
    def _text(cls, value: Any) -> str:
        return text_content(value)



def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value == allowed and type(value) is type(allowed) for allowed in neutral)



class ChatCompletionRequest(GenerationFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation, oldest first.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer OpenAI clients).")
    logprobs: bool | None = Field(None, description="Return the log-probability of each generated token.")
    top_logprobs: TopLogprobs | None = Field(
        None, description=f"With logprobs: this many most likely alternatives per token (0..{MAX_TOP_LOGPROBS})."
    )
    prompt_logprobs: TopLogprobs | None = Field(
        None, description="Each prompt token's log-probability with this many alternatives, as the response's "
        f"`prompt_logprobs` (vLLM's extension; 0..{MAX_TOP_LOGPROBS}; not with stream)."
    )
    tools: Any = Field(None, description='Functions the model may call: [{"type": "function", "function": {"name", '
                       '"description", "parameters"}}]. Calls are constrained only with tool_choice "required" or named.')
    tool_choice: Any = Field(None, description='"none" / "auto" (plain text, as without tools), "required" (one call '
                             'of one of the tools) or {"type": "function", "function": {"name"}} (a call of that one).')
    functions: Any = Field(None, description="Function calling is not supported: only null or [] is accepted.")
    function_call: Any = Field(None, description='Only null or "none" is accepted.')
    parallel_tool_calls: bool | None = Field(None, description="Accepted; meaningless without tools.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables of the model's chat template (vLLM's extension), e.g. {\"enable_thinking\": false}."
    )
    add_generation_prompt: bool = Field(
        True, description="Open the assistant's turn after the conversation (the chat template's own argument; vLLM's)."
    )
    continue_final_message: bool = Field(
        False, description="Leave the last (assistant) message open so the output continues it; needs "
        "add_generation_prompt false (vLLM's extension)."
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else pydantic_check(check_template_kwargs, value)

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: Any) -> None:
        if value is not None and value != []:
            raise ValueError("the legacy functions field is not supported; use tools")
        return None

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> None:
        if value is not None and not _neutral(value, ("none",)):
            raise ValueError('the legacy function_call field is not supported; use tool_choice')
        return None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: Any) -> dict[str, dict] | None:
        return None if value is None else parse_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> str | None:
        return None if value is None else parse_tool_choice(value)

    def tool_call(self) -> str | None:
        """``"required"``, the named function, or None (no constrained call: plain text)."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        if not self.tools:
            raise InvalidRequestError("tool_choice", f"{choice!r} needs tools")
        if choice != "required" and choice not in self.tools:
            raise InvalidRequestError("tool_choice.function.name", f"no tool named {shortened(choice)}")
        return choice

    def structured(self) -> StructuredOutput | None:
        tool_call = self.tool_call()
        if tool_call is None:
            return super().structured()
        if self.response_format not in (None, {"type": "text"}) or self.structured_outputs is not None:
            raise InvalidRequestError("tool_choice", "conflicts with response_format / structured_outputs; set only one")
        return StructuredOutput.checked("json_schema", tool_call_schema(self.tools, tool_call), "tools")

    def prompts(self) -> list[str | list[int]]:
        """The fallback rendering (:func:`cluster.schemas.chat_prompt.render_chat_prompt`); the ingress
        renders with the model's chat template instead (``to_generation_requests(chat_prompt=...)``)."""
        return [render_chat_prompt(self.messages)]

    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs

    def check_fields(self) -> None:
        super().check_fields()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        if self.prompt_logprobs is not None and self.streaming:  # as vLLM: a response-level field
            raise InvalidRequestError("prompt_logprobs", "not available with stream: true")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError("continue_final_message", "needs add_generation_prompt: false")
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError("continue_final_message", "the last message must be the assistant's")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError("max_completion_tokens", "conflicts with max_tokens; set only one")
        if self.tool_call() is not None and self.streaming:
            raise InvalidRequestError("stream", 'tool_choice "required" or named is answered whole; set stream: false')

    def sampling_overrides(self) -> dict[str, Any]:
        overrides = super().sampling_overrides()
        if self.max_completion_tokens is not None:  # a conflict with max_tokens: check_fields
            overrides["max_tokens"] = self.max_completion_tokens
        return overrides

