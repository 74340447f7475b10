"""Tool calls: the request fields (`tools`, `tool_choice`, `parallel_tool_calls`), the grammar that makes every
call's arguments valid under its function's `parameters` schema, and the parser that turns a choice's text back
into calls — whole, or as it streams (argument deltas).

A call is written in the text as `<tool_call>{"name": "NAME", "arguments": ARGS}` (ARGS compact JSON); several
calls follow one another. The grammar (llguidance's Lark with inline `%json`) fixes that form: with
`tool_choice: "auto"` the text is either plain text that does not start with `<tool_call>`, or only calls;
`"required"` allows only calls, a named function only calls of it; `parallel_tool_calls: false` exactly one.
The same form renders earlier calls in the prompt, so the model reads its history as it wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from .errors import APIError

MARKER = "<tool_call>"
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128
HEAD = MARKER + '{"name": "'
SEPARATOR = '", "arguments": '
COMPACT = {"whitespace_flexible": False}  # llguidance's option: no tokens spent on layout
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _invalid(param: str, message: str) -> PydanticCustomError:
    """A request-wide check's 400 that names its field (errors.py reads `param`)."""
    return PydanticCustomError("invalid_tools", message, {"param": param})


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ToolFields(BaseModel):
    """Chat's tool fields. `tool_choice` defaults to "auto" with tools, "none" without."""

    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _tools_consistent(self):
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise _invalid("tools", "tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise _invalid("tool_choice",
                           f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not names:
            raise _invalid("tool_choice", "tool_choice 'required' needs tools")
        return self

    def tool_spec(self) -> ToolSpec | None:
        """What the request allows (None: no tool calls — no tools, or tool_choice "none")."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none" or not self.tools:
            return None
        functions = {t.function.name: t.function.parameters or EMPTY_PARAMETERS for t in self.tools}
        if isinstance(choice, NamedToolChoice):
            functions = {choice.function.name: functions[choice.function.name]}
            choice = "required"
        return ToolSpec(functions, optional=choice == "auto", parallel=self.parallel_tool_calls)

    def tool_definitions(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


# where a schema names its subschemas (each may be an object schema to close)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def close_objects(schema):
    """The schema with every object that names its `properties` closed: an unstated `additionalProperties` is
    false, as OpenAI's strict mode and xgrammar read it (JSON Schema's own default, true, lets a model invent
    keys beside the named ones — every caller's parser would have to drop them). An explicit value is kept; an
    object without `properties` (a free-form dict) stays open; `allOf` branches are left as they are (closing
    each would forbid the others' keys). Returns a new schema; the request's is not changed."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    if isinstance(out.get("properties"), dict) and "allOf" not in out and "$ref" not in out and not any(
            key in out for key in ("additionalProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class ToolSpec:
    functions: dict[str, dict]  # name → parameters schema
    optional: bool  # "auto": plain text allowed instead
    parallel: bool

    def grammar(self, text_schema: dict | None = None) -> str:
        """The Lark grammar of the allowed outputs; `text_schema`: plain text must be that JSON instead."""
        rules, calls = [], []
        for number, (name, parameters) in enumerate(self.functions.items()):
            if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
                raise APIError(400, f"tools: the parameters of {name!r} must be a JSON schema of an object",
                               "tools")
            schema = {**close_objects(parameters), "x-guidance": COMPACT}
            rules.append(f'call_{number}: "{json.dumps(HEAD[len(MARKER):] + name)[1:-1]}'
                         f'{json.dumps(SEPARATOR)[1:-1]}" args_{number} "}}"')
            rules.append(f"args_{number}: %json {json.dumps(schema)}")
            calls.append(f"call_{number}")
        head = [f'calls: ("{MARKER}" call)+' if self.parallel else f'calls: "{MARKER}" call',
                "call: " + " | ".join(calls)]
        if not self.optional:
            start = ["start: calls"]
        elif text_schema is not None:
            start = ["start: text | calls", f"text: %json {json.dumps({**text_schema, 'x-guidance': COMPACT})}"]
        else:
            start = ["start: TEXT | calls", f"TEXT: /(?s:.*)/ & ~/(?s:{MARKER}.*)/"]
        return "\n".join(start + head + rules) + "\n"


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (earlier calls rendered into a prompt)."""
    return f"{HEAD}{name}{SEPARATOR}{arguments}}}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ToolCallParser:
    """One choice's text → content and calls, fed as it streams. `feed` returns what the new text releases:
    ("content", text), ("call", index) when a call's name is known, ("arguments", index, delta). Text that might
    still become the marker is held back (auto), at most its length."""

    optional: bool
    id_prefix: str = ""  # calls are named `<id_prefix>_<n>` (default: random `call_…` ids)
    mode: str = ""  # "" undecided, "text", "calls"
    buffer: str = ""
    state: str = "head"  # calls: head, name, separator, arguments, close
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""

    def __post_init__(self) -> None:
        if not self.optional:
            self.mode = "calls"

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        if not self.mode:
            if self.buffer.startswith(MARKER):
                self.mode = "calls"
            elif not MARKER.startswith(self.buffer):
                self.mode = "text"
            else:
                return []
        if self.mode == "text":
            released, self.buffer = self.buffer, ""
            self.content += released
            return [("content", released)] if released else []
        return self._calls()

    def finish(self) -> list[tuple]:
        """The end of the choice: a held-back prefix of the marker was text after all."""
        if not self.mode and self.buffer:
            self.mode = "text"
            return self.feed("")
        return []

    @property
    def complete_calls(self) -> list[ToolCall]:
        return [call for call in self.calls if call.complete]

    def _calls(self) -> list[tuple]:
        events: list[tuple] = []
        while self.buffer:
            if self.state in ("head", "separator"):
                expected = HEAD if self.state == "head" else SEPARATOR
                if len(self.buffer) < len(expected):
                    break
                if not self.buffer.startswith(expected):
                    raise ValueError(f"a tool call does not have the grammar's form at {self.buffer[:40]!r}")
                self.buffer = self.buffer[len(expected):]
                if self.state == "separator":
                    events.append(("call", len(self.calls) - 1))
                self.state = "name" if self.state == "head" else "arguments"
            elif self.state == "name":
                end = self.buffer.find('"')
                if end < 0:
                    break
                call_id = f"{self.id_prefix}_{len(self.calls)}" if self.id_prefix else new_call_id()
                self.calls.append(ToolCall(call_id, self.buffer[:end]))
                self.buffer, self.state = self.buffer[end:], "separator"  # SEPARATOR starts with the closing quote
            elif self.state == "arguments":
                taken = self._scan_arguments()
                delta, self.buffer = self.buffer[:taken], self.buffer[taken:]
                self.calls[-1].arguments += delta
                events.append(("arguments", len(self.calls) - 1, delta))
                if self.depth == 0 and self.calls[-1].arguments:
                    self.state = "close"
            else:  # close: the call's own closing brace
                if self.buffer[0] != "}":
                    raise ValueError(f"a tool call does not close where the grammar says at {self.buffer[:40]!r}")
                self.buffer, self.state = self.buffer[1:], "head"
                self.calls[-1].complete = True
        return events

    def _scan_arguments(self) -> int:
        """How many characters of the buffer belong to the arguments (they end where their JSON value does)."""
        for position, char in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return position + 1
        return len(self.buffer)


# ---------------------------------------------------------------- wire models
def json_object_text(value: str) -> str:
    try:
        parsed = json.loads(value)
    except ValueError:
        raise ValueError("a tool call's arguments must be JSON text") from None
    if not isinstance(parsed, dict):
        raise ValueError("a tool call's arguments must be a JSON object")
    return value


class FunctionCall(BaseModel):
    name: str
    arguments: Annotated[str, AfterValidator(json_object_text)]


class ToolCallItem(BaseModel):
    """A call in an assistant message (returned, or sent back as history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: the first has `id`, `type` and the name, the rest argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


def call_item(call: ToolCall) -> ToolCallItem:
    return ToolCallItem.model_construct(id=call.id, type="function",
                                        function=FunctionCall.model_construct(name=call.name, arguments=call.arguments))


def call_delta(parser: ToolCallParser, event: tuple) -> ToolCallDelta:
    """A parser's ("call", i) or ("arguments", i, text) event as a streamed delta."""
    call = parser.calls[event[1]]
    if event[0] == "call":
        return ToolCallDelta(index=event[1], id=call.id, type="function",
                             function=FunctionCallDelta(name=call.name, arguments=""))
    return ToolCallDelta(index=event[1], function=FunctionCallDelta(arguments=event[2]))
