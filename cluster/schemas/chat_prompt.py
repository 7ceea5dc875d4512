"""The prompt of a chat request: the model's own chat template, or the plain fallback.

With a tokenizer that has a chat template (``tokenizer.chat_template``; the embedded family's
is in its ``tokenizer_config.json``), the conversation is rendered and tokenized by
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)``
— the token ids the model's authors specify, special tokens included, never tokenized a second
time — where ``kwargs`` are the request's ``chat_template_kwargs`` (template variables such as
``enable_thinking``, as vLLM accepts them). A tokenizer without a template falls back to
:func:`render_chat_prompt`: ``"<role>: <content>\\n"`` per message, then ``"assistant:"``
(a text prompt the coordinator tokenizes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from actors.request_schema import InvalidRequestError

#: ``apply_chat_template``'s own arguments: a request's ``chat_template_kwargs`` may not set them.
RESERVED_TEMPLATE_KWARGS: frozenset[str] = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
#: Longest message of a failing template shown to the client.
MAX_TEMPLATE_ERROR_CHARS = 200

#: Roles as the fallback renders them (newer OpenAI clients send ``developer`` for ``system``).
_FALLBACK_ROLES = {"developer": "system"}


def render_chat_prompt(messages: Sequence[Any], add_generation_prompt: bool = True,
                       continue_final_message: bool = False) -> str:
    """The fallback chat format: ``"<role>: <content>\\n"`` per message, then ``"assistant:"``
    (unless ``add_generation_prompt`` is false); ``developer`` messages are rendered as ``system``.
    ``continue_final_message``: the last message is left open (no newline after it), so the
    output continues it.

    Example: ``[{"role": "user", "content": "hi"}]`` becomes ``"user: hi\\nassistant:"``.
    """
    text = "".join(f"{_FALLBACK_ROLES.get(m.role, m.role)}: {m.content}\n" for m in messages)
    if continue_final_message:
        return text[:-1]
    return text + "assistant:" if add_generation_prompt else text


def check_template_kwargs(field: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs``: template variables by name, none of them an argument of
    ``apply_chat_template`` itself."""
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(field, f"{reserved} are set by the server, not by the template's variables")
    return dict(kwargs)


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer: Any, messages: Sequence[Any], template_kwargs: Mapping[str, Any] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str | list[int]:
    """The prompt of ``messages`` (:class:`cluster.schemas.ChatMessage`): token ids from the
    tokenizer's chat template, or the fallback text without one (see the module docstring).
    ``add_generation_prompt`` / ``continue_final_message``: the template's own arguments (the
    assistant's turn opened after the conversation / the last message left open to be continued;
    not both, checked with the request's fields)."""
    if not has_chat_template(tokenizer):
        return render_chat_prompt(messages, add_generation_prompt, continue_final_message)
    conversation = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})} for m in messages]
    try:
        encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message, tokenize=True,
                                                return_dict=True, **dict(template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - a template refusing the conversation is the client's error
        field = "chat_template_kwargs" if template_kwargs else "messages"
        detail = str(error)[:MAX_TEMPLATE_ERROR_CHARS]
        raise InvalidRequestError(field, f"the model's chat template failed: {type(error).__name__}: {detail}") from None
    return [int(token) for token in encoded["input_ids"]]


__all__ = ["RESERVED_TEMPLATE_KWARGS", "chat_prompt", "check_template_kwargs", "has_chat_template", "render_chat_prompt"]
