"""POST /v1/chat/completions: chat, with structured outputs (structured.py) and tool calls (tools.py)."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Request

from ...engine.types import FinishReason, RequestOutput
from ..common.chat import chat_prompt
from ..common.choice_logprobs import ChoiceLogprobs
from ..common.chunks import ChatChunks, chunk_json
from ..common.dependencies import LimitsDep, Owner, SettingsDep, TokenizerDep, check_model, encode_prompt
from ..common.generation import collect, reserve_logprobs, start_generation, stream_events
from ..common.openapi import GENERATION, errors, streamed
from ..common.protocol import Usage
from ..common.structured import with_grammar
from ..common.tools import ToolCallParser, ToolSpec, call_delta, call_item
from .logprobs import chat_entries, chat_logprobs
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
)

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=None, responses={**streamed(ChatCompletionResponse), **errors(*GENERATION)}
)
async def chat_completions(request: Request, body: ChatCompletionRequest, settings: SettingsDep,
                           tokenizer: TokenizerDep, limits: LimitsDep, owner: Owner, background: BackgroundTasks):
    check_model(body.model, settings)
    params = body.to_sampling_params(limits)
    tools = body.tool_spec()
    text = await chat_prompt(request, body.messages, tokenizer, body.tool_definitions())
    prompt_ids = await encode_prompt(request, text, allow_empty=False, starts=True)
    params = await with_grammar(request, body, params, tools)
    reservation = reserve_logprobs(request, [prompt_ids], params, body.stream, background)
    try:
        return await _chat(request, body, tokenizer, settings, owner, prompt_ids, params, tools,
                           reservation.release)
    except BaseException:
        reservation.release()
        raise


def finish_reason(output: RequestOutput, parser: ToolCallParser | None) -> str:
    """A choice that ended by completing its calls ends with "tool_calls" (cut short, with "length")."""
    if parser is not None and parser.complete_calls and output.finish_reason is FinishReason.STOP:
        return "tool_calls"
    return output.finish_reason.value


class ToolChunks:
    """Streamed chunks of a request that may call tools: content deltas, and each call as a header delta (id,
    name) followed by argument deltas; one chunk per token, as without tools."""

    def __init__(self, generation, model: str, tools: ToolSpec, tokenizer, want_logprobs: bool) -> None:
        self.generation, self.model, self.tools = generation, model, tools
        self.tokenizer, self.want_logprobs = tokenizer, want_logprobs
        self.parsers: dict[int, ToolCallParser] = {}
        self.logprobs: dict[int, ChoiceLogprobs] = {}  # each choice's, released with its text

    def __call__(self, output: RequestOutput) -> str:
        parser = self.parsers.setdefault(output.index, ToolCallParser(self.tools.optional))
        events = parser.feed(output.text) + (parser.finish() if output.finished else [])
        content = "".join(event[1] for event in events if event[0] == "content")
        calls = [call_delta(parser, event) for event in events if event[0] != "content"]
        choice = ChatChunkChoice(
            index=output.index, delta=ChatDelta(content=content or None, tool_calls=calls or None),
            logprobs=ChatLogprobs(content=chat_entries(self.tokenizer, self.logprobs.setdefault(
                output.index, ChoiceLogprobs(self.tokenizer)).push(output))) if self.want_logprobs else None,
            finish_reason=finish_reason(output, parser) if output.finished else None)
        return chunk_json(ChatCompletionChunk(id=self.generation.request_id, created=self.generation.created,
                                              model=self.model, choices=[choice]))


def assistant_message(text: str, tools: ToolSpec | None) -> tuple[AssistantMessage, ToolCallParser | None]:
    if tools is None:
        return AssistantMessage(content=text), None
    parser = ToolCallParser(tools.optional)
    parser.feed(text)
    parser.finish()
    calls = [call_item(call) for call in parser.complete_calls]
    return AssistantMessage(content=parser.content or (None if parser.mode == "calls" else ""),
                            tool_calls=calls or None), parser


async def _chat(request: Request, body: ChatCompletionRequest, tokenizer, settings, owner, prompt_ids: list[int],
                params, tools: ToolSpec | None, on_close):
    generation = await start_generation(request, [prompt_ids], params, "chatcmpl", None, owner)
    model = settings.served_model_name
    want_logprobs = params.logprobs is not None

    released: dict[int, ChoiceLogprobs] = {}  # each choice's logprobs, released with its text (stop strings)

    def chunk_with_logprobs(output) -> str:
        choice_logprobs = released.setdefault(output.index, ChoiceLogprobs(tokenizer))
        logprobs = ChatLogprobs(content=chat_entries(tokenizer, choice_logprobs.push(output)))
        choice = ChatChunkChoice(
            index=output.index,
            delta=ChatDelta(content=output.text or None),
            logprobs=logprobs,
            finish_reason=output.finish_reason.value if output.finished else None,
        )
        return chunk_json(
            ChatCompletionChunk(id=generation.request_id, created=generation.created, model=model, choices=[choice])
        )

    if body.stream:
        role_chunks = [
            chunk_json(
                ChatCompletionChunk(
                    id=generation.request_id,
                    created=generation.created,
                    model=model,
                    choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))],
                )
            )
            for i in range(params.n)
        ]

        def usage_chunk() -> str:
            return ChatCompletionChunk(
                id=generation.request_id,
                created=generation.created,
                model=model,
                choices=[],
                usage=Usage(**generation.usage),
            ).model_dump_json(exclude_none=True)

        if tools is not None:
            chunk = ToolChunks(generation, model, tools, tokenizer, want_logprobs)
        elif want_logprobs:
            chunk = chunk_with_logprobs
        else:
            chunk = ChatChunks(generation.request_id, generation.created, model)
        return stream_events(generation, chunk, body.include_usage, usage_chunk, role_chunks, on_close)
    rows = await collect(request, generation)
    if rows is None:
        return None
    choices = []
    for i, outputs in enumerate(rows):
        message, parser = assistant_message("".join(o.text for o in outputs), tools)
        choices.append(ChatChoice(
            index=i, message=message,
            logprobs=ChatLogprobs(content=chat_logprobs(tokenizer, outputs)) if want_logprobs else None,
            finish_reason=finish_reason(outputs[-1], parser)))
    return ChatCompletionResponse(
        id=generation.request_id,
        created=generation.created,
        model=model,
        choices=choices,
        usage=Usage(**generation.usage),
    )
