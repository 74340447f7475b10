"""Engine outputs into asyncio, and a server-sent-events response that notices a client leaving.

The engine calls a sink on its own thread; `OutputStream` hands each output to the event loop with
`call_soon_threadsafe`. `EventStreamResponse` writes events while a second task waits for the ASGI
`http.disconnect` message: whichever finishes first cancels the other, so a client that goes away
cancels its generation at once (the generator's `finally` aborts it in the engine), even while no
token is being written.
"""

from __future__ import annotations

import asyncio
import collections
import json
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ...engine.types import RequestOutput


class LoopDelivery:
    """Hands engine outputs to one event loop in batches: the engine thread appends, and at most one
    wake-up of the loop is pending at a time, however many tokens a step produced.

    No lock: a deque's append and popleft are atomic, the producer appends before it looks at `_scheduled`,
    and the loop clears `_scheduled` before it drains — so an output appended while a flush is under way is
    either drained by it or finds the flag clear and schedules the next one. (A lock here was taken per token
    on the reader thread and fought over with the loop's flush: a GIL hand-over each time it was held.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: collections.deque[tuple[OutputStream, RequestOutput]] = collections.deque()
        self._scheduled = False

    def put(self, target: OutputStream, output: RequestOutput) -> None:
        """Engine thread (or the engine core's reader thread)."""
        self._pending.append((target, output))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        """Event-loop thread."""
        self._scheduled = False
        pending = self._pending
        for _ in range(len(pending)):  # (what arrives meanwhile waits for the flush it schedules)
            target, output = pending.popleft()
            target.arrived(output)


_deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDelivery] = weakref.WeakKeyDictionary()


def delivery_for(loop: asyncio.AbstractEventLoop) -> LoopDelivery:
    if loop not in _deliveries:
        _deliveries[loop] = LoopDelivery(loop)
    return _deliveries[loop]


class OutputStream:
    """Async iterator over one request's outputs; ends after `rows` finished outputs. Outputs wait in a deque;
    the reading task, when it finds none, waits on one future that the first arrival of a step resolves — a
    wake-up per step per stream, and no asyncio.Queue bookkeeping per token (the hot path at 32 streams)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rows: int) -> None:
        self._loop = loop
        self._delivery = delivery_for(loop)
        self._outputs: collections.deque[RequestOutput] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._open_rows = rows

    def sink(self, output: RequestOutput) -> None:
        """Called on the engine thread."""
        self._delivery.put(self, output)

    def arrived(self, output: RequestOutput) -> None:
        """Event-loop thread (LoopDelivery)."""
        self._outputs.append(output)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.batches():
            for output in batch:
                yield output

    @property
    def open(self) -> bool:
        """Some row has not sent its finished output yet."""
        return self._open_rows > 0

    async def next_batch(self) -> list[RequestOutput]:
        """Everything that has arrived, at least one output (call while `open`): a writer that fell behind sends
        the backlog in one write instead of one per token."""
        outputs = self._outputs
        while not outputs:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, open_rows = [], self._open_rows
        while outputs and open_rows > 0:
            output = outputs.popleft()
            batch.append(output)
            open_rows -= output.finish_reason is not None
        self._open_rows = open_rows
        return batch

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        while self._open_rows > 0:
            yield await self.next_batch()


def sse_event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, work: Callable[[], object]) -> tuple[bool, object]:
    """Run `work` (a coroutine function) unless the client disconnects first: (disconnected, result)."""
    result: dict[str, object] = {}
    async with anyio.create_task_group() as group:
        async def run_work() -> None:
            result["value"] = await work()
            group.cancel_scope.cancel()

        async def watch() -> None:
            await wait_for_disconnect(receive)
            result["disconnected"] = True
            group.cancel_scope.cancel()

        group.start_soon(run_work)
        group.start_soon(watch)
    return bool(result.get("disconnected")), result.get("value")


BODY_SEND = "linserve.body_send"  # scope key: the server's own `send` (app.LinserveAPI puts it there)


class EventStreamResponse(StreamingResponse):
    """`text/event-stream`, raced against the client's disconnect. Its body chunks go straight to the server's own
    `send` (`scope[BODY_SEND]`, when the app put it there) instead of through each middleware's send wrapper: the
    wrappers look only at `http.response.start`, which still passes through them, as does the body's end — one
    coroutine a chunk instead of five on a stream's hot path. (A middleware that rewrote bodies would have to
    drop BODY_SEND from the scope.)"""

    media_type = "text/event-stream"

    def __init__(self, content, **kwargs) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, media_type=self.media_type, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send = scope.get(BODY_SEND, send)

        async def stream() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                await self.stream_body(body_send)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client went away mid-write; the body has been closed

        try:
            await race_disconnect(receive, stream)
        finally:  # also when the client left before the first byte: what the request holds is given back
            if self.background is not None:
                await self.background()

    async def stream_body(self, send: Send) -> None:
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


class EventSource(Protocol):
    """What a `GenerationStreamResponse` writes: a generation's events, rendered per batch of outputs."""

    stream: OutputStream

    def first(self) -> bytes: ...  # before any output (may be empty)

    def render(self, batch: list[RequestOutput]) -> bytes: ...  # one batch's events (may be empty)

    def last(self) -> bytes: ...  # after the last output

    def close(self) -> None: ...  # however the response ended (a generation cut short is aborted)


class GenerationStreamResponse(EventStreamResponse):
    """An engine generation's SSE stream without an async generator between a step's outputs and the write: each
    wake-up of the stream's task renders what arrived and sends it."""

    def __init__(self, source: EventSource, **kwargs) -> None:
        super().__init__((), **kwargs)
        self.source = source

    async def stream_body(self, send: Send) -> None:
        source, stream = self.source, self.source.stream
        try:
            if first := source.first():
                await send({"type": "http.response.body", "body": first, "more_body": True})
            while stream.open:
                if data := source.render(await stream.next_batch()):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": source.last(), "more_body": True})
        finally:
            source.close()
