"""This tree's `linserve serve` against another installation's (a baseline: another commit in its own
virtual environment), P9's loads on the shipped model, servers in turn within every load, one run:

    git worktree add /tmp/base COMMIT && python3 -m venv /tmp/base/.venv && \\
      /tmp/base/.venv/bin/pip install -c /tmp/base/configs/constraints.txt -e /tmp/base
    python benchmarks/side_by_side.py --baseline-python /tmp/base/.venv/bin/python [--reps 3] [--out FILE] \\
        [--loads 1x512 8x256 32x128] [--api-servers 1]

Reports tokens/s per load (median of the repetitions) and this tree / baseline, and each server's compiled
buckets' thread counts as its own timing chose them (`/version`'s `decode_step.threads`). Both servers run with their
defaults on the same model directory, compile settled before the first load. `--baseline-env NAME=VALUE …`
sets the baseline server's environment only — with `--baseline-python` this tree's own python, one setting
A/B'd on one installation (e.g. `LINSERVE_KERNEL_THREADS=1`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import compile_settled, emit, machine_check, reference_workload_ms, wait_until_up  # noqa: E402
from p9_peers import one_load  # noqa: E402
from serving_overhead import COMPILE_TIMEOUT_S  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402


def start(python: str, port: int, compile_mode: str, api_servers: int | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [python, "-m", "linserve.server.cli", "serve", "--model", str(DEFAULT_CHECKPOINT), "--port", str(port),
               "--compile", compile_mode, "--log-level", "warning",
               *([] if api_servers is None else ["--api-servers", str(api_servers)])]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "LINSERVE_SESSION_STORE": "none", **(env or {})})
    return wait_until_up(process, f"http://127.0.0.1:{port}/ready", "linserve serve", COMPILE_TIMEOUT_S,
                         compile_settled)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-python", required=True, help="the python of the baseline's environment")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loads", nargs="+", default=["1x512", "8x256"],
                        help="STREAMSxTOKENS each (32-token prompts, one request a stream) [default: P9's]")
    parser.add_argument("--api-servers", type=int, choices=range(0, 9), help="both servers' --api-servers")
    parser.add_argument("--baseline-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment for the baseline server only")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    baseline_env = dict(item.split("=", 1) for item in args.baseline_env)
    names = args.loads if not args.quick else ["1x32", "8x16"]
    loads = {name: tuple(int(part) for part in name.split("x")) for name in names}
    reference_before = reference_workload_ms()
    servers = {"this tree": (sys.executable, 8961), "baseline": (args.baseline_python, 8962)}
    processes = [start(python, port, args.compile, args.api_servers, baseline_env if name == "baseline" else None)
                 for name, (python, port) in servers.items()]
    rates = {(name, load): [] for name in servers for load in loads}
    try:
        for _, port in servers.values():
            one_load(port, 1, 8)  # warm-up
        for _ in range(args.reps):
            for load, (streams, tokens) in loads.items():
                for name, (_, port) in servers.items():
                    rates[(name, load)].append(one_load(port, streams, tokens)[0]["token_throughput_per_s"])
        # each compiled bucket's thread count as the server's own timing chose it (absent: no such choice)
        chosen = {name: (httpx.get(f"http://127.0.0.1:{port}/version", timeout=30).json().get("decode_step") or {})
                  .get("threads") for name, (_, port) in servers.items()}
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)
    table = {load: {name: statistics.median(rates[(name, load)]) for name in servers} for load in loads}
    for load, row in table.items():
        row["ratio"] = row["this tree"] / row["baseline"]
        row["spread"] = {name: [min(rates[(name, load)]), max(rates[(name, load)])] for name in servers}
    emit({"reps": args.reps, "baseline_python": args.baseline_python, "baseline_env": baseline_env,
          "api_servers": args.api_servers,
          "tokens_per_s": table, "compiled_step_threads": chosen,
          "machine": machine_check(reference_before, reference_workload_ms())}, args.out)


if __name__ == "__main__":
    main()
