"""LoopLink: the engine core's connection read and written by the frontend's event loop, against a real
`multiprocessing` connection on the other end (what the core uses) — frames of every size arrive whole and in
order, a write never blocks the loop, both sides flooding each other at once still finish, and the core's end
is told once."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest

from linserve.server.engine_process.loop_link import LoopLink

LOOPS = ["asyncio", "uvloop"]  # uvicorn serves on uvloop where it is installed (uvicorn[standard])


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(kind: str, main, timeout: float = 60.0):
    loop = new_loop(kind)
    try:
        return loop.run_until_complete(asyncio.wait_for(main(loop), timeout))
    finally:
        loop.close()


def pair():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    return ours, theirs


class Received:
    def __init__(self, loop: asyncio.AbstractEventLoop, expected: int) -> None:
        self.messages: list[tuple] = []
        self.closed: list[BaseException] = []
        self.done = loop.create_future()
        self.expected = expected

    def message(self, message: tuple) -> None:
        self.messages.append(message)
        if len(self.messages) == self.expected and not self.done.done():
            self.done.set_result(None)

    def close(self, error: BaseException) -> None:
        self.closed.append(error)


@pytest.mark.parametrize("kind", LOOPS)
def test_frames_of_every_size_arrive_whole_and_in_order(kind):
    """Tiny frames many to a read, frames larger than the socket's buffers in many reads (48 MB: a session's
    state exported; received into one buffer of its size, not copied again at every read), and mixes of both."""
    sizes = [0, 1, 3, 100, 5_000, 70_000, 1_500_000, 2, 2, 2, 300_000, *([10] * 500), 4_000_000, 7, 48_000_000, 5]
    sent = [("batch", index, b"x" * size) for index, size in enumerate(sizes)]

    async def main(loop):
        ours, theirs = pair()
        received = Received(loop, len(sent))
        link = LoopLink(ours, loop, received.message, received.close)
        link.attach()  # (as RemoteEngine does from the thread that connected)
        writer = threading.Thread(target=lambda: [theirs.send(m) for m in sent])
        writer.start()
        await received.done
        writer.join()
        link.close()
        return received

    received = run(kind, main)
    assert received.messages == sent and not received.closed


@pytest.mark.parametrize("kind", LOOPS)
def test_a_write_never_blocks_the_loop_and_every_frame_arrives_in_order_from_each_thread(kind):
    """The core reads nothing for a while: 8 MB of frames from the loop and 2 MB from another thread queue up
    instead of blocking the loop, which keeps running; then the core reads each one, whole, in its thread's
    order."""
    big = b"y" * 200_000

    async def main(loop):
        ours, theirs = pair()
        link = LoopLink(ours, loop, lambda m: None, lambda e: None)
        link.start()
        started = time.monotonic()
        for index in range(40):
            link.send(("loop", index, big))
        queued_s = time.monotonic() - started
        other = threading.Thread(target=lambda: [link.send(("thread", index, big)) for index in range(10)])
        other.start()
        other.join()
        ticks = 0
        for _ in range(20):  # the loop runs on while the frames wait for the core
            await asyncio.sleep(0.005)
            ticks += 1
        got = await asyncio.to_thread(lambda: [theirs.recv() for _ in range(50)])
        link.close()
        return queued_s, ticks, got

    queued_s, ticks, got = run(kind, main)
    assert queued_s < 5 and ticks == 20
    assert [m[1] for m in got if m[0] == "loop"] == list(range(40))
    assert [m[1] for m in got if m[0] == "thread"] == list(range(10))
    assert all(m[2] == big for m in got)


@pytest.mark.parametrize("kind", LOOPS)
def test_both_sides_flooding_each_other_at_once_both_finish(kind):
    """The core writes 6 MB before it reads anything, while the frontend writes 6 MB to it: a loop blocked in its
    own write would never read the core's, and the core would never get to reading the frontend's."""
    chunk = b"z" * 100_000

    async def main(loop):
        ours, theirs = pair()
        received = Received(loop, 60)
        link = LoopLink(ours, loop, received.message, received.close)
        link.start()
        got: list[tuple] = []

        def core() -> None:
            for index in range(60):
                theirs.send(("core", index, chunk))
            got.extend(theirs.recv() for _ in range(60))

        thread = threading.Thread(target=core)
        thread.start()
        for index in range(60):
            link.send(("frontend", index, chunk))
        await received.done
        await asyncio.to_thread(thread.join, 30)
        link.close()
        return received, got, thread.is_alive()

    received, got, stuck = run(kind, main)
    assert not stuck
    assert [m[1] for m in received.messages] == list(range(60)) and [m[1] for m in got] == list(range(60))


@pytest.mark.parametrize("kind", LOOPS)
def test_the_cores_end_is_told_once_and_a_failing_handler_does_not_stop_the_next_message(kind):
    async def main(loop):
        ours, theirs = pair()
        seen, ends = [], []
        ended = loop.create_future()

        def handle(message):
            if message == ("bad",):
                raise ValueError("a handler's bug")
            seen.append(message)

        def closed(error):
            ends.append(error)
            ended.set_result(None)

        link = LoopLink(ours, loop, handle, closed)
        link.start()
        theirs.send(("bad",))
        theirs.send(("good",))
        theirs.close()
        await ended
        await asyncio.sleep(0.05)
        with pytest.raises(OSError):
            link.send(("late",))
        return seen, ends

    seen, ends = run(kind, main)
    assert seen == [("good",)] and len(ends) == 1 and isinstance(ends[0], EOFError)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_frame_that_takes_many_reads_is_received_into_one_buffer_of_its_size(kind):
    """Its bytes go straight into one allocation of the frame's size as they come (a buffer grown by
    concatenation at every read copied a 64 MB session export ~250 times: 11 s of the loop, against 0.26 s)."""
    from linserve.server.engine_process.loop_link import frame

    message = ("batch", b"e" * 10_000_000)
    data = frame(message)

    async def main(loop):
        ours, theirs = pair()
        received = Received(loop, 1)
        link = LoopLink(ours, loop, received.message, received.close)
        link.start()
        writer = socket_of(theirs)
        sending = asyncio.ensure_future(asyncio.to_thread(writer.sendall, data[:1_000_000]))
        while link._filled < 1_000_000 - 4:  # the loop reads what is there
            await asyncio.sleep(0.01)
        in_part = (len(link._frame), link._filled)
        await sending
        await asyncio.to_thread(writer.sendall, data[1_000_000:])
        await received.done
        writer.close()
        link.close()
        return in_part, received.messages

    (size, filled), messages = run(kind, main)
    assert size == len(data) - 4 and filled == 1_000_000 - 4  # the whole frame's room, part of it filled
    assert messages == [message]


def socket_of(conn):
    import os
    import socket

    return socket.socket(fileno=os.dup(conn.fileno()))
