"""Where a served load's time goes: `linserve serve` under P17's loads (32-token prompts, `ignore_eos`), with the
engine's own step phases read from `/metrics` around each load — decode steps, prefill steps and mixed steps (a
prefill chunk beside decoding rows), their count and mean — beside the load's tokens/s, first-token times and ITL.
A load's wall time is its steps' time: what its prompts cost against its decoding is read off directly.

    python benchmarks/served_phases.py [--model DIR] [--loads 1x128 8x128] [--reps 2] [--slots 8] [--device cpu]
        [--quick] [--out FILE]

Results: one entry a load and repetition, in order (`loads`). No targets: it explains P17's and P9's figures.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import add_compile_argument, add_device_argument, emit, resolve_device  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402

PHASE = re.compile(r'linserve_engine_step_seconds_(sum|count)\{phase="([^"]+)"\} ([0-9.e+-]+)')


def phases(port: int) -> dict[str, dict[str, float]]:
    """The step histogram's sum and count by phase, now."""
    found: dict[str, dict[str, float]] = {}
    for match in PHASE.finditer(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text):
        found.setdefault(match.group(2), {})[match.group(1)] = float(match.group(3))
    return found


def one_load(port: int, streams: int, tokens: int) -> dict:
    spec = LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=streams, requests=streams, warmup=0,
                    prompt_tokens=32, max_tokens=tokens, ignore_eos=True, temperature=0.8)
    before = phases(port)
    run = drive(spec)
    after = phases(port)
    failed = [r.error or r.status for r in run.records if not r.ok]
    assert not failed, failed[:3]
    generated = sum(r.completion_tokens for r in run.records)
    gaps = [b - a for r in run.records for a, b in zip(r.token_times, r.token_times[1:])]
    firsts = [r.token_times[0] for r in run.records]
    steps = {}
    for phase, now in after.items():
        count = now["count"] - before.get(phase, {}).get("count", 0.0)
        total = now["sum"] - before.get(phase, {}).get("sum", 0.0)
        steps[phase] = {"steps": int(count), "mean_ms": 1e3 * total / count if count else 0.0, "total_s": total}
    return {"load": f"{streams}x{tokens}", "tokens_per_s": generated / run.wall_s, "wall_s": run.wall_s,
            "first_token_ms": {"p50": 1e3 * statistics.median(firsts), "max": 1e3 * max(firsts)},
            "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else None, "steps": steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--loads", nargs="+", default=["1x128", "8x128"], help="STREAMSxTOKENS each")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--port", type=int, default=8971)
    parser.add_argument("--quick", action="store_true", help="1 × 8 and 2 × 8 once, eager (tests)")
    parser.add_argument("--out")
    add_compile_argument(parser)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.loads, args.reps, args.compile = ["1x8", "2x8"], 1, "off"
    loads = [tuple(map(int, load.split("x"))) for load in args.loads]
    server = start_server(args.model, args.port, args.slots, extra=["--log-level", "warning"],
                          env={"LINSERVE_SESSION_STORE": "none"}, device=resolve_device(args.device).type,
                          compile=args.compile)
    results = []
    try:
        one_load(args.port, 1, 8)  # warm-up
        for _ in range(args.reps):
            for streams, tokens in loads:
                result = one_load(args.port, streams, tokens)
                results.append(result)
                summary = " ".join(f"{phase} {s['steps']} × {s['mean_ms']:.1f} ms" for phase, s in
                                   result["steps"].items() if s["steps"])
                print(f"# {result['load']}: {result['tokens_per_s']:.1f} tokens/s, {summary}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(60)
    emit({"model": args.model, "slots": args.slots, "loads": results}, args.out)


if __name__ == "__main__":
    main()
