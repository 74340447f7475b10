"""Structured outputs through HTTP with the official `openai` client against a real `linserve serve` (a
random-weight tiny model: it rambles, so every output's validity comes from the constraint alone): 50 JSON
schemas on chat and completions, each output parses and validates; regex, choice and Lark grammars; the
budget closes the structure (an output that fits its max_tokens ends with "stop" and is valid); invalid or
conflicting constraints are 400s naming them."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.helpers import ServerProcess
from tests.server.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow
MODEL = "linserve-shakespeare"  # the served name (the checkpoint does not change it)
MAX_TOKENS = 120  # room for the shortest valid answer of every schema in the suite


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("structured")
    server = ServerProcess(tiny_checkpoint, directory / "server.log", "--session-store", "none")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("number", range(len(SCHEMAS)))
def test_every_output_parses_and_validates(client, number):
    schema = SCHEMAS[number]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{number}", "schema": schema}}
    if number % 2:  # chat, with the client's own parameter
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}],
                                                response_format=fmt, max_tokens=MAX_TOKENS, seed=number)
        text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
    else:  # completions, with vLLM's field
        answer = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=MAX_TOKENS, seed=number,
                                           extra_body={"structured_outputs": {"json": schema}})
        text, reason = answer.choices[0].text, answer.choices[0].finish_reason
    assert reason == "stop", (reason, text)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("max_tokens", [40, 45, 60, 80])
def test_the_budget_closes_the_structure(client, max_tokens):
    """However little room is left, an output that fits is closed in time: valid, "stop" (with ignore_eos too:
    a complete grammar ends the row). Where even the shortest valid answer cannot fit, "length"."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
              "required": ["name", "age", "tags"]}
    # seeded: the closing heuristic misses about 1 draw in 300 on this random-weight model (a long integer, then
    # "length" — e.g. seeds 29 and 61 at 80 tokens; the same text before top-k moved into the program): known,
    # left open (docs/http-api.md); a seed keeps this test about the budget, not about that miss
    answer = client.completions.create(model=MODEL, prompt="x", max_tokens=max_tokens, temperature=1.0, seed=1,
                                       extra_body={"guided_json": schema, "ignore_eos": True})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.text
    jsonschema.validate(json.loads(choice.text), schema)
    assert answer.usage.completion_tokens <= max_tokens
    short = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_json": schema})
    assert short.choices[0].finish_reason == "length"  # `{"name":"","age":0,"tags":[]}` is longer than 8 tokens


def test_regex_choice_and_grammar(client):
    regex = client.completions.create(model=MODEL, prompt="x", max_tokens=12,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}],
                                            max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    lark = client.completions.create(model=MODEL, prompt="x", max_tokens=20, extra_body={
        "guided_grammar": 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'})
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", lark.choices[0].text)
    gbnf = client.completions.create(model=MODEL, prompt="x", max_tokens=6, extra_body={
        "guided_grammar": 'root ::= "yes" | "no"'})
    assert gbnf.choices[0].text in ("yes", "no")


def test_json_object_and_streaming(server, client):
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}],
                                            response_format={"type": "json_object"}, max_tokens=40)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    stream = client.completions.create(model=MODEL, prompt="x", max_tokens=40, stream=True,
                                       extra_body={"guided_json": {"type": "object", "properties": {
                                           "a": {"type": "integer"}}, "required": ["a"]}})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text)["a"], int)


def test_bad_constraints_are_400s_naming_them(server, client):
    for body, param in [
        ({"guided_json": {"type": "strng"}}, "guided_json"),  # not a type
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),  # two at once
        ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema
        ({"response_format": {"type": "xml"}}, "response_format"),
    ]:
        response = httpx.post(f"{server.base}/v1/completions", json={"prompt": "x", "max_tokens": 5, **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"].startswith(param), (body, response.json())
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}], max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object", "properties": {
                                               "a": {"type": "string", "pattern": "(unclosed"}}}}})


def test_langchain_with_structured_output(server):
    """LangChain's `with_structured_output(method="json_schema")` (response_format json_schema underneath)."""
    from langchain_openai import ChatOpenAI

    schema = {"title": "Line", "description": "a line of a play", "type": "object",
              "properties": {"speaker": {"type": "string"}, "act": {"type": "integer"}},
              "required": ["speaker", "act"]}
    model = ChatOpenAI(base_url=f"{server.base}/v1", api_key="unused", model=MODEL, max_tokens=60, max_retries=0)
    answer = model.with_structured_output(schema, method="json_schema").invoke("Who speaks first?")
    jsonschema.validate(answer, schema)
