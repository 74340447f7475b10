"""A request's lifecycle, from a validated HTTP request to engine outputs and back: starting it (logprob memory
reserved, outputs routed to the event loop), collecting its outputs or streaming them (SSE) with cancellation
when the client goes away, and its errors. Each family formats its own answer and logprobs (completions':
completion_serving.py; chat's: chat/logprobs.py; both release tokens with their text: choice_logprobs.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import BackgroundTasks, Request
from starlette.background import BackgroundTask

from ...engine.client import EngineClient
from ...engine.types import (
    AlreadyApplied,
    EngineError,
    EngineRequest,
    FinishReason,
    Idempotency,
    RequestOutput,
    SamplingParams,
)
from .dependencies import get_engine
from .errors import ENGINE_STATUS, APIError, from_engine_error
from .logprob_budget import Reservation, logprob_bytes
from .streaming import GenerationStreamResponse, OutputStream, race_disconnect, sse_event


@dataclass
class Generation:
    """One HTTP request's accepted engine requests (one per prompt) and their merged output stream: prompt
    p's row r arrives as index p × n + r, as OpenAI numbers the choices of a batch of prompts."""

    engine: EngineClient
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: OutputStream
    created: int = field(default_factory=lambda: int(time.time()))
    generated: int = 0
    engine_ids: list[str] = field(default_factory=list)
    consumed: dict[int, int] = field(default_factory=dict)  # prompt number → prompt tokens the engine took

    def count(self, output: RequestOutput) -> None:
        """Account one output: a generated token, and the prompt tokens its request added as the engine counts
        them (an empty session's first call starts from end-of-text: one token, not zero)."""
        self.generated += output.token_id is not None
        if output.finish_reason is not None and output.request_id:  # once a row: the request's count
            self.consumed[output.index // self.params.n] = output.prompt_tokens

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n

    def abort(self) -> None:
        for engine_id in self.engine_ids:
            self.engine.abort(engine_id)

    @property
    def usage(self) -> dict:
        prompt_tokens = sum(self.consumed.get(number, len(ids)) for number, ids in enumerate(self.prompts))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": prompt_tokens + self.generated,
        }


def _offset_sink(sink, offset: int):
    """A sink that renumbers a prompt's rows into the request's choice indices (engine thread)."""
    if offset == 0:
        return sink
    return lambda output: sink(dataclasses.replace(output, index=output.index + offset))


def reserve_logprobs(request: Request, prompts: Sequence[list[int]], params: SamplingParams, streamed: bool,
                     background: BackgroundTasks) -> Reservation:
    """Count the request's logprobs against `logprobs_memory_mb` (400 / 429 when they do not fit); given back
    after the response is sent (`background`, or a stream's close)."""
    budget = request.app.state.logprob_budget
    reservation = budget.reserve(logprob_bytes([len(p) for p in prompts], params, streamed))
    if not streamed:
        background.add_task(reservation.release)
    return reservation


async def start_generation(
    request: Request,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    prefix: str,
    session_id: str | None = None,
    owner: str | None = None,
    idempotency: Idempotency | None = None,
    expected_revision: str | None = None,
) -> Generation:
    """Submit one engine request per prompt and wait until each is accepted (EngineError → HTTP error before
    any byte is sent; the prompts accepted before a refused one are aborted)."""
    state, engine = request.app.state, get_engine(request)
    if state.draining or not engine.alive:
        reason = "the server is shutting down" if state.draining else "the engine has failed; the server is restarting"
        raise APIError(503, reason, code="unavailable", headers={"Retry-After": str(state.settings.retry_after_s)})
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    stream = OutputStream(asyncio.get_running_loop(), len(prompts) * params.n)
    generation = Generation(engine, request_id, list(prompts), params, stream)
    if idempotency is not None:  # a retry's replayed answer carries the first attempt's time
        generation.created = idempotency.created
    for number, prompt_ids in enumerate(prompts):
        engine_id = request_id if len(prompts) == 1 else f"{request_id}-{number}"
        engine_request = EngineRequest(engine_id, prompt_ids, params, session_id=session_id, owner=owner,
                                       idempotency=idempotency, expected_revision=expected_revision)
        generation.engine_ids.append(engine_id)  # aborted below if anything fails, even while being accepted
        try:
            await asyncio.wrap_future(engine.submit(engine_request, _offset_sink(stream.sink, number * params.n)))
        except AlreadyApplied:
            generation.abort()
            raise  # the caller answers with the first attempt's result
        except EngineError as error:
            generation.abort()
            raise from_engine_error(error, state.settings.retry_after_s) from None
        except BaseException:  # cancelled (the client left): the engine may accept it after all
            generation.abort()
            raise
    return generation


