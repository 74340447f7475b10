"""The split server's CPU per streamed token, by process: the HTTP frontend's (issue 57: ≤ 15 µs), the engine
core's, and the load generator's — read from each process's own CPU counters around a `linserve bench` load,
so the figure is CPU time spent, not wall time (a busy host stretches both sides alike, but the counters
count only what each process ran).

    python benchmarks/frontend_cpu.py [--model DIR] [--loads 1x256 32x128] [--reps 3] [--compile auto]
                                      [--profile DIR] [--floor] [--quick] [--out FILE]

One `linserve serve --api-servers 1` (the engine core a process of its own); each load's requests are sent
by `linserve bench`'s client in this process. Per load: the frontend's and the core's CPU µs per streamed
token, the client's, the engine steps it took (/metrics: `linserve_engine_step_seconds`'s count) and the core's
CPU per step. `--profile DIR`: py-spy records the frontend over each load (a flame graph per load in DIR).
`--floor`: beside each load, the floor under the frontend's figure — one chunk written to each stream a step by a
bare uvloop writer at the load's own step interval (write_floor.py) — and the frontend's CPU above it.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_compile_argument, add_dtype_argument, core_pid, cpu_split, describe, emit  # noqa: E402
from serving_overhead import start_server  # noqa: E402
from write_floor import measure as write_floor  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402


def steps(port: int) -> float:
    """Engine steps so far, every phase (the step histogram's count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(value) for value in re.findall(r"^linserve_engine_step_seconds_count\{[^}]*\} (\S+)$", text,
                                                   re.MULTILINE))


def one_load(port: int, streams: int, tokens: int, frontend: int, core: int, profile: str | None,
             label: str) -> dict:
    spec = LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=streams, requests=streams, warmup=0,
                    prompt_tokens=16, max_tokens=tokens, ignore_eos=True, temperature=0.8)
    spy = None
    if profile:
        Path(profile).mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(frontend), "--rate", "250", "--format", "raw",
                                "--output", f"{profile}/{label}.txt", "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    step0, front0, core0, client0 = steps(port), cpu_split(frontend), cpu_split(core), time.process_time()
    run = drive(spec, processes=1)  # (in this process: its CPU is the client's)
    step1, front1, core1, client1 = steps(port), cpu_split(frontend), cpu_split(core), time.process_time()
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # (py-spy writes its file on an interrupt)
        spy.wait(60)
    assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok]
    generated = sum(r.completion_tokens for r in run.records)
    taken = max(1.0, step1 - step0)
    front, core_s = sum(front1) - sum(front0), sum(core1) - sum(core0)
    return {"tokens": generated, "wall_s": run.wall_s, "tokens_per_s": generated / run.wall_s,
            "frontend_us_per_token": 1e6 * front / generated,
            "frontend_system_us_per_token": 1e6 * (front1[1] - front0[1]) / generated,  # (of it: in the kernel)
            "core_us_per_token": 1e6 * core_s / generated,
            "core_system_us_per_token": 1e6 * (core1[1] - core0[1]) / generated,
            "client_us_per_token": 1e6 * (client1 - client0) / generated,
            "engine_steps": taken, "core_us_per_step": 1e6 * core_s / taken}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--loads", nargs="+", default=["1x256", "32x128"], help="STREAMSxTOKENS each")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--profile", help="py-spy records the frontend over each load into this directory")
    parser.add_argument("--floor", action="store_true", help="measure each load's write floor beside it")
    parser.add_argument("--quick", action="store_true", help="2 × 16 tokens once, eager, with its floor")
    parser.add_argument("--out")
    add_compile_argument(parser)
    add_dtype_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.loads, args.reps, args.compile, args.floor = ["2x16"], 1, "off", True
    loads = [tuple(int(n) for n in load.split("x")) for load in args.loads]
    server = start_server(args.model, args.port, 64, compile=args.compile,
                          extra=["--log-level", "warning", "--dtype", args.dtype, "--api-servers", "1"])
    results: dict[str, list[dict]] = {f"{n}x{t}": [] for n, t in loads}
    try:
        frontend = server.pid
        core = core_pid(frontend)
        if core is None:
            raise SystemExit(f"no engine core process under {frontend}: is --api-servers 1 in force?")
        one_load(args.port, 1, 8, frontend, core, None, "warm-up")
        for rep in range(args.reps):
            for n, t in loads:
                label = f"{n}x{t}"
                figures = one_load(args.port, n, t, frontend, core, args.profile if rep == 0 else None, label)
                results[label].append(figures)
                print(f"{label} rep {rep}: {figures['tokens_per_s']:.0f} tokens/s; CPU µs a token: frontend "
                      f"{figures['frontend_us_per_token']:.1f} ({figures['frontend_system_us_per_token']:.1f} in the "
                      f"kernel), core {figures['core_us_per_token']:.1f}, client {figures['client_us_per_token']:.1f}; "
                      f"core {figures['core_us_per_step']:.0f} µs a step", file=sys.stderr)
        floors = {}
        for n, t in loads if args.floor else ():  # (the server idle meanwhile)
            label = f"{n}x{t}"
            interval = statistics.median(r["wall_s"] / r["engine_steps"] for r in results[label])
            floors[label] = write_floor(n, max(200, min(2000, 32_768 // n)), interval)
            print(f"{label} floor: {floors[label]['us_per_write']:.1f} µs a write "
                  f"({floors[label]['kernel_us_per_write']:.1f} in the kernel)", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(60)
    summary = {label: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for label, runs in results.items()}
    for label, figures in summary.items():
        figures["frontend_target"] = "<= 15 us a streamed token (issue 57)"
        figures["frontend_pass"] = figures["frontend_us_per_token"] <= 15
        if label in floors:
            figures["write_floor"] = floors[label]
            figures["frontend_above_floor_us_per_token"] = (figures["frontend_us_per_token"]
                                                            - floors[label]["us_per_write"])
    emit({**describe(torch.device("cpu")), "compile": args.compile, "dtype": args.dtype,
          "reps": args.reps, "loads": summary, "runs": results}, args.out)


if __name__ == "__main__":
    main()
