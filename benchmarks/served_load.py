"""SPEC P11 (on a GPU) — a served load at 1, 32 and 128 streams: `linserve bench`'s client against
`linserve serve` on 127.0.0.1, once the decode step is compiled (or settled on eager).

    python benchmarks/served_load.py [--device cuda] [--streams 1 32 128] [--tokens 512] [--reps 2] [--quick]
                                     [--api-servers N [N ...]] [--compile-wait SECONDS]

Targets (SPEC P11, GPU only): 1-stream ITL p50 ≤ 0.8 ms, ≥ 20,000 tokens/s at 32 streams, ≥ 40,000 at 128.
On CPU the same figures are reported without targets. `--api-servers`: one server per value, in turn (the
figures under `placements`, keyed `api_servers_N`); unset, one server with its default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import add_compile_argument, add_device_argument, emit, ready_programs, resolve_device  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402
from linserve.server.bench.report import summarize  # noqa: E402

P11 = {1: ("itl_p50_ms", 0.8, "<="), 32: ("tokens_per_s", 20_000, ">="), 128: ("tokens_per_s", 40_000, ">=")}


def measure(port: int, streams: int, tokens: int) -> dict:
    spec = LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=streams, requests=streams, warmup=0,
                    prompt_tokens=32, max_tokens=tokens, ignore_eos=True, temperature=0.8)
    run = drive(spec)
    records = run.records
    failed = [r.error or r.status for r in records if not r.ok]
    assert not failed, failed[:3]
    summary = summarize(spec, run, max(tokens // 16, 1))
    return {"tokens_per_s": summary["token_throughput_per_s"], "itl_p50_ms": summary["itl_ms"]["p50"],
            "itl_p99_ms": summary["itl_ms"]["p99"], "ttft_p50_ms": summary["ttft_ms"]["p50"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, help="linserve serve --threads [default: the server's default]")
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument("--quick", action="store_true", help="short loads, one repetition, eager (tests)")
    parser.add_argument("--out")
    parser.add_argument("--compile-wait", type=float, metavar="SECONDS",
                        help="measure after this long even if buckets are still compiling (a GPU's lease is "
                        "short; /ready's programs are recorded before and after the loads) [default: wait for all]")
    parser.add_argument("--api-servers", type=int, nargs="+",
                        help="linserve serve --api-servers, one server per value in turn [default: the server's]")
    add_device_argument(parser)
    add_compile_argument(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.quick:
        args.tokens, args.reps, args.compile = 16, 1, "off"
    placements = {f"api_servers_{n}": n for n in args.api_servers} if args.api_servers else {"default": None}
    result = {"device": device.type, "tokens_per_stream": args.tokens, "reps": args.reps}
    if len(placements) == 1:
        result.update(serve_and_measure(args, device, next(iter(placements.values()))))
    else:
        result["placements"] = {}
        for where, frontends in placements.items():
            result["placements"][where] = serve_and_measure(args, device, frontends)
            if args.out:  # each server's figures kept as they come (a lease's deadline may end the run)
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    emit(result, args.out)


def serve_and_measure(args, device, frontends: int | None) -> dict:
    """One server (`frontends`: its --api-servers, None: its default), each load `reps` times: its figures."""
    slots = max(64, max(args.streams))
    extra = ["--log-level", "warning", *(["--threads", str(args.threads)] if args.threads else []),
             *(["--api-servers", str(frontends)] if frontends is not None else [])]
    server = start_server(args.model, args.port, slots, extra=extra, env={"LINSERVE_SESSION_STORE": "none"},
                          device=device.type, compile=args.compile, compile_wait_s=args.compile_wait)
    ready = f"http://127.0.0.1:{args.port}/ready"
    programs = {"at_start": ready_programs(ready)}
    runs: dict[int, list[dict]] = {n: [] for n in args.streams}
    try:
        version = httpx.get(f"http://127.0.0.1:{args.port}/version", timeout=10).json()
        measure(args.port, 1, 8)  # warm-up
        for _ in range(args.reps):
            for n in args.streams:
                runs[n].append(measure(args.port, n, args.tokens))
        programs["at_end"] = ready_programs(ready)
    finally:
        server.terminate()
        server.wait(30)
    loads = {}
    for n, samples in runs.items():
        loads[f"streams_{n}"] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        loads[f"streams_{n}"]["tokens_per_s_spread"] = [min(s["tokens_per_s"] for s in samples),
                                                        max(s["tokens_per_s"] for s in samples)]
    result = {"server": {k: version.get(k) for k in ("device", "dtype", "threads", "cpu_threads", "decode_step")},
              "api_servers": frontends, "loads": loads, "programs": programs}
    if device.type == "cuda":
        result["P11"] = {}
        for n, (key, bound, sense) in P11.items():
            if f"streams_{n}" in loads:
                measured = loads[f"streams_{n}"][key]
                ok = measured <= bound if sense == "<=" else measured >= bound
                result["P11"][f"streams_{n}_{key}"] = {"measured": measured, "target": f"{sense} {bound}", "pass": ok}
    return result


if __name__ == "__main__":
    main()
