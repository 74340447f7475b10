"""Engine outputs into asyncio, and a server-sent-events response that notices a client leaving.

The engine calls a sink on its own thread, or the loop calls it as it reads the engine core's channel
(engine_process/loop_link.py); `LoopDelivery` hands each output to its `OutputStream` on the event loop — from
another thread with one `call_soon_threadsafe` a step, on the loop at once. `EventStreamResponse` writes
events while a second task waits for the ASGI `http.disconnect` message: whichever finishes first cancels the
other, so a client that goes away cancels its generation at once (the generator's `finally` aborts it in the
engine), even while no token is being written.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
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
        self._pushed: list[OutputStream] = []  # streams to push at the next flush (loop thread only)
        self._scheduled = False
        self._loop_thread: int | None = None  # the loop's thread, known from its first flush

    def put(self, target: OutputStream, output: RequestOutput) -> None:
        """Engine thread, or the loop itself (it reads the engine core's connection: engine_process/loop_link.py).
        On the loop, with nothing from another thread queued before it, the output is the stream's at once — no
        wake-up through the loop's self-pipe, no queue — and the stream is pushed by the flush that runs once the
        loop has read all that arrived (each of a step's streams gets its outputs in one write)."""
        on_loop = threading.get_ident() == self._loop_thread
        if on_loop and not self._pending:
            if target.arrived(output):
                self._pushed.append(target)
        else:
            self._pending.append((target, output))
        if not self._scheduled:
            self._scheduled = True
            (self._loop.call_soon if on_loop else self._loop.call_soon_threadsafe)(self._flush)

    def _flush(self) -> None:
        """Event-loop thread. A stream written from the hand-over (`OutputStream.push_to`) gets what arrived for it
        once the drain is done: a step's outputs for it in one write."""
        self._loop_thread = threading.get_ident()
        self._scheduled = False
        pending, pushed = self._pending, self._pushed
        self._pushed = []
        for _ in range(len(pending)):  # (what arrives meanwhile waits for the flush it schedules)
            target, output = pending.popleft()
            if target.arrived(output):
                pushed.append(target)
        for target in pushed:  # (the stream's push, written out here: a call fewer a token)
            target._push_due = False
            if target._pusher is not None:
                target._pusher()


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
        self._pusher: Callable[[], None] | None = None  # writes what arrived, from the hand-over (push_to)
        self._push_due = False  # a push is owed for outputs that arrived in the flush under way

    @property
    def sink(self) -> Callable[[RequestOutput], None]:
        """The engine's sink for this stream (its thread, or the loop's): the delivery's `put` bound to it, with no
        Python frame of its own a token. Made for the caller, not kept: a stream that held its own sink would be a
        reference cycle — freed by the garbage collector's walks instead of when its request ends (docs/engine.md,
        "The collector's pauses")."""
        return functools.partial(self._delivery.put, self)

    def arrived(self, output: RequestOutput) -> bool:
        """Event-loop thread (LoopDelivery). True: push this stream once the flush has handed out its outputs."""
        self._outputs.append(output)
        if self._pusher is not None:
            due, self._push_due = self._push_due, True
            return not due
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        return False

    def push_to(self, pusher: Callable[[], None] | None) -> None:
        """While set (call with nothing pending), each flush that brings outputs calls `pusher()` once, in the
        flush, instead of waking the reading task; None: back to `next_batch`."""
        self._pusher, self._push_due = pusher, False

    def take(self) -> list[RequestOutput]:
        """Everything that has arrived (maybe nothing), up to the last row's finished output."""
        outputs, batch, open_rows = self._outputs, [], self._open_rows
        while outputs and open_rows > 0:
            output = outputs.popleft()
            batch.append(output)
            open_rows -= output.finish_reason is not None
        self._open_rows = open_rows
        return batch

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
        return self.take()

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
    """An engine generation's SSE stream, written from the loop's hand-over of each step's outputs: while nothing
    is waiting, the stream's task sleeps and each flush renders what arrived for it and sends it then and there
    (`send_now`: the server's send runs to its end unless it has to wait) — no task wake-up, future or coroutine
    chain a step. The task takes over whenever a write has to wait (a client reading slower than the stream: the
    transport's buffer full), when the generation ends (the last events, the end through every middleware) and
    when something raises; it races the client's disconnect throughout, as every event stream does. Only a
    server's send known to run outside a task is called from the hand-over (`sends_outside_a_task`: uvicorn's);
    any other — a test client's, which needs anyio's task — is awaited by the task, a wake-up a step."""

    def __init__(self, source: EventSource, **kwargs) -> None:
        super().__init__((), **kwargs)
        self.source = source
        self._send: Send | None = None
        self._write: Callable[[bytes], bool] | None = None  # the body chunk straight to the transport, if it can
        self._woken: asyncio.Future | None = None  # the task's: a write to finish, an error, or None: the end

    async def stream_body(self, send: Send) -> None:
        source, stream = self.source, self.source.stream
        self._send = send
        try:
            if first := source.first():
                await send({"type": "http.response.body", "body": first, "more_body": True})
            pushes = sends_outside_a_task(send)
            self._write = chunk_writer(send) if pushes else None
            while stream.open:
                if not pushes:
                    batch = await stream.next_batch()
                elif not (batch := stream.take()):  # nothing pending: the flushes write from here on
                    if (unfinished := await self._pushed(stream)) is not None:
                        await unfinished  # a write that had to wait, finished here; then the task reads again
                    continue
                if data := source.render(batch):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": source.last(), "more_body": True})
        finally:
            source.close()

    async def _pushed(self, stream: OutputStream) -> Awaitable[None] | None:
        """Let the flushes write until the task must take over: what `_push` woke it with."""
        self._woken = woken = asyncio.get_running_loop().create_future()
        stream.push_to(self._push)
        try:
            return await woken
        finally:
            stream.push_to(None)

    def _push(self) -> None:
        """The loop's flush brought outputs: render and send them now; wake the task when it must take over."""
        woken = self._woken
        if woken is None or woken.done():
            return
        try:
            unfinished, write = None, self._write
            if (data := self.source.render(self.source.stream.take())) and (write is None or not write(data)):
                unfinished = send_now(self._send, {"type": "http.response.body", "body": data, "more_body": True})
            if unfinished is not None or not self.source.stream.open:
                woken.set_result(unfinished)
        except BaseException as error:  # noqa: BLE001 - the task raises it (a client gone: OSError, as before)
            woken.set_exception(error)


def sends_outside_a_task(send: Send) -> bool:
    """Whether `send` is an ASGI server's own that needs no task to run in: uvicorn's HTTP protocols' (a transport
    write, or a wait on its flow control's event), which `send_now` may call from a loop callback."""
    return type(getattr(send, "__self__", None)).__module__.startswith("uvicorn.protocols.http.")


HTTPTOOLS_CYCLE = "uvicorn.protocols.http.httptools_impl"  # its RequestResponseCycle's send, read by chunk_writer


def chunk_writer(send: Send) -> Callable[[bytes], bool] | None:
    """For uvicorn's httptools protocol (its default where httptools is installed), called once the response has
    started: a function that writes one body chunk of the chunked, unfinished response straight to the transport —
    the bytes its `send` would write (`size-in-hex CRLF data CRLF`) without the message dict, the coroutine and its
    checks a token — and says False, writing nothing, whenever `send` itself must run: the transport paused (a client
    not reading), the client gone, the response already complete. None for a response that is not chunked and for
    any other server's send (h11's frames through its own state machine)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != HTTPTOOLS_CYCLE or not all(
            hasattr(cycle, name) for name in ("transport", "flow", "disconnected", "chunked_encoding",
                                              "response_complete", "scope")):
        return None
    if cycle.scope.get("method") == "HEAD" or not cycle.chunked_encoding:  # (fixed once the response has started)
        return None
    transport, flow = cycle.transport, cycle.flow

    def write(data: bytes) -> bool:
        if flow.write_paused or cycle.disconnected or cycle.response_complete:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    return write


def send_now(send: Send, message: dict) -> Awaitable[None] | None:
    """`await send(message)` run to its end right here when it does not have to wait (None); else an awaitable
    that finishes it — the coroutine resumed where it stopped, as a task would."""
    coroutine = send(message)
    if not hasattr(coroutine, "send"):  # (an awaitable that is not a coroutine: the task awaits it)
        return coroutine
    try:
        waiting_on = coroutine.send(None)
    except StopIteration:
        return None
    return _finish(coroutine, waiting_on)


async def _finish(coroutine, waiting_on) -> None:
    """Drive a started coroutine to its end from a task: what it yielded (an asyncio future, or None for a bare
    yield) awaited here, then it resumes; an exception raised while waiting (the task cancelled) goes into it."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                waiting_on._asyncio_future_blocking = False  # (given back to a task: as Task.__step does)
                await waiting_on
        except BaseException as error:  # noqa: BLE001 - into the coroutine, which decides
            try:
                waiting_on = coroutine.throw(error)
            except StopIteration:
                return
            continue
        try:
            waiting_on = coroutine.send(None)
        except StopIteration:
            return
