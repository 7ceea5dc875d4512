"""The model group's tokenizer as an ingress replica uses it: the token texts of
log-probabilities, the chat template's prompt and the echoed text of token-id prompts (the
coordinator tokenizes everything else). Loaded on first use, off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.request_schema import InvalidRequestError
from actors.tokenizer import load_tokenizer
from cluster.schemas.chat_prompt import chat_prompt
from cluster.schemas.to_generation import ChoiceSpec
from cluster.responses import TokenTexts
from cluster.schemas import ChatCompletionRequest, CompletionRequest


class ReplicaTokenizer:
    """The tokenizer at ``path`` (None: the group has none; chat prompts use the fallback
    rendering), loaded once."""

    def __init__(self, path: str | None):
        self.path = path
        self._tokenizer: Any = None
        self._texts: TokenTexts | None = None

    def _load(self) -> Any:
        return load_tokenizer(self.path)

    async def texts(self) -> tuple[Any, TokenTexts]:
        """The tokenizer and its :class:`TokenTexts` (loaded once, off the event loop)."""
        if self._texts is None:
            tokenizer = await asyncio.to_thread(self._load)
            self._tokenizer, self._texts = tokenizer, TokenTexts.from_tokenizer(tokenizer)
        return self._tokenizer, self._texts

    async def chat_prompt(self, body: ChatCompletionRequest) -> str | list[int]:
        """The conversation's prompt through the model's chat template (:mod:`cluster.schemas.chat_prompt`)."""
        tokenizer = (await self.texts())[0] if self.path is not None else None
        return await asyncio.to_thread(chat_prompt, tokenizer, body.messages, body.chat_template_kwargs,
                                       body.add_generation_prompt, body.continue_final_message)

    async def echo_prefixes(self, body: CompletionRequest | ChatCompletionRequest, specs: list[ChoiceSpec]) -> list[str]:
        """Each choice's echoed prompt text (``echo``; token-id prompts are decoded), else ""."""
        if not getattr(body, "echo", False):
            return ["" for _ in specs]
        if all(isinstance(spec.prompt, str) for spec in specs):
            return [spec.prompt for spec in specs]
        tokenizer, _ = await self.texts()

        def decode() -> list[str]:
            return [spec.prompt if isinstance(spec.prompt, str) else tokenizer.decode(spec.prompt) for spec in specs]

        try:
            return await asyncio.to_thread(decode)
        except Exception as error:  # noqa: BLE001 - ids the tokenizer cannot decode are the client's error
            raise InvalidRequestError("prompt", f"the token ids cannot be decoded for echo ({type(error).__name__})") from None
