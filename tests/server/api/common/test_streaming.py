"""Engine outputs into the event loop (api/common/streaming.py): LoopDelivery hands a producer thread's outputs
to the loop without a lock — nothing may be lost or reordered however the producer's appends and the loop's
flushes interleave."""

from __future__ import annotations

import asyncio
import threading
import time

from starlette.middleware import Middleware

from linserve.server.api.common.streaming import OutputStream
from linserve.server.engine.types import FinishReason, RequestOutput


def test_every_output_reaches_its_stream_in_order_whatever_the_interleaving():
    streams, tokens = 16, 2_000

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        outputs = [OutputStream(loop, 1) for _ in range(streams)]

        def produce() -> None:  # a step's outputs for every stream, then the next step: the reader thread's pattern
            for position in range(tokens):
                last = position == tokens - 1
                for number, stream in enumerate(outputs):
                    stream.sink(RequestOutput(f"r{number}", 0, position, "x",
                                              finish_reason=FinishReason.LENGTH if last else None))
                if position % 97 == 0:
                    time.sleep(0.0005)  # let a flush run in the middle of the next step's appends

        async def consume(stream: OutputStream) -> list[int]:
            return [output.token_id async for output in stream]

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(consume(s) for s in outputs)), 60)
        finally:
            await asyncio.to_thread(producer.join)

    received = asyncio.run(run())
    assert all(tokens_of == list(range(tokens)) for tokens_of in received)


def test_an_output_put_while_the_loop_is_flushing_is_not_stranded():
    """The interleaving that a lock-free hand-over must get right, made to happen: the producer puts while the
    loop is inside a flush (after it took its batch). That output must get a flush of its own."""
    from linserve.server.api.common.streaming import LoopDelivery

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        delivery, flushing, second = LoopDelivery(loop), threading.Event(), loop.create_future()
        got: list[str] = []

        class Target:
            def arrived(self, output: str) -> None:
                got.append(output)
                if output == "first":
                    flushing.set()
                    time.sleep(0.2)  # the loop stays in this flush while the producer puts the next one
                else:
                    second.set_result(None)

        target = Target()

        def produce() -> None:
            delivery.put(target, "first")
            flushing.wait(10)
            delivery.put(target, "second")

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            await asyncio.wait_for(second, 10)
        finally:
            await asyncio.to_thread(producer.join)
        return got

    assert asyncio.run(run()) == ["first", "second"]


def test_outputs_put_on_the_loop_itself_need_no_wake_up_through_its_self_pipe():
    """The frontend's loop reads the engine core's channel itself (engine_process/loop_link.py): its puts schedule
    the flush with `call_soon`; another thread's (the in-process engine's) still wake the loop threadsafe — and
    every output arrives either way."""
    from linserve.server.api.common.streaming import LoopDelivery

    async def run() -> tuple[list[str], int, int]:
        loop = asyncio.get_running_loop()
        threadsafe = []
        wake = loop.call_soon_threadsafe
        delivery, got, arrived = LoopDelivery(loop), [], asyncio.Event()

        def counted(callback, *args):  # (the delivery's wake-ups counted, not to_thread's own)
            if callback == delivery._flush:
                threadsafe.append(callback)
            return wake(callback, *args)

        loop.call_soon_threadsafe = counted

        class Target:
            def arrived(self, output: str) -> bool:
                got.append(output)
                arrived.set()
                return False

        async def put(output: str, from_thread: bool) -> None:
            arrived.clear()
            if from_thread:
                await asyncio.to_thread(delivery.put, Target(), output)
            else:
                delivery.put(Target(), output)
            await asyncio.wait_for(arrived.wait(), 10)

        await put("from the engine thread", True)  # (the first flush tells the delivery its loop's thread)
        woken_before = len(threadsafe)
        for number in range(5):
            await put(f"on the loop {number}", False)
        on_loop = len(threadsafe) - woken_before
        await put("from the engine thread again", True)
        return got, on_loop, len(threadsafe) - woken_before

    got, on_loop, after = asyncio.run(run())
    assert got == ["from the engine thread", *(f"on the loop {n}" for n in range(5)), "from the engine thread again"]
    assert on_loop == 0 and after == 1


