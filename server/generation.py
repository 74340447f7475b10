"""From a validated HTTP request to engine outputs and back: OpenAI completion and chat formats,
streaming (SSE) and not, with cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from .engine import Engine, EngineRequest, SamplingParams
from .engine.types import EngineError, FinishReason, RequestOutput, TokenLogprob
from .errors import APIError, from_engine_error
from .schemas import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from .streaming import EventStreamResponse, OutputStream, race_disconnect, sse_event

DEFAULT_CHAT_ROLES = {"system": "SYSTEM", "developer": "SYSTEM", "user": "USER", "assistant": "ASSISTANT", "tool": "TOOL"}


def render_chat(messages, tokenizer) -> str:
    """The checkpoint's chat template if it has one; else plain speaker turns, like a play's:

        USER.\\n<content>\\n\\nASSISTANT.\\n<content>\\n\\n … ASSISTANT.\\n
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{**m.model_dump(exclude_none=True), "content": m.text} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    turns = [f"{m.name or DEFAULT_CHAT_ROLES[m.role]}.\n{m.text}\n\n" for m in messages]
    return "".join(turns) + "ASSISTANT.\n"


@dataclass
class Generation:
    """One accepted engine request and its output stream."""

    engine: Engine
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: OutputStream
    created: int = field(default_factory=lambda: int(time.time()))
    generated: int = 0

    def abort(self) -> None:
        self.engine.abort(self.request_id)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.generated,
                "total_tokens": len(self.prompt_ids) + self.generated}


async def start_generation(request: Request, prompt_ids: list[int], params: SamplingParams, prefix: str,
                           session_id: str | None = None, owner: str | None = None) -> Generation:
    """Submit to the engine and wait until it accepts (EngineError → HTTP error before any byte is sent)."""
    state = request.app.state
    if state.draining or not state.engine.alive:
        reason = "the server is shutting down" if state.draining else "the engine has failed; the server is restarting"
        raise APIError(503, reason, code="unavailable", headers={"Retry-After": str(state.settings.retry_after_s)})
    if params.max_tokens > state.settings.max_tokens_limit:
        raise APIError(400, f"max_tokens must be <= {state.settings.max_tokens_limit}", "max_tokens")
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    stream = OutputStream(asyncio.get_running_loop(), params.n)
    engine_request = EngineRequest(request_id, prompt_ids, params, session_id=session_id, owner=owner)
    try:
        await asyncio.wrap_future(state.engine.submit(engine_request, stream.sink))
    except EngineError as error:
        raise from_engine_error(error, state.settings.retry_after_s) from None
    return Generation(state.engine, request_id, prompt_ids, params, stream)


async def collect(request: Request, generation: Generation) -> list[list[RequestOutput]] | None:
    """All outputs per row, or None if the client disconnected first (the generation is then aborted)."""
    rows: list[list[RequestOutput]] = [[] for _ in range(generation.params.n)]

    async def gather() -> list[list[RequestOutput]]:
        async for output in generation.stream:
            rows[output.index].append(output)
            generation.generated += output.token_id is not None
        return rows

    try:
        disconnected, result = await race_disconnect(request.receive, gather)
    finally:
        if not all(r and r[-1].finished for r in rows):
            generation.abort()
    failed = next((r[-1] for r in rows if r and r[-1].finish_reason is FinishReason.ERROR), None)
    if failed is not None and not disconnected:
        raise APIError(500, f"{failed.error} (request id {generation.request_id})", code="engine_error",
                       headers={"X-Request-Id": generation.request_id})
    return None if disconnected else result


def error_event(generation: Generation, output: RequestOutput) -> bytes:
    """A failed generation's last event, in OpenAI's error shape (then the stream ends with [DONE])."""
    return sse_event({"error": {"message": f"{output.error} (request id {generation.request_id})",
                                "type": "server_error", "param": None, "code": "engine_error"}})


def stream_events(generation: Generation, make_chunk, include_usage: bool, usage_chunk, first_chunks=()) -> EventStreamResponse:
    """SSE: one event per token (and per finish), optional usage event, then [DONE]."""

    async def events() -> AsyncIterator[bytes]:
        finished_rows, failed = 0, False
        try:
            for chunk in first_chunks:
                yield sse_event(chunk)
            async for batch in generation.stream.batches():
                events = []
                for output in batch:
                    generation.generated += output.token_id is not None
                    finished_rows += output.finished
                    if output.finish_reason is FinishReason.ERROR:
                        if not failed:  # one error event per request, whichever of its rows reports it
                            events.append(error_event(generation, output))
                        failed = True
                        continue
                    events.append(sse_event(make_chunk(output)))  # one event per token, even if its text is withheld
                yield b"".join(events)  # a backlog goes out in one write
            if include_usage and not failed:
                yield sse_event(usage_chunk())
            yield sse_event("[DONE]")
        finally:
            if finished_rows < generation.params.n:
                generation.abort()  # cancelled: the client went away or the server is stopping

    return EventStreamResponse(events())


# ---------------------------------------------------------------- logprob formats
def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, outputs: list[RequestOutput], offset: int = 0) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for output in outputs:
        lp: TokenLogprob | None = output.logprob
        if lp is None:
            continue
        text = token_text(tokenizer, lp.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append({token_text(tokenizer, t): v for t, v in lp.top})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(tokenizer, outputs: list[RequestOutput]) -> list[ChatTokenLogprob]:
    content = []
    for output in outputs:
        lp = output.logprob
        if lp is None:
            continue
        text = token_text(tokenizer, lp.token_id)
        top = [TopLogprob(token=token_text(tokenizer, t), logprob=v, bytes=list(token_text(tokenizer, t).encode()))
               for t, v in lp.top]
        content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
    return content
