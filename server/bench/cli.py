"""Argument handling of `linserve bench`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--compare", metavar="URL", help="run the identical load against this server too")
    parser.add_argument("--model", help="model id [default: the first of /v1/models]")
    parser.add_argument("--api-key", help="Bearer key, if the server requires one")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=1, help="closed loop: requests in flight")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--requests", type=int, default=16, help="requests to measure (after warm-up)")
    parser.add_argument("--duration", type=float, help="stop issuing after this many seconds")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first and not measured")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of each request")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates at most")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate max-tokens even past end-of-text")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and of each request's sampling")
    parser.add_argument("--processes", type=int,
                        help="load-generator processes sharing the load [default: 1 below 8 CPUs, else one per 8 "
                             "streams, at most a quarter of the CPUs and 8]")
    parser.add_argument("--bin", type=int, help="position bin width for ITL vs position [default: max_tokens/16]")
    parser.add_argument("--out", default="bench.json", help="JSON result")
    parser.add_argument("--plot", default="bench.png", help="PNG plot")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .client import BenchError, LoadSpec, server_info
    from .processes import drive
    from .report import plot, render_text, summarize
    targets = [("A", args.url)] + ([("B", args.compare)] if args.compare else [])
    results = {}
    for label, url in targets:
        spec = LoadSpec(url=url.rstrip("/"), model=args.model, api_key=args.api_key,
                        concurrency=None if args.rate else args.concurrency, rate=args.rate,
                        requests=args.requests if args.duration is None else None, duration_s=args.duration,
                        warmup=args.warmup, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                        ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed)
        bar = tqdm(total=spec.requests, desc=f"bench {label}", unit="req", dynamic_ncols=True, file=sys.stderr)
        try:
            run = drive(spec, lambda record, bar=bar: bar.update(1), args.processes)
        except BenchError as error:
            bar.close()
            print(f"error: {error}", file=sys.stderr)
            return 2
        bar.close()
        result = summarize(spec, run, args.bin or max(args.max_tokens // 16, 1))
        result["server"] = server_info(spec)  # threads, dtype, decode step: what the figures were measured with
        results[f"{label} {url}"] = result
        print(render_text(label, result))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    try:
        plot(results, args.plot)
        print(f"wrote {args.out} and {args.plot}")
    except ImportError:  # the server image leaves plotting out: pip install 'linserve[bench]'
        print(f"wrote {args.out} (no plot: matplotlib is not installed; pip install 'linserve[bench]')")
    failed = any(r["succeeded"] < r["requests"] for r in results.values())
    if failed:
        print("error: some requests failed (see errors_by_status)", file=sys.stderr)
    return 1 if failed else 0
