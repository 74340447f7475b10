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
