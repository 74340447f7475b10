"""The completions request (it converts itself to engine SamplingParams) and its answer's models — the body of
`/v1/completions` and of a session's `/v1/sessions/{id}/completions` alike."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
)

from ...engine.types import SamplingParams
from .limits import RequestLimits
from .protocol import CompletionLogprobs, Int, SamplingFields, Text, Usage


class CompletionRequest(SamplingFields):
    prompt: Text | list[Int] | list[Text] | list[list[Int]] = Field(
        "", description="a text, a list of token ids, or a batch of either (one generation per prompt)")
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    def to_sampling_params(self, limits: RequestLimits) -> SamplingParams:
        """With echo, logprobs covers the echoed prompt too (its tokens scored, as OpenAI's legacy API and
        lm-evaluation-harness expect)."""
        return self._params(limits, limits.max_tokens_of("max_tokens", self.max_tokens), self.logprobs,
                            self.logprobs if self.echo else None)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: a list of texts or of token-id lists is a batch, anything else one prompt."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


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