def test_outputs_put_on_the_loop_are_the_streams_at_once_and_each_stream_is_pushed_once_a_flush():
    """On the loop (the frontend reading the engine core's channel), a step's outputs are each stream's as they are
    put — no queue — and a stream written from the hand-over is pushed once, after the loop has dispatched all of
    them (one write a stream a step); an output put on the loop while another thread's wait in the queue goes
    behind them."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        streams = [OutputStream(loop, 1) for _ in range(3)]
        pushes: list[tuple[int, list[int]]] = []
        for number, stream in enumerate(streams):
            stream.push_to(lambda number=number, stream=stream: pushes.append(
                (number, [o.token_id for o in stream.take()])))
        delivery = streams[0]._delivery
        await asyncio.to_thread(streams[0].sink, RequestOutput("r0", 0, 0, "x"))  # (the loop's thread made known)
        await asyncio.sleep(0.05)
        assert pushes == [(0, [0])]
        pushes.clear()

        for position in (1, 2, 3):  # one read's frames: three steps for streams 0 and 1, one for stream 2
            for number in (0, 1):
                streams[number].sink(RequestOutput(f"r{number}", 0, position, "x"))
        streams[2].sink(RequestOutput("r2", 0, 1, "x"))
        assert [len(stream._outputs) for stream in streams] == [3, 3, 1] and not delivery._pending
        assert pushes == []  # (not before the loop has read everything that came)
        await asyncio.sleep(0)
        assert sorted(pushes) == [(0, [1, 2, 3]), (1, [1, 2, 3]), (2, [1])]
        pushes.clear()

        producer = threading.Thread(target=streams[2].sink, args=(RequestOutput("r2", 0, 2, "x"),))
        producer.start()
        producer.join()  # (another thread's output queued while the loop is busy here)
        streams[2].sink(RequestOutput("r2", 0, 3, "x", finish_reason=FinishReason.LENGTH))
        assert len(delivery._pending) == 2 and not streams[2]._outputs
        await asyncio.sleep(0.05)
        assert pushes == [(2, [2, 3])] and not streams[2].open

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_stream_s_start_passes_every_middleware_and_its_chunks_go_straight_to_the_server(make_client):
    """An SSE stream's `http.response.start` and its end go through the middlewares' send wrappers (the status
    they record, the X-Request-Id they add), its body chunks straight to the server's own send (BODY_SEND):
    one coroutine a chunk, not five."""
    client = make_client()
    seen: list[str] = []

    class Watch:  # a pass-through middleware, as RequestMetrics and ServerErrors are
        def __init__(self, app) -> None:
            self.app = app

        async def __call__(self, scope, receive, send) -> None:
            async def watching(message) -> None:
                seen.append(message["type"] + ("" if message.get("more_body") else ":end")
                            if message["type"] == "http.response.body" else message["type"])
                await send(message)

            await self.app(scope, receive, watching)

    app = client.app
    app.user_middleware.insert(0, Middleware(Watch))
    app.middleware_stack = app.build_middleware_stack()
    body = {"prompt": "HAMLET.", "max_tokens": 12, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and response.headers["x-request-id"]
    assert len(events) == 12 + 1 and events[-1] == "data: [DONE]"
    assert seen == ["http.response.start", "http.response.body:end"], seen
    metrics = client.get("/metrics").text
    assert 'linserve_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics


def test_send_now_runs_a_send_to_its_end_or_hands_back_what_finishes_it():
    """A server's send called from a loop callback: run to its end when it does not wait; else the rest of it, for
    a task to await — resumed where it stopped, and a cancellation of that task thrown into it."""
    from linserve.server.api.common.streaming import send_now

    async def run() -> list:
        loop = asyncio.get_running_loop()
        log, gate = [], loop.create_future()

        async def send(message):
            if message == "waits":
                log.append(await gate)  # the transport's buffer is full: its flow control waits
            log.append(message)

        assert send_now(send, "at once") is None and log == ["at once"]
        rest = send_now(send, "waits")
        assert rest is not None and log == ["at once"]
        loop.call_later(0.01, gate.set_result, "drained")
        await rest
        assert log == ["at once", "drained", "waits"]

        stuck = loop.create_future()

        async def send_until_cancelled(message):
            try:
                await stuck
            except asyncio.CancelledError:
                log.append("cancelled inside")
                raise

        task = asyncio.ensure_future(send_now(send_until_cancelled, "never"))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            log.append("task cancelled")
        return log

    assert asyncio.run(run())[-2:] == ["cancelled inside", "task cancelled"]


def test_a_stream_written_from_the_hand_over_gives_way_to_its_task_when_a_write_must_wait(monkeypatch):
    """The hand-over writes each step's events itself (no task in the send) until a write has to wait (a client
    not reading): then the task finishes that write and sends the backlog in one write; every token arrives, in
    order, and the last events close the stream."""
    from linserve.server.api.common import streaming
    from linserve.server.api.common.streaming import GenerationStreamResponse, OutputStream

    monkeypatch.setattr(streaming, "sends_outside_a_task", lambda send: True)  # (a plain send, as uvicorn's is)
    tokens = 20

    async def run() -> list[tuple[bytes, bool]]:
        loop = asyncio.get_running_loop()
        stream, gate, produced = OutputStream(loop, 1), loop.create_future(), threading.Event()

        class Source:
            def __init__(self) -> None:
                self.stream, self.closed = stream, False

            def first(self) -> bytes:
                return b""

            def render(self, batch) -> bytes:
                return b"".join(b"%d;" % output.token_id for output in batch)

            def last(self) -> bytes:
                return b"end"

            def close(self) -> None:
                self.closed = True

        sent: list[tuple[bytes, bool]] = []  # (body, whether a task sent it)

        async def send(message) -> None:
            if message["type"] == "http.response.start":  # (the task reaches its first wait without yielding)
                producer.start()
            if message["type"] == "http.response.body":
                sent.append((message["body"], asyncio.current_task() is not None))
                if b"3;" in message["body"]:
                    await gate  # the client stops reading: this write waits

        async def receive():
            await loop.create_future()  # the client never leaves

        def produce() -> None:
            for position in range(tokens):
                stream.sink(RequestOutput("r", 0, position, "x",
                                          finish_reason=FinishReason.LENGTH if position == tokens - 1 else None))
                time.sleep(0.003)
            produced.set()

        source = Source()
        producer = threading.Thread(target=produce)
        serving = asyncio.ensure_future(GenerationStreamResponse(source)({"type": "http"}, receive, send))
        await asyncio.to_thread(produced.wait, 10)
        gate.set_result(None)  # the client reads again
        await asyncio.wait_for(serving, 10)
        await asyncio.to_thread(producer.join)
        assert source.closed
        return sent

    sent = asyncio.run(run())
    bodies = [body for body, _ in sent]
    assert b"".join(bodies[:-2]) == b"".join(b"%d;" % t for t in range(tokens)) and bodies[-2:] == [b"end", b""]
    waited = next(i for i, body in enumerate(bodies) if b"3;" in body)
    assert not any(in_task for _, in_task in sent[:waited + 1])  # written from the hand-over, the wait's too
    backlog, in_task = sent[waited + 1]
    assert in_task and backlog.count(b";") > 1  # the task took over: what queued meanwhile, in one write


def test_chunks_written_straight_to_uvicorns_transport_arrive_whole_and_in_order_past_a_paused_transport(monkeypatch):
    """A real uvicorn (httptools) serving a generation's stream to a socket that reads nothing until the last token
    has been produced: the hand-over writes chunks straight to the transport (`chunk_writer`) until it pauses, then
    the send takes over, and the chunked body the client finally reads is every token's bytes, in order, once."""
    import socket

    import uvicorn

    from linserve.server.api.common import streaming
    from linserve.server.api.common.streaming import GenerationStreamResponse
    from tests.helpers import free_port

    tokens, size = 400, 32 * 1024
    direct = {True: 0, False: 0}
    made = streaming.chunk_writer

    def counted(send):
        write = made(send)
        assert write is not None, "uvicorn's httptools send should be written to directly"

        def count(data: bytes) -> bool:
            written = write(data)
            direct[written] += 1
            return written

        return count

    monkeypatch.setattr(streaming, "chunk_writer", counted)
    produced = threading.Event()

    def token_bytes(position: int) -> bytes:
        return (b"%06d" % position) * (size // 6)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        stream = OutputStream(asyncio.get_running_loop(), 1)

        class Source:
            def __init__(self) -> None:
                self.stream = stream

            def first(self) -> bytes:
                threading.Thread(target=produce, daemon=True).start()
                return b""

            def render(self, batch) -> bytes:
                return b"".join(token_bytes(output.token_id) for output in batch)

            def last(self) -> bytes:
                return b"end"

            def close(self) -> None:
                pass

        def produce() -> None:
            for position in range(tokens):
                stream.sink(RequestOutput("r", 0, position, "x",
                                          finish_reason=FinishReason.LENGTH if position == tokens - 1 else None))
                time.sleep(0.001)
            produced.set()

        await GenerationStreamResponse(Source())(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", loop="asyncio",
                                           log_level="warning", lifespan="off"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and serving.is_alive()
            time.sleep(0.02)
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", port))
            client.sendall(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            assert produced.wait(60)  # nothing read until every token has been handed over
            received = bytearray()
            client.settimeout(60)
            while chunk := client.recv(1 << 20):
                received += chunk
    finally:
        server.should_exit = True
        serving.join(30)
    head, _, chunked = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    body, rest = bytearray(), chunked
    while True:  # the chunked framing, every chunk checked
        length, _, rest = rest.partition(b"\r\n")
        n = int(length, 16)
        if n == 0:
            assert rest == b"\r\n"
            break
        body += rest[:n]
        assert rest[n:n + 2] == b"\r\n"
        rest = rest[n + 2:]
    assert bytes(body) == b"".join(token_bytes(position) for position in range(tokens)) + b"end"
    assert direct[True] > 0 and direct[False] > 0, direct  # straight to the transport, and the send once it paused


def test_a_finished_stream_is_freed_when_its_request_lets_go_not_by_the_garbage_collector():
    """No reference cycle through a stream (its sink is made for the engine, not kept): a request's stream and its
    outputs go when the last reference does — nothing per request waits for a collector's walk (engine/heap.py)."""
    import gc
    import weakref

    async def run() -> weakref.ref:
        stream = OutputStream(asyncio.get_running_loop(), 1)
        sink = stream.sink  # what the engine holds while the request runs
        sink(RequestOutput("r", 0, 7, "x"))
        sink(RequestOutput("r", 0, 8, "y", finish_reason=FinishReason.STOP))
        assert [output.token_id async for output in stream] == [7, 8]
        del sink  # the engine lets go once the request is finished
        return weakref.ref(stream)

    gc.disable()
    try:
        gone = asyncio.run(run())
        assert gone() is None
    finally:
        gc.enable()
