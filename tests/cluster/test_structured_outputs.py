"""Structured outputs served: JSON schemas at 16 concurrent clients under ar, sd and se, the
OpenAI client's ``parse`` helper with a pydantic model, LangChain's ``with_structured_output``
(json_schema method), and bad constraints answered 400 naming the field before any model work.

Every output of a JSON-schema request must parse and validate (``jsonschema``): the grammar mask
makes anything else impossible, whatever the (random, tiny) models prefer.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tags"],
    "additionalProperties": False,
}
CLIENTS = 16
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app.http_url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.mark.parametrize("strategy", ["ar", "sd", "multi_draft", "ensemble", "se"])
def test_every_json_schema_output_validates_at_16_clients(client, serve_app, strategy):
    def one(index: int) -> tuple[str, str]:
        response = client.chat.completions.create(
            model=serve_app.model, messages=MESSAGES, max_tokens=96, temperature=1.0, seed=index,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
            extra_body={"speculation": {"strategy": strategy}},
        )
        return response.choices[0].message.content, response.choices[0].finish_reason

    with ThreadPoolExecutor(CLIENTS) as pool:
        outputs = list(pool.map(one, range(CLIENTS)))
    for text, finish_reason in outputs:
        assert finish_reason == "stop", (text, finish_reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in outputs}) > 1  # sampled, not one forced string


def test_choice_and_regex_constrain_completions(client, serve_app):
    choice = client.completions.create(model=serve_app.model, prompt="Answer:", max_tokens=16, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].text in ("yes", "no", "maybe")
    digits = client.completions.create(model=serve_app.model, prompt="Number:", max_tokens=16, seed=4,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{2,4}"},
                                                   "speculation": {"strategy": "sd", "method": "greedy_block"}})
    text = digits.choices[0].text
    assert text.isdigit() and 2 <= len(text) <= 4, text


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    member: bool


def test_openai_parse_helper_with_a_pydantic_model(client, serve_app):
    completion = client.chat.completions.parse(model=serve_app.model, messages=MESSAGES, max_tokens=64, seed=5,
                                               response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_langchain_with_structured_output_json_schema(serve_app):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model=serve_app.model, base_url=f"{serve_app.http_url}/v1", api_key="unused", max_tokens=64,
                       seed=6, max_retries=0, timeout=180)
    person = model.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person) and len(person.name) <= 6


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"format": "nope",
                                                                                       "type": "string"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs.grammar"),
])
def test_bad_constraints_are_400_naming_the_field(client, serve_app, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=4, **extra)
    assert caught.value.body["param"] == param


def test_grpc_structured_outputs(serve_app):
    import grpc

    from protos import specserve_pb2, specserve_pb2_grpc

    with grpc.insecure_channel(serve_app.grpc_target) as channel:
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        metadata = (("application", serve_app.model),)
        request = specserve_pb2.GenerateRequest(prompt="Person:", sampling=specserve_pb2.SamplingOptions(
            max_tokens=96, seed=7, structured_outputs=specserve_pb2.StructuredOutputs(json=json.dumps(SCHEMA))))
        jsonschema.validate(json.loads(stub.Generate(request, metadata=metadata).text), SCHEMA)
        bad = specserve_pb2.GenerateRequest(prompt="Person:", sampling=specserve_pb2.SamplingOptions(
            structured_outputs=specserve_pb2.StructuredOutputs(choice=[])))
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(bad, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured_outputs" in caught.value.details()


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
           "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": TIME}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "time"}}])
def test_tool_choice_required_or_named_returns_tool_calls(client, serve_app, tool_choice):
    response = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=64, seed=8,
                                              tools=TOOLS, tool_choice=tool_choice)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schemas = {"weather": WEATHER, "time": TIME}
    assert call.function.name in (schemas if tool_choice == "required" else ["time"])
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_auto_is_plain_text(client, serve_app):
    response = client.chat.completions.create(model=serve_app.model, messages=MESSAGES, max_tokens=4, seed=9,
                                              tools=TOOLS, tool_choice="auto")
    assert response.choices[0].message.tool_calls is None and response.choices[0].finish_reason == "length"


CHOICE_REGEX = "(yes|no|maybe)"
CHI_SQUARE_SAMPLES = 160


def _masked_string_law(greedy_reference, checkpoint: str, prompt_ids: list[int]) -> dict[str, float]:
    """The exact law of the output string of ``CHOICE_REGEX`` under the tiny target (temperature
    1): every token path the grammar allows, each row masked and renormalised, summed by text."""
    import torch

    from verifiers.grammar import allowed_tokens, compile_constraint

    constraint = compile_constraint("regex", CHOICE_REGEX, checkpoint, request="chi-square-law")
    tokenizer = greedy_reference.tokenizer
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    law: dict[str, float] = {}
    pending = [((), 1.0)]
    while pending:
        generated, prob = pending.pop()
        with torch.inference_mode():
            logits = greedy_reference.model(torch.tensor([prompt_ids + list(generated)])).logits[0, -1, :vocab]
        allowed = allowed_tokens(constraint, [generated], vocab)[0]  # [V]
        row = torch.softmax(logits.double().masked_fill(~allowed, float("-inf")), dim=-1)  # [V]
        for token in torch.nonzero(row > 0).flatten().tolist():
            if token == eos:
                text = tokenizer.decode(list(generated))
                law[text] = law.get(text, 0.0) + prob * float(row[token])
            else:
                pending.append((generated + (token,), prob * float(row[token])))
    return law


@pytest.mark.parametrize("strategy", ["sd"])
def test_served_regex_samples_the_masked_law(client, serve_app, greedy_reference, tiny_checkpoints, strategy):
    from tests.verifiers.tiny_models import chi_square_pvalue

    prompt_ids = greedy_reference.encode("answer = ")
    law = _masked_string_law(greedy_reference, str(tiny_checkpoints["target"]), prompt_ids)
    assert set(law) == {"yes", "no", "maybe"} and abs(sum(law.values()) - 1) < 1e-9

    def one(seed: int) -> str:
        return client.completions.create(
            model=serve_app.model, prompt=prompt_ids, max_tokens=8, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"regex": CHOICE_REGEX}, "speculation": {"strategy": strategy}},
        ).choices[0].text

    with ThreadPoolExecutor(CLIENTS) as pool:
        samples = list(pool.map(one, range(CHI_SQUARE_SAMPLES)))
    assert chi_square_pvalue(samples, law) > 1e-3, (law, {s: samples.count(s) for s in set(samples)})