async def collect(request: Request, generation: Generation) -> list[list[RequestOutput]] | None:
    """All outputs per row, or None if the client disconnected first (the generation is then aborted)."""
    rows: list[list[RequestOutput]] = [[] for _ in range(generation.rows)]

    async def gather() -> list[list[RequestOutput]]:
        async for output in generation.stream:
            rows[output.index].append(output)
            generation.count(output)
            if output.finish_reason is FinishReason.ERROR:
                generation.abort()  # a failed prompt fails the request: its other prompts stop too
        return rows

    try:
        disconnected, result = await race_disconnect(request.receive, gather)
    finally:
        if not all(r and r[-1].finished for r in rows):
            generation.abort()
    failed = next((r[-1] for r in rows if r and r[-1].finish_reason is FinishReason.ERROR), None)
    if failed is not None and not disconnected:
        status, code = error_status(failed)
        headers = {"X-Request-Id": generation.request_id}
        if status == 503:
            headers["Retry-After"] = str(request.app.state.settings.retry_after_s)
        raise APIError(status, f"{failed.error} (request id {generation.request_id})", code=code, headers=headers)
    return None if disconnected else result


def error_status(output: RequestOutput) -> tuple[int, str]:
    """(HTTP status, error code) of a failed output: the session store's failure is a 503 (the turn was not
    stored: retry), anything else the engine's own (500)."""
    if output.error_kind is not None and ENGINE_STATUS.get(output.error_kind) == 503:
        return 503, output.error_kind
    return 500, "engine_error"


def error_event(generation: Generation, output: RequestOutput) -> bytes:
    """A failed generation's last event, in OpenAI's error shape (then the stream ends with [DONE])."""
    status, code = error_status(output)
    kind = "service_unavailable" if status == 503 else "server_error"
    return sse_event(
        {
            "error": {
                "message": f"{output.error} (request id {generation.request_id})",
                "type": kind,
                "param": None,
                "code": code,
            }
        }
    )


class GenerationEvents:
    """The SSE events of a generation (an EventSource): one event per token (and per finish), the optional usage
    event, then [DONE]; a failed row's error event once, its other prompts aborted."""

    def __init__(self, generation: Generation, make_chunk, include_usage: bool, usage_chunk, first_chunks=()) -> None:
        self.generation, self.stream = generation, generation.stream
        self.make_chunk, self.include_usage, self.usage_chunk = make_chunk, include_usage, usage_chunk
        self.first_chunks = first_chunks
        self.finished_rows, self.failed = 0, False

    def first(self) -> bytes:
        return b"".join(sse_event(chunk) for chunk in self.first_chunks)

    def render(self, batch: list[RequestOutput]) -> bytes:
        """One event per token, even if its text is withheld (a token's chunk is JSON text: its event is
        `sse_event`'s, written here — the stream's hot path, a call fewer a token); a backlog in one write."""
        generation, make_chunk, events = self.generation, self.make_chunk, []
        for output in batch:
            if output.finish_reason is None:  # a token: `generation.count`'s only work for it, written out
                generation.generated += output.token_id is not None
            else:
                generation.count(output)
                self.finished_rows += 1
                if output.finish_reason is FinishReason.ERROR:
                    if not self.failed:  # one error event per request, whichever of its rows reports it
                        events.append(error_event(generation, output))
                        generation.abort()  # its other prompts stop too
                    self.failed = True
                    continue
            events.append(f"data: {make_chunk(output)}\n\n".encode())
        return b"".join(events)

    def last(self) -> bytes:
        usage = sse_event(self.usage_chunk()) if self.include_usage and not self.failed else b""
        return usage + sse_event("[DONE]")

    def close(self) -> None:
        if self.finished_rows < self.generation.rows:
            self.generation.abort()  # cancelled: the client went away or the server is stopping


def stream_events(
    generation: Generation, make_chunk, include_usage: bool, usage_chunk, first_chunks=(), on_close=None
) -> GenerationStreamResponse:
    """SSE: one event per token (and per finish), optional usage event, then [DONE]. `on_close()` runs once
    the response has ended, however it ended."""
    source = GenerationEvents(generation, make_chunk, include_usage, usage_chunk, first_chunks)
    return GenerationStreamResponse(source, background=None if on_close is None else BackgroundTask(on_close))
