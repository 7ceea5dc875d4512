"""actors/invalid_request.py: a pydantic validation error becomes an InvalidRequestError naming the
field as the client names it, with a message that says the bound and the value sent (no Ray)."""

from __future__ import annotations

import math
import pickle

import pytest

from actors.request_schema import GenerationRequest, InvalidRequestError, TopLogprobs
from actors.invalid_request import check_value
from cluster.schemas import ChatCompletionRequest, CompletionRequest, parse_body


def _refused(**fields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        GenerationRequest.parse({"request_id": "r", "prompt": "x", **fields}, max_prompt_chars=8)
    return caught.value


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"sampling": {"temperature": math.inf}}, "sampling.temperature", "must be a finite number (got Infinity)"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p", "must be <= 1 (got 1.5)"),
        ({"sampling": {"seed": -1}}, "sampling.seed", "must be >= 0 (got -1)"),
        ({"sampling": {"stop": ["a"] * 9}}, "sampling.stop", "at most 8 items (got 9)"),
        ({"sampling": {"stop": ["ok", ""]}}, "sampling.stop", "must not be empty"),  # an item: the list is named
        ({"sampling": {"logit_bias": {-1: 1.0}}}, "sampling.logit_bias", "must be >= 0 (got -1)"),  # a key
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens", "0 only scores the prompt"),  # a model validator
        ({"speculation": {"weights": [0.5, 0.6]}}, "speculation.weights", "weights must sum to 1"),
        ({"speculation": {"members": ["m" * 129]}}, "speculation.members", "at most 128 characters (got 129)"),
        ({"speculation": {"nope": 1}}, "speculation.nope", "unknown field"),
        ({"prompt": "123456789"}, "prompt", "at most 8 characters (got 9)"),  # the validation context's limit
    ],
    ids=["non-finite", "upper-bound", "lower-bound", "list-size", "list-item", "dict-key", "model-validator",
         "field-validator", "string-item", "unknown-field", "context-limit"],
)
def test_the_field_and_the_message(fields, field, message):
    error = _refused(**fields)
    assert error.field == field and error.message.startswith(message), error


def test_nested_models_keep_their_index_and_string_keys_stay():
    with pytest.raises(InvalidRequestError) as caught:
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": 3}]}')
    assert caught.value.field == "messages.1.content"
    with pytest.raises(InvalidRequestError) as caught:
        parse_body(CompletionRequest, b'{"prompt": "x", "metadata": {"k": 1}}')
    assert caught.value.field == "metadata.k"
    with pytest.raises(InvalidRequestError) as caught:
        parse_body(CompletionRequest, b'{"prompt": "x",')
    assert caught.value.field == "body" and caught.value.message.startswith("invalid JSON")


def test_a_long_value_is_quoted_short():
    error = _refused(speculation={"strategy": "s" * 10_000})
    assert error.field == "speculation.strategy" and len(error.message) < 200


def test_check_value_uses_the_same_constraints_strictly():
    assert check_value("sampling.top_logprobs", TopLogprobs, 20) == 20
    with pytest.raises(InvalidRequestError) as caught:
        check_value("sampling.top_logprobs", TopLogprobs, 21)
    assert (caught.value.field, caught.value.message) == ("sampling.top_logprobs", "must be <= 20 (got 21)")
    with pytest.raises(InvalidRequestError):
        check_value("sampling.top_logprobs", TopLogprobs, True)  # strict: a bool is not a count


def test_the_error_pickles_for_ray():
    error = pickle.loads(pickle.dumps(InvalidRequestError("sampling.seed", "must be >= 0")))
    assert (error.field, error.message, str(error)) == ("sampling.seed", "must be >= 0", "sampling.seed: must be >= 0")
