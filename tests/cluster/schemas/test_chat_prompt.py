"""Chat prompts (cluster.schemas.chat_prompt): the model's own template, the fallback without one."""

from __future__ import annotations

import pytest

from actors.request_schema import InvalidRequestError
from cluster.schemas.chat_prompt import chat_prompt, check_template_kwargs, render_chat_prompt
from cluster.schemas import ChatMessage
from models import EMBEDDED_MODELS, EMBEDDED_ROOT

MESSAGES = [ChatMessage(role="developer", content="S"), ChatMessage(role="user", content="def f():")]


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EMBEDDED_ROOT / "target", local_files_only=True)


def test_the_embedded_template_gives_apply_chat_template_tokens(embedded_tokenizer):
    conversation = [{"role": m.role, "content": m.content} for m in MESSAGES]
    expected = embedded_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"]
    assert chat_prompt(embedded_tokenizer, MESSAGES) == list(expected)
    # The family's template writes what the fallback writes, so its models see one format.
    assert embedded_tokenizer.decode(expected) == render_chat_prompt(MESSAGES) == "system: S\nuser: def f():\nassistant:"


def test_every_embedded_model_shares_the_template(embedded_tokenizer):
    from transformers import AutoTokenizer

    for name in EMBEDDED_MODELS:
        other = AutoTokenizer.from_pretrained(EMBEDDED_ROOT / name, local_files_only=True)
        assert other.chat_template == embedded_tokenizer.chat_template


class _NoTemplate:
    chat_template = None


def test_a_tokenizer_without_template_gets_the_fallback_text():
    assert chat_prompt(_NoTemplate(), MESSAGES) == "system: S\nuser: def f():\nassistant:"
    assert chat_prompt(None, MESSAGES) == render_chat_prompt(MESSAGES)


def test_a_failing_template_or_reserved_kwargs_are_the_clients_error(embedded_tokenizer):
    class Failing:
        chat_template = "x"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("roles must alternate")

    with pytest.raises(InvalidRequestError) as caught:
        chat_prompt(Failing(), MESSAGES)
    assert caught.value.field == "messages" and "roles must alternate" in caught.value.message
    with pytest.raises(InvalidRequestError) as caught:
        check_template_kwargs("chat_template_kwargs", {"add_generation_prompt": False})
    assert caught.value.field == "chat_template_kwargs"
    assert check_template_kwargs("chat_template_kwargs", {"enable_thinking": False}) == {"enable_thinking": False}
