"""Chat messages, the chat completions request (sampling fields + tools) and its answer's and chunks' models."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
)

from ...engine.types import SamplingParams
from ..common.chat import ChatMessage
from ..common.limits import RequestLimits
from ..common.protocol import ChatTokenLogprob, Int, SamplingFields, Usage
from ..common.tools import ToolCallDelta, ToolCallItem, ToolFields


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
