"""Priorities (issue 32): under a saturated server a high-priority request's TTFT stays near an idle server's.

One `linserve serve --scheduling-policy priority` (the shipped model, `--num-slots` slots). First the TTFT of a
lone request (idle). Then the server is saturated: every slot streams, and a queue of `--queued` requests
(priority 0) waits behind them, refilled as they finish; into that, `--probes` requests one after another at
priority -10 and as many at priority 0 (interleaved), each one's TTFT measured. Reported: median TTFT per kind
and each over idle. Without preemption the urgent request waits for the next slot to turn free (rows end every
few steps here), not for the queue.

    python benchmarks/priority_ttft.py [--quick] [--out benchmarks/results/priority_ttft.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import add_compile_argument, emit  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402


async def ttft(client: httpx.AsyncClient, priority: int, tokens: int) -> float:
    body = {"prompt": "KING.\nWhat say you", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "priority": priority}
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    return first - sent


async def measure(port: int, slots: int, queued: int, probes: int, tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                 limits=httpx.Limits(max_connections=slots + queued + 8)) as client:
        idle = [await ttft(client, 0, 4) for _ in range(probes)]
        stop = asyncio.Event()

        async def background() -> None:  # keeps every slot busy and `queued` requests waiting
            while not stop.is_set():
                await ttft(client, 0, tokens)

        workers = [asyncio.create_task(background()) for _ in range(slots + queued)]
        await asyncio.sleep(2.0)  # the queue has formed
        urgent, ordinary = [], []
        for _ in range(probes):
            urgent.append(await ttft(client, -10, 4))
            ordinary.append(await ttft(client, 0, 4))
        stop.set()
        await asyncio.gather(*workers)
    med = {name: statistics.median(values) * 1e3 for name, values in
           (("idle", idle), ("urgent", urgent), ("ordinary", ordinary))}
    return {"ttft_ms_median": med, "urgent_over_idle": med["urgent"] / med["idle"],
            "ordinary_over_idle": med["ordinary"] / med["idle"],
            "ttft_ms": {"idle": idle, "urgent": urgent, "ordinary": ordinary}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--queued", type=int, default=32)
    parser.add_argument("--probes", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64, help="tokens of each background request")
    parser.add_argument("--port", type=int, default=8798)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests, eager (tests)")
    parser.add_argument("--out")
    add_compile_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.queued, args.probes, args.tokens, args.compile = 8, 3, 16, "off"
    server = start_server(args.model, args.port, args.slots, compile=args.compile,
                          extra=["--scheduling-policy", "priority", "--reserved-slots", "1", "--max-n", "1",
                                 "--log-level", "warning"], env={"LINSERVE_SESSION_STORE": "none"})
    try:
        result = asyncio.run(measure(args.port, args.slots, args.queued, args.probes, args.tokens))
    finally:
        server.terminate()
        server.wait(30)
    emit({"slots": args.slots, "queued": args.queued, "tokens": args.tokens, "compile": args.compile,
          "priority": result}, args.out)
    print(json.dumps(result["ttft_ms_median"]))


if __name__ == "__main__":
    main()
