"""The request and response fields several families share: the sampling fields (→ engine SamplingParams),
stream and speculation options, usage, logprob shapes, the error body. Each family's own models live in its
protocol.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ...engine.types import MAX_TOP_K, SEED_MAX, SEED_MIN, SamplingParams, Speculation
from .limits import RequestLimits
from .structured import StructuredFields


def valid_unicode(value: str) -> str:
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


Text = Annotated[str, AfterValidator(valid_unicode)]


Int = Annotated[int, BeforeValidator(_json_number)]  # JSON's 1.0 is an integer; true and "1" are not


Float = Annotated[float, BeforeValidator(_json_number)]


StopText = Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SpeculativeOptions(BaseModel):
    """`"speculative": {"method": "ngram", "k": 4}`: drafts verified k at a time (docs/engine.md)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["off", "ngram", "draft"]
    k: Int | None = Field(None, ge=1, le=8, description="drafts per step at most (≤ the server's speculative_k)")

    def to_engine(self) -> Speculation:
        return Speculation(self.method, self.k)


# accepted and ignored: they change nothing a client could observe here
HARMLESS_EXTRAS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


MAX_TOKEN_ID_DIGITS = 10  # beyond any vocabulary


class SamplingFields(StructuredFields):
    """Fields shared by completions and chat completions; ranges checked here give 400 with `param`.

    A parameter linserve does not implement is refused with a 400 naming it (never silently ignored),
    except the harmless ones in HARMLESS_EXTRAS and the neutral values of a few (`best_of: 1`,
    `suffix: ""`, `parallel_tool_calls` without tools). Structured outputs: structured.py."""

    model_config = ConfigDict(extra="allow")

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
    logit_bias: dict[str, Float] | None = Field(None, description="token id (as a string) → bias in [-100, 100]")
    priority: Int = Field(0, ge=-(2**31), le=2**31 - 1, description="lower is served first (scheduling_policy "
                          "priority; another value than 0 is a 400 under fcfs)")
    speculative: SpeculativeOptions | None = Field(None, description="speculative decoding for this request "
                                                   "(absent: the server's `speculative` setting)")

    @model_validator(mode="after")
    def _no_unsupported_parameters(self):
        extras = dict(self.model_extra or {})
        neutral = {"best_of": lambda v: v in (None, 1), "suffix": lambda v: v in (None, ""),
                   "parallel_tool_calls": lambda v: True, "tool_choice": lambda v: v in (None, "none")}
        refused = sorted(name for name, value in extras.items()
                         if name not in HARMLESS_EXTRAS and not (name in neutral and neutral[name](value)))
        if refused:  # the error names the (first) field: `param` in the 400
            raise PydanticCustomError(
                "unsupported_parameter",
                f"unsupported parameter{'s' if len(refused) > 1 else ''}: {', '.join(refused)} "
                "(linserve does not implement them)", {"param": refused[0]})
        return self

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries")
        for token, bias in value.items():
            # ASCII digits only ("²" and "①" are digits to str.isdigit but not to int), and short enough to parse
            if not (token.isascii() and token.isdigit() and len(token) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys are token ids as strings of at most {MAX_TOKEN_ID_DIGITS} "
                                 f"digits, got {token[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

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

    def _params(self, limits: RequestLimits, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters, checked against this server's limits (`max_tokens` already is: the family
        knows which field named it)."""
        return limits.check_sampling(SamplingParams(
            max_tokens=max_tokens,
            temperature=limits.sampling_default(self, "temperature"),
            top_k=max(limits.sampling_default(self, "top_k"), 0), top_p=limits.sampling_default(self, "top_p"),
            min_p=limits.sampling_default(self, "min_p"),
            repetition_penalty=limits.sampling_default(self, "repetition_penalty"),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, n=self.n,
            stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos,
            logit_bias=tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items()),
            priority=self.priority, speculative=self.speculative.to_engine() if self.speculative else None,
        ))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; with echo the prompt's tokens come first, the very first with null logprobs
    (nothing predicts it) unless a session's history does."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
