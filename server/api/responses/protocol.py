"""The Responses API's request model (`POST /v1/responses`): input items, `text.format`, flat function tools. It
converts itself to what the rest of the server takes: chat messages to render, a ToolSpec, a structured-output
constraint (the `StructuredFields` of chat), sampling params."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from ...engine.types import SEED_MAX, SEED_MIN, SamplingParams
from ..common.limits import RequestLimits
from ..common.protocol import Float, Int, SpeculativeOptions, Text
from ..common.structured import JsonSchemaFormat, ResponseFormat, StructuredFields
from ..common.tools import MAX_TOOLS, NAME_PATTERN, FunctionCall, ToolCallItem, ToolFields, json_object_text

RESPONSE_ID = r"^resp_[0-9a-f]{32}_[0-9]{1,10}$"
HARMLESS = frozenset({"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key"})
NEUTRAL = {"truncation": ("disabled", None), "background": (False, None), "include": ([], None),
           "reasoning": (None,), "stream_options": (None,)}


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=NAME_PATTERN)
    arguments: Annotated[str, AfterValidator(json_object_text)]
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: Text
    id: str | None = None
    status: str | None = None


def _typed(item):
    """An input item without `type` is a message (as OpenAI reads `{"role": …, "content": …}`)."""
    return {**item, "type": "message"} if isinstance(item, dict) and "type" not in item else item


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, BeforeValidator(_typed)]


class ResponseFunctionTool(BaseModel):
    """A function tool in the Responses API's flat form."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)


class TextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema (flat: name, schema, strict)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class ResponseCreateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: Text | list[InputItem] = Field(description="a text (one user message) or a list of input items")
    instructions: Text | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    store: StrictBool = True
    stream: StrictBool = False
    previous_response_id: str | None = Field(None, pattern=RESPONSE_ID)
    text: TextOptions | None = None
    tools: list[ResponseFunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    priority: Int = Field(0, ge=-(2**31), le=2**31 - 1)
    speculative: SpeculativeOptions | None = None

    @model_validator(mode="after")
    def _no_unsupported_parameters(self):
        refused = sorted(name for name, value in (self.model_extra or {}).items()
                         if name not in HARMLESS and not (name in NEUTRAL and value in NEUTRAL[name]))
        if refused:
            raise PydanticCustomError("unsupported_parameter", f"unsupported parameter{'s' * (len(refused) > 1)}: "
                                      f"{', '.join(refused)} (linserve does not implement them)",
                                      {"param": refused[0]})
        if isinstance(self.input, list) and not self.input:
            raise PydanticCustomError("empty_input", "input: at least one item", {"param": "input"})
        return self

    @property
    def items(self) -> list:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def tool_fields(self) -> ToolFields:
        """The tools as chat's fields (their checks, grammar and rendering are shared)."""
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        tools = [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                 for tool in self.tools or ()]
        try:
            return ToolFields(tools=tools or None, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls)
        except ValueError as error:
            from ..common.errors import APIError

            first = error.errors()[0] if hasattr(error, "errors") else {}
            raise APIError(400, first.get("msg", str(error)), (first.get("ctx") or {}).get("param", "tools")) from None

    def structured(self) -> StructuredFields:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return StructuredFields()
        if fmt.type == "json_object":
            return StructuredFields(response_format=ResponseFormat(type="json_object"))
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_ if fmt.schema_ is not None else {})
        return StructuredFields(response_format=ResponseFormat(type="json_schema", json_schema=schema))

    def to_sampling_params(self, limits: RequestLimits) -> SamplingParams:
        return limits.check_sampling(SamplingParams(
            max_tokens=limits.max_tokens_of("max_output_tokens", self.max_output_tokens),
            temperature=limits.sampling_default(self, "temperature"), top_p=limits.sampling_default(self, "top_p"),
            seed=self.seed, priority=self.priority,
            speculative=self.speculative.to_engine() if self.speculative else None))

    def messages(self) -> list:
        """The input as chat messages (a call as an assistant's tool call, its output as a tool message)."""
        from ..common.chat import ChatMessage

        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        for item in self.items:
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(role=item.role, content=item.text))
            elif isinstance(item, FunctionCallItem):
                call = ToolCallItem(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        return messages
