"""SPEC P14 — constrained decoding: a JSON-schema-constrained stream's inter-token latency ≤ 1.25× an
unconstrained one, at 1 and 32 streams, and 100% of constrained outputs validate.

One `linserve serve` (the shipped model, the decode step compiled as `serve` does by default); the same load
— N concurrent SSE streams of `--tokens` tokens from the same prompt — with and without
`response_format: json_schema` (an object with a required string field and an integer, so the text is
mostly the string and the budget closes the object at the end), interleaved over `--reps` rounds. ITL
p50 / p99 per mode from the tokens' arrival times; every constrained output is parsed and validated.

    python benchmarks/p14_constrained.py [--quick] [--out benchmarks/results/p14_constrained.json]
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
import jsonschema  # noqa: E402
from common import add_compile_argument, emit, percentile  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402

TARGET = 1.25
SCHEMA = {"type": "object", "properties": {"speech": {"type": "string"}, "act": {"type": "integer"}},
          "required": ["speech", "act"]}


async def stream(client: httpx.AsyncClient, tokens: int, constrained: bool, seed: int) -> tuple[list[float], str]:
    body = {"prompt": "ROMEO.\nBut soft, what light", "max_tokens": tokens, "stream": True, "temperature": 0.8,
            "seed": seed}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "line", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    arrivals, text = [], []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return [b - a for a, b in zip(arrivals, arrivals[1:])], "".join(text)


async def load(port: int, streams: int, tokens: int, constrained: bool, round_number: int):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        return await asyncio.gather(*(stream(client, tokens, constrained, 1000 * round_number + i)
                                      for i in range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--port", type=int, default=8793)
    parser.add_argument("--quick", action="store_true", help="short streams, one round, eager (tests)")
    parser.add_argument("--out")
    add_compile_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.reps, args.compile, args.streams = 48, 1, "off", [1, 4]
    server = start_server(args.model, args.port, max(64, max(args.streams)), compile=args.compile,
                          env={"LINSERVE_SESSION_STORE": "none"})
    result: dict = {"tokens": args.tokens, "reps": args.reps, "compile": args.compile, "P14": {}}
    try:
        asyncio.run(load(args.port, 1, 16, True, 99))  # warm: the grammar runtime, the compiled buckets
        valid = total = 0
        for streams in args.streams:
            gaps = {False: [], True: []}
            for round_number in range(args.reps):
                for constrained in (False, True):
                    for row_gaps, text in asyncio.run(load(args.port, streams, args.tokens, constrained,
                                                           round_number)):
                        gaps[constrained] += row_gaps
                        if constrained:
                            total += 1
                            try:
                                jsonschema.validate(json.loads(text), SCHEMA)
                                valid += 1
                            except (ValueError, jsonschema.ValidationError):
                                pass
            ms = {mode: {"p50": 1e3 * statistics.median(g), "p99": 1e3 * percentile(g, 0.99)}
                  for mode, g in gaps.items()}
            ratio = ms[True]["p50"] / ms[False]["p50"]
            result["P14"][f"streams_{streams}"] = {
                "unconstrained_itl_ms": {k: round(v, 3) for k, v in ms[False].items()},
                "constrained_itl_ms": {k: round(v, 3) for k, v in ms[True].items()},
                "p99_ratio": round(ms[True]["p99"] / ms[False]["p99"], 3),
                "ratio": round(ratio, 3), "target": f"<= {TARGET}x", "pass": ratio <= TARGET}
        result["P14"]["valid"] = {"measured": f"{valid}/{total}", "target": "100%", "pass": valid == total}
    finally:
        server.terminate()
        server.wait(30)
    emit(result, args.out)


if __name__ == "__main__":
    main()
