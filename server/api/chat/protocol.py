"""Chat messages, the chat completions request (sampling fields + tools) and its answer's and chunks' models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictBool,
    model_validator,
)

from ...engine.types import SamplingParams
from ..common.limits import RequestLimits
from ..common.protocol import ChatTokenLogprob, Int, SamplingFields, Text, Usage, valid_unicode
from ..common.tools import MAX_TOOLS, ToolCallDelta, ToolCallItem, ToolFields


def _content_parts(value):
    """Chat content: a string, or a list of text parts (`{"type": "text", "text": …}`) — the form many clients
    send. Other part types (images, audio, files) are refused by name."""
    if isinstance(value, str) or not isinstance(value, list):
        return value
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text'")
        valid_unicode(part["text"])
    return value


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[Text | list[dict], BeforeValidator(_content_parts)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, max_length=MAX_TOOLS)  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool's result answers this call

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def text(self) -> str:
        """The message's text: a list of parts is joined as OpenAI does (no separator)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part["text"] for part in self.content)


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    max_completion_tokens: Int | None = Field(None, ge=0)

    def to_sampling_params(self, limits: RequestLimits) -> SamplingParams:
        """max_tokens, else max_completion_tokens (OpenAI's newer name); each within the limit when given."""
        completion = limits.max_tokens_of("max_completion_tokens", self.max_completion_tokens)
        max_tokens = limits.max_tokens_of("max_tokens", self.max_tokens) if self.max_tokens is not None else completion
        return self._params(limits, max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []
    refusal: list[ChatTokenLogprob] | None = None  # never produced; OpenAI's schema requires the field


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None  # never produced; OpenAI's schema requires the field
    tool_calls: list[ToolCallItem] | None = Field(None, exclude_if=lambda value: value is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
