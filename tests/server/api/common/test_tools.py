"""tools.py: the grammar of tool calls (compiled by the engine's grammar runtime with the real tokenizer) and the
parser that turns a choice's text back into content and calls, whole or streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from linserve.server.api.common.tools import ToolCallParser, ToolFields, ToolSpec, call_text
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
