"""tools.py: the grammar of tool calls (compiled by the engine's grammar runtime with the real tokenizer) and the
parser that turns a choice's text back into content and calls, whole or streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from linserve.server.api.common.completion_protocol import CompletionRequest
from linserve.server.api.common.structured import grammar_asked
from linserve.server.api.common.tools import ToolCallParser, ToolFields, ToolSpec, call_text, close_objects
from linserve.server.engine.constraint import GrammarRuntime

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TWO_CALLS = call_text("get_weather", '{"city":"Pa\\"}{[ris"}') + call_text("get_time", '{"at":[1,{"b":[]}]}')


@pytest.fixture(scope="module")
def runtime(hf_tokenizer):
    return GrammarRuntime(hf_tokenizer, len(hf_tokenizer))


def accepts(runtime, tokenizer, spec: ToolSpec, text: str) -> bool:
    """Whether the compiled grammar takes `text` as a whole output."""
    matcher = runtime.matcher(runtime.compile("grammar", spec.grammar()))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_the_grammar_allows_what_tool_choice_says(runtime, hf_tokenizer):
    functions = {"get_weather": WEATHER, "get_time": {"type": "object"}}
    auto, required = ToolSpec(functions, True, True), ToolSpec(functions, False, True)
    single = ToolSpec(functions, False, False)
    call = call_text("get_weather", '{"city":"Verona"}')
    assert accepts(runtime, hf_tokenizer, auto, "Fair Verona, where we lay our scene")
    assert accepts(runtime, hf_tokenizer, auto, call) and accepts(runtime, hf_tokenizer, auto, TWO_CALLS)
    assert not accepts(runtime, hf_tokenizer, auto, "<tool_call>not a call")  # the marker starts only calls
    assert not accepts(runtime, hf_tokenizer, required, "plain text")
    assert not accepts(runtime, hf_tokenizer, required, call_text("get_weather", '{"town":"Verona"}'))  # schema
    assert not accepts(runtime, hf_tokenizer, required, call_text("get_wind", "{}"))  # no such function
    assert accepts(runtime, hf_tokenizer, single, call) and not accepts(runtime, hf_tokenizer, single, TWO_CALLS)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_the_parser_finds_the_calls_in_pieces_of_any_size(piece):
    parser, events = ToolCallParser(optional=True), []
    for start in range(0, len(TWO_CALLS), piece):
        events += parser.feed(TWO_CALLS[start:start + piece])
    events += parser.finish()
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("get_weather", '{"city":"Pa\\"}{[ris"}', True), ("get_time", '{"at":[1,{"b":[]}]}', True)]
    assert [e for e in events if e[0] == "call"] == [("call", 0), ("call", 1)]
    for index, call in enumerate(parser.calls):  # the deltas add up to the arguments
        assert "".join(e[2] for e in events if e[0] == "arguments" and e[1] == index) == call.arguments
        json.loads(call.arguments)
    assert parser.content == "" and len({c.id for c in parser.calls}) == 2


def test_text_is_held_back_only_while_it_could_still_be_the_marker():
    parser = ToolCallParser(optional=True)
    assert parser.feed("<tool") == []
    assert parser.feed("s of war") == [("content", "<tools of war")]
    assert parser.feed(" cry") == [("content", " cry")]
    ended = ToolCallParser(optional=True)
    assert ended.feed("<to") == [] and ended.finish() == [("content", "<to")]
    cut = ToolCallParser(optional=False)  # a call cut short (max_tokens): not complete
    cut.feed(call_text("f", '{"a":1}')[:-3])
    assert [c.complete for c in cut.calls] == [False] and cut.complete_calls == []


def test_tool_fields_check_names_and_choice():
    tool = {"type": "function", "function": {"name": "f"}}
    assert ToolFields(tools=[tool]).tool_spec().optional  # tools alone: auto
    assert ToolFields(tools=[tool], tool_choice="none").tool_spec() is None
    named = ToolFields(tools=[tool, {"type": "function", "function": {"name": "g"}}],
                       tool_choice={"type": "function", "function": {"name": "g"}}).tool_spec()
    assert list(named.functions) == ["g"] and not named.optional
    for bad in [{"tools": [tool, tool]}, {"tool_choice": "required"},
                {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "h"}}}]:
        with pytest.raises(ValidationError):
            ToolFields(**bad)


ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}


def test_named_properties_are_all_an_object_may_have_unless_it_says_otherwise(runtime, hf_tokenizer):
    """LangChain's `@tool def add(a: float, b: float)` sends ADD, without `additionalProperties`: a model once
    answered {"a": -5, "b": -6, "--but, I have…": "…"}. Unstated means false (OpenAI strict, xgrammar)."""
    spec = ToolSpec({"add": ADD, "free": {"type": "object"}}, False, False)
    assert accepts(runtime, hf_tokenizer, spec, call_text("add", '{"a":1,"b":2}'))
    assert not accepts(runtime, hf_tokenizer, spec, call_text("add", '{"a":1,"b":2,"c":3}'))
    assert accepts(runtime, hf_tokenizer, spec, call_text("free", '{"any":1,"keys":[]}'))  # no properties: open
    opened = ToolSpec({"add": {**ADD, "additionalProperties": True}}, False, False)
    assert accepts(runtime, hf_tokenizer, opened, call_text("add", '{"a":1,"b":2,"c":3}'))  # said: honoured


def test_closing_reaches_nested_objects_and_leaves_what_it_must():
    nested = {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "list": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        "typed": {"type": "object", "properties": {"w": {}}, "additionalProperties": {"type": "string"}},
        "both": {"allOf": [{"type": "object", "properties": {"p": {}}}, {"properties": {"q": {}}}]}},
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}}
    closed = close_objects(nested)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["point"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["typed"]["additionalProperties"] == {"type": "string"}  # stated: kept
    assert all("additionalProperties" not in branch for branch in props["both"]["allOf"])  # an intersection
    assert closed["$defs"]["node"]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the request's own schema is not changed


def test_a_json_schema_format_is_closed_too(runtime, hf_tokenizer):
    body = CompletionRequest(prompt="x", response_format={"type": "json_schema", "json_schema": {
        "name": "add", "schema": ADD}})
    field, kind, value = grammar_asked(body)
    assert (field, kind) == ("response_format", "json_schema") and value["additionalProperties"] is False
    matcher = runtime.matcher(runtime.compile(kind, value))
    assert all(matcher.consume_token(t) for t in hf_tokenizer.encode('{"a":1,"b":2', add_special_tokens=False))
    assert not matcher.consume_token(hf_tokenizer.encode(",", add_special_tokens=False)[0])  # no third key
