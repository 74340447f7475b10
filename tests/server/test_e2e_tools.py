"""Tool calls through HTTP with the official `openai` client (and LangChain) against a real `linserve serve` with
a random-weight model: every call's arguments validate against its function's schema because the grammar makes
them, streamed argument deltas add up to the non-streamed call, `tool_choice` and `parallel_tool_calls` are obeyed,
tool results go back as `role: "tool"` messages, and bad tool requests are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "linserve-shakespeare"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    server = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("tools") / "server.log", "--session-store", "none")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def valid_calls(message) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


@pytest.mark.parametrize("seed", range(6))
def test_required_calls_are_valid_and_end_with_tool_calls(client, seed):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=80, seed=seed)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    valid_calls(choice.message)


def test_a_named_function_and_one_call_only(client):
    for seed in range(4):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, seed=seed, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = valid_calls(answer.choices[0].message)
        assert [c.function.name for c in calls] == ["get_time"]
        assert answer.choices[0].finish_reason == "tool_calls"


def test_auto_answers_in_text_or_in_valid_calls_and_none_never_calls(client):
    for seed in range(6):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, seed=seed)
        message = answer.choices[0].message
        if message.tool_calls:
            valid_calls(message)
        else:
            assert not message.content.startswith("<tool_call>")
            assert answer.choices[0].finish_reason in ("stop", "length")
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=20, seed=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_streamed_argument_deltas_add_up_to_the_call(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:  # a call's first delta: id, type, name, empty arguments
                    assert delta.index not in calls and delta.type == "function" and delta.function.arguments == ""
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.function.name is None
                    calls[delta.index]["arguments"] += delta.function.arguments
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_results_go_back_as_tool_messages(client, server):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, seed=3, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=10, seed=0)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(f"{server.base}/tokenize", json={"messages": history}).json()
    text = httpx.post(f"{server.base}/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert f'<tool_call>{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in text
    assert "TOOL.\nSunny, 24 degrees." in text


def test_bad_tool_requests_are_400s_naming_the_field(client, server):
    function = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for body, param in [
        ({"tools": [function], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [function, function]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [function], "guided_regex": "a+"}, "guided_regex"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ]:
        response = httpx.post(f"{server.base}/v1/chat/completions",
                              json={"messages": ASK, "max_tokens": 5, **body})
        assert response.status_code == 400, (body, response.text)
        assert (response.json()["error"]["param"] or "").startswith(param), (body, response.json())
    with pytest.raises(BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"tools": [function]})


def test_tools_beside_a_json_schema_answer(client):
    """With tool_choice auto and a response_format, a plain answer is that JSON; a call is a valid call."""
    schema = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"]}
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}})
        message = answer.choices[0].message
        if message.tool_calls:
            valid_calls(message)
        else:
            jsonschema.validate(json.loads(message.content), schema)


def test_langchain_bind_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The forecast for a city over some days."""
        return f"{city}: sunny for {days} days"

    model = ChatOpenAI(base_url=f"{server.base}/v1", api_key="unused", model=MODEL, max_tokens=80, max_retries=0)
    answer = model.bind_tools([get_weather], tool_choice="required").invoke("Weather in Verona?")
    assert answer.tool_calls and answer.tool_calls[0]["name"] == "get_weather"
    arguments = answer.tool_calls[0]["args"]
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int)
    assert get_weather.invoke(arguments).startswith(arguments["city"])
