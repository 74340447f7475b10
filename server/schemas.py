"""HTTP request and response models (OpenAI-compatible). Requests convert themselves to engine params."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationInfo,
                      field_validator)

from .engine.types import MAX_TOP_K, SEED_MAX, SEED_MIN, SamplingParams


def _valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that are not text: refuse them as bad input."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


def _json_number(value):
    """Numbers are JSON numbers: pydantic's lax mode would take `true` or `"3"` too."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"must be a number, not a {'boolean' if isinstance(value, bool) else 'string'}")
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int = Annotated[int, BeforeValidator(_json_number)]  # JSON's 1.0 is an integer; true and "1" are not
Float = Annotated[float, BeforeValidator(_json_number)]
StopText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions; ranges checked here give 400 with `param`."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: Int | None = Field(None, ge=0)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: Int = Field(1, ge=1)
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # extras (vLLM / TGI style)
    top_k: Int = Field(0, ge=-1, le=MAX_TOP_K, description="0 or -1 disables; at most the vocabulary size")
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: StrictBool = False

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def _params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, logprobs=logprobs, n=self.n,
            stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Text | list[Int] = ""
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return self._params(default_max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text
    name: Text | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    max_completion_tokens: Int | None = Field(None, ge=0)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self._params(default_max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class SessionCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: Text | list[Int] = ""


# ---------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "linserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class SessionCreated(BaseModel):
    id: str
    tokens: int
    state_bytes: int


class SessionDetail(SessionCreated):
    tier: str
    created: float
    last_used: float


class SessionRef(BaseModel):
    id: str


class RewindRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turn: Int = Field(ge=1, description="a kept turn's index (GET /v1/sessions/{id}/turns)")


class TurnInfo(BaseModel):
    turn: int
    tokens: int  # the session's length after this turn
    created: float  # unix time


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
