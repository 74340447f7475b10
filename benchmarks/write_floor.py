"""The floor under a streaming frontend's CPU a token: what one SSE chunk written to each of N loopback TCP
connections a step costs the writing process when it does nothing else — uvloop's `transport.write` of a
completions chunk (chunked framing included) per stream, a step every PERIOD seconds, a client process reading
every stream. linserve's frontend writes exactly that per streamed token; everything it spends above this floor
is its own work (reading the engine core's channel, the outputs, the chunks' JSON).

    python benchmarks/write_floor.py [--streams 32] [--steps 2000] [--period-ms 6] [--quick] [--out FILE]

Prints (and writes with --out) the writer's CPU µs a write, its user and kernel parts. On loopback the kernel part
includes the client's receive path (the sender's softirq delivers each segment), which a remote client's host
would carry instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import socket
import sys
import time

import uvloop

CHUNK = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1700000000,'
         b'"model":"linear-gpt","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}\n\n')
FRAME = b"%x\r\n%b\r\n" % (len(CHUNK), CHUNK)  # (HTTP/1.1 chunked framing, as uvicorn writes a body chunk)


def read_all(port: int, streams: int, total: int) -> None:
    """The client process: one connection a stream, each read until `total` bytes have come."""

    async def main() -> None:
        async def one() -> None:
            reader, _ = await asyncio.open_connection("127.0.0.1", port)
            got = 0
            while got < total:
                data = await reader.read(65536)
                if not data:
                    return
                got += len(data)

        await asyncio.gather(*(one() for _ in range(streams)))

    uvloop.run(main())


async def write_steps(streams: int, steps: int, period_s: float) -> dict:
    loop = asyncio.get_running_loop()
    transports: list[asyncio.Transport] = []
    connected = asyncio.Event()

    class Writer(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (uvicorn's)
            transports.append(transport)
            if len(transports) == streams:
                connected.set()

    server = await loop.create_server(Writer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = multiprocessing.get_context("spawn").Process(target=read_all, args=(port, streams, steps * len(FRAME)))
    client.start()
    await asyncio.wait_for(connected.wait(), 60)
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        for transport in transports:
            transport.write(FRAME)
        await asyncio.sleep(period_s)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    await asyncio.to_thread(client.join, 60)
    server.close()
    writes = steps * streams
    user, kernel = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {"streams": streams, "steps": steps, "period_ms": 1e3 * period_s, "wall_s": wall,
            "chunk_bytes": len(FRAME), "us_per_write": 1e6 * (user + kernel) / writes,
            "user_us_per_write": 1e6 * user / writes, "kernel_us_per_write": 1e6 * kernel / writes}


def measure(streams: int, steps: int, period_s: float) -> dict:
    return uvloop.run(write_steps(streams, steps, period_s))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--period-ms", type=float, default=6.0, help="time between steps (a decode step's)")
    parser.add_argument("--quick", action="store_true", help="4 streams, 50 steps: that it runs")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.steps = 4, 50
    result = measure(args.streams, args.steps, args.period_ms / 1e3)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
