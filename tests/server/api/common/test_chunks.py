"""Template-serialized stream chunks are exactly the JSON of the schema models (finish_reason null until
the end), for any text a token can carry."""

from __future__ import annotations

import json

import pytest

from linserve.server.api.chat.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from linserve.server.api.common.chunks import ChatChunks, CompletionChunks, chunk_json
from linserve.server.api.common.completion_protocol import CompletionChoice, CompletionResponse
from linserve.server.engine.types import FinishReason, RequestOutput

TEXTS = [
    "",
    "a",
    ' "quoted" \\ back',
    "line\nbreak\ttab\r",
    "\x00\x1f control",
    "é ü 漢字 🎭",
    "\u2028\u2029",
    "</script>",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, FinishReason.LENGTH, FinishReason.STOP])
def test_completion_chunk_equals_the_model(text, finish):
    output = RequestOutput(request_id="r", index=2, token_id=5, text=text, finish_reason=finish)
    got = json.loads(CompletionChunks('cmpl-"x"', 1700000000, "m/ü")(output, echo_text="E"))
    model = CompletionResponse(
        id='cmpl-"x"',
        created=1700000000,
        model="m/ü",
        choices=[CompletionChoice(index=2, text="E" + text, finish_reason=finish.value if finish else None)],
    )
    expected = json.loads(chunk_json(model))  # the model path: logprobs and finish_reason there, null
    assert got == expected and got["choices"][0]["logprobs"] is None
    assert got["choices"][0]["finish_reason"] == (finish.value if finish else None)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, FinishReason.LENGTH])
def test_chat_chunk_equals_the_model(text, finish):
    output = RequestOutput(request_id="r", index=0, token_id=5, text=text, finish_reason=finish)
    got = json.loads(ChatChunks("chatcmpl-1", 3, "m")(output))
    model = ChatCompletionChunk(
        id="chatcmpl-1",
        created=3,
        model="m",
        choices=[
            ChatChunkChoice(
                index=0, delta=ChatDelta(content=text or None), finish_reason=finish.value if finish else None
            )
        ],
    )
    expected = json.loads(model.model_dump_json(exclude_none=True))
    expected["choices"][0]["finish_reason"] = finish.value if finish else None
    assert got == expected
