"""Every body and every SSE chunk of the OpenAI-compatible routes, from a real `linserve serve`, validates
against OpenAI's published component schema (tests/conformance.py; the exceptions are listed there): models,
completions and chat in each shape they stream or return, tool calls, structured output, the Responses API's
objects and every event it streams, and the errors of bad requests."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from tests.conformance import check
from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Speak, Verona"}]


@pytest.fixture(scope="module")
def base(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("conformance")
    server = ServerProcess(tiny_checkpoint, directory / "serve.log", "--session-store", f"dir:{directory / 'store'}")
    yield server.base
    server.stop()


def post(base: str, path: str, body: dict) -> dict:
    response = httpx.post(base + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def events(base: str, path: str, body: dict) -> list[dict]:
    """The data of every SSE event of a streamed request, [DONE] left out."""
    out = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    assert out
    return out


def test_models(base):
    check("ListModelsResponse", httpx.get(base + "/v1/models").json())
    listed = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    check("Model", httpx.get(f"{base}/v1/models/{listed}").json())
    missing = httpx.get(base + "/v1/models/gpt-5")
    assert missing.status_code == 404
    check("ErrorResponse", missing.json())


@pytest.mark.parametrize("extra", [
    {}, {"logprobs": 2}, {"echo": True}, {"echo": True, "logprobs": 1}, {"n": 2}, {"prompt": ["ROMEO.", "KING."]},
    {"stop": ["\n"], "seed": 3}, {"max_tokens": 0, "echo": True, "logprobs": 0},
])
def test_completions(base, extra):
    body = {"prompt": "ROMEO.", "max_tokens": 6, **extra}
    check("CreateCompletionResponse", post(base, "/v1/completions", body))


@pytest.mark.parametrize("extra", [
    {}, {"stream_options": {"include_usage": True}}, {"n": 2, "echo": True}, {"logprobs": 2},
    {"echo": True, "logprobs": 1},
])
def test_completion_chunks(base, extra):
    for chunk in events(base, "/v1/completions", {"prompt": "ROMEO.", "max_tokens": 6, **extra}):
        check("CreateCompletionResponse", chunk)  # the spec: streamed and whole share one shape


@pytest.mark.parametrize("extra", [
    {}, {"logprobs": True, "top_logprobs": 2}, {"n": 2}, {"seed": 3, "stop": ["\n"]}, {"max_completion_tokens": 5},
    {"tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 60},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}, "max_tokens": 40},
])
def test_chat(base, extra):
    check("CreateChatCompletionResponse", post(base, "/v1/chat/completions", {"messages": ASK, "max_tokens": 6,
                                                                               **extra}))


@pytest.mark.parametrize("extra", [
    {}, {"logprobs": True, "top_logprobs": 2}, {"stream_options": {"include_usage": True}}, {"n": 2},
    {"tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 60},
])
def test_chat_chunks(base, extra):
    for chunk in events(base, "/v1/chat/completions", {"messages": ASK, "max_tokens": 6, **extra}):
        check("CreateChatCompletionStreamResponse", chunk)


def test_responses_objects_and_every_streamed_event(base):
    # greedy, so the follow-up's 6 tokens are always the same ones (none of them the end of text): it is incomplete
    first = post(base, "/v1/responses", {"input": "Speak", "max_output_tokens": 6, "instructions": "Briefly.",
                                         "temperature": 0})
    check("Response", first)
    follow = {"input": "Again", "previous_response_id": first["id"], "max_output_tokens": 6, "temperature": 0}
    streamed = events(base, "/v1/responses", follow)
    kinds = {event["type"] for event in streamed}
    assert {"response.created", "response.output_text.delta", "response.incomplete"} <= kinds
    for event in streamed:
        check("ResponseStreamEvent", event)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    called = events(base, "/v1/responses", {"input": "Weather?", "tools": tools, "tool_choice": "required",
                                            "max_output_tokens": 60})
    assert "response.function_call_arguments.delta" in {event["type"] for event in called}
    for event in called:
        check("ResponseStreamEvent", event)
    check("Response", httpx.get(f"{base}/v1/responses/{first['id']}").json())
    check("ResponseItemList", httpx.get(f"{base}/v1/responses/{first['id']}/input_items").json())
    formatted = post(base, "/v1/responses", {"input": "x", "max_output_tokens": 40,
                                             "text": {"format": {"type": "json_schema", "name": "w",
                                                                 "schema": WEATHER}}})
    check("Response", formatted)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "best_of": 3}),
    ("/v1/completions", {"prompt": "x", "model": "gpt-5"}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}),
    ("/v1/responses", {"input": []}),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_" + "0" * 32 + "_1"}),
])
def test_errors(base, path, body):
    response = httpx.post(base + path, json=body)
    assert 400 <= response.status_code < 500
    check("ErrorResponse", response.json())


def test_a_missing_required_field_fails_the_suite(base):
    """The suite is not a formality: drop one required field and it says so."""
    chunk = events(base, "/v1/completions", {"prompt": "ROMEO.", "max_tokens": 2})[0]
    broken = copy.deepcopy(chunk)
    del broken["choices"][0]["logprobs"]  # what every chunk lacked before this suite
    with pytest.raises(AssertionError, match="'logprobs' is a required property"):
        check("CreateCompletionResponse", broken)
    message = post(base, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
    del message["choices"][0]["message"]["refusal"]
    with pytest.raises(AssertionError, match="'refusal' is a required property"):
        check("CreateChatCompletionResponse", message)
