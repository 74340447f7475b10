"""Streaming chunks serialized from a per-stream template: the hot path of an SSE stream.

A stream's id, created time and model never change, so everything around a token's text is prepared
once; per token only the text is JSON-escaped. No pydantic model is built per token. The result is
the JSON the schema models (`CompletionResponse`, `ChatCompletionChunk`) describe, with
`finish_reason: null` until the last chunk, as OpenAI's streams do. Chunks that carry logprobs are
rare and built from the models instead.
"""

from __future__ import annotations

import json

from ...engine.types import FinishReason, RequestOutput

# str → JSON string literal, quotes included: what `json.dumps(text, ensure_ascii=False)` writes (the C function
# its encoder calls for a str, without the encoder's Python frame a token)
_escape = json.encoder.encode_basestring


def chunk_json(chunk) -> str:
    """A chunk model (with logprobs, or a stream's first chunk) as JSON: fields left unset are omitted, but what
    OpenAI's schema requires is there even when null — every choice's `finish_reason` (null until its last
    chunk), a completion choice's `logprobs`, a chat logprobs object's `refusal` — as the template chunks below."""
    data = chunk.model_dump(exclude_none=True)
    completion = data.get("object") == "text_completion"
    for choice in data.get("choices", []):
        choice.setdefault("finish_reason", None)
        if completion:
            choice.setdefault("logprobs", None)
        elif isinstance(choice.get("logprobs"), dict):
            choice["logprobs"].setdefault("refusal", None)
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _head(request_id: str, kind: str, created: int, model: str) -> str:
    """`{"id":…,"object":…,"created":…,"model":…,"choices":[{"index":` — the part every chunk shares."""
    fields = json.dumps({"id": request_id, "object": kind, "created": created, "model": model},
                        separators=(",", ":"), ensure_ascii=False)
    return fields[:-1] + ',"choices":[{"index":'


# a chunk's `finish_reason` as JSON, by the output's reason (None: `null`, every token but the last), looked up
_FINISH = {None: "null", **{reason: _escape(reason.value) for reason in FinishReason}}


class CompletionChunks:
    """`text_completion` stream chunks for one request."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = _head(request_id, "text_completion", created, model)

    def __call__(self, output: RequestOutput, echo_text: str = "") -> str:
        return (f'{self._head}{output.index},"text":{_escape(echo_text + output.text)},"logprobs":null,'
                f'"finish_reason":{_FINISH[output.finish_reason]}}}]}}')


class ChatChunks:
    """`chat.completion.chunk` stream chunks for one request (content deltas)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = _head(request_id, "chat.completion.chunk", created, model)

    def __call__(self, output: RequestOutput) -> str:
        delta = f'{{"content":{_escape(output.text)}}}' if output.text else "{}"
        return f'{self._head}{output.index},"delta":{delta},"finish_reason":{_FINISH[output.finish_reason]}}}]}}'
