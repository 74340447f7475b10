"""Engine outputs into the event loop (api/common/streaming.py): LoopDelivery hands a producer thread's outputs
to the loop without a lock — nothing may be lost or reordered however the producer's appends and the loop's
flushes interleave."""

from __future__ import annotations

import asyncio
import threading
import time

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
