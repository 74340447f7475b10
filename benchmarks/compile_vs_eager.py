"""What compiling the decode step buys when served: tokens/s of `--compile on` and `--compile off` servers of the
same model at 1 and 8 streams, side by side in one run (issue 36: is compile=auto's choice worth making?).

    python benchmarks/compile_vs_eager.py [--model DIR] [--slots 64] [--reps 3] [--quick] [--out FILE]

Two `linserve serve` processes on 127.0.0.1 (the compiled one waits until every bucket is ready); rounds
alternate between them, each round sending 1 stream × 512 tokens and 8 streams × 256 tokens through
`linserve bench`'s client (the P9 load); medians are compared. The compiled server also reports the
compile=auto verdict it would make (its /version), so the start-up measurement can be read against what
serving shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe, emit, resolve_device  # noqa: E402
from serving_overhead import http_rate, start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402

LOADS = ((1, 512), (8, 256))  # (streams, tokens per stream), as P9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--slots", type=int, default=64, help="the server's slots (default: serve's default)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument("--compile-cache-dir", help="the compiled server's cache (default: the user's)")
    parser.add_argument("--quick", action="store_true", help="1 slot (the one bucket the suite's other tests build), "
                        "decode only (no prefill program), a few tokens, one round, no autotune")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    loads, extra = LOADS, ["--log-level", "warning"]
    if args.quick:
        args.slots, args.reps, loads = 1, 1, tuple((streams, 8) for streams, _ in LOADS)
        extra += ["--no-compile-autotune", "--prefill-program-tokens", "0"]
    if args.compile_cache_dir:
        extra += ["--compile-cache-dir", args.compile_cache_dir]
    ports = {"compiled": args.port, "eager": args.port + 1}
    servers = {"compiled": start_server(args.model, ports["compiled"], args.slots, extra, compile="on"),
               "eager": start_server(args.model, ports["eager"], args.slots, compile="off")}
    rates = {(mode, streams): [] for mode in ports for streams, _ in loads}
    try:
        step = httpx.get(f"http://127.0.0.1:{ports['compiled']}/version").json()["decode_step"]
        for port in ports.values():
            http_rate(port, 1, 8)  # warm-up
        for rep in range(args.reps):
            order = list(ports) if rep % 2 == 0 else list(reversed(ports))
            for streams, tokens in loads:
                for mode in order:
                    rates[(mode, streams)].append(http_rate(ports[mode], streams, tokens)[0])
    finally:
        for server in servers.values():
            server.terminate()
            server.wait(30)
    result = {**describe(resolve_device("cpu")), "slots": args.slots, "reps": args.reps,
              "compiled_buckets": step["ready"], "compile_status": step["status"]}
    assert step["status"] == "compiled", step  # else the comparison is eager against eager
    for streams, tokens in loads:
        compiled = statistics.median(rates[("compiled", streams)])
        eager = statistics.median(rates[("eager", streams)])
        result[f"streams_{streams}"] = {"tokens_per_stream": tokens, "compiled_tokens_per_s": compiled,
                                        "eager_tokens_per_s": eager, "compiled_over_eager": compiled / eager,
                                        "compiled_runs": rates[("compiled", streams)],
                                        "eager_runs": rates[("eager", streams)]}
    emit(result, args.out)


if __name__ == "__main__":
    main()
