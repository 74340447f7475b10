"""CLI start-up: wall time of `linserve --version` and of every subcommand's `--help` (a fresh process each,
as a user types it), median of interleaved repetitions. Target: under 0.5 s each (torch, transformers and
FastAPI load only inside the command that needs them).

    python benchmarks/cli_startup.py [--reps 5] [--out benchmarks/results/cli_startup.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 0.5
COMMANDS = [["--version"], ["--help"], *[[name, "--help"] for name in ("serve", "generate", "train", "eval", "bench",
                                                                         "info")]]


def entry_point() -> list[str]:
    """The installed `linserve` console script beside this Python (what users type), else
    `python -m linserve.server.cli`."""
    script = Path(sys.executable).parent / "linserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "linserve.server.cli"]


def wall_time(arguments: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([*entry_point(), *arguments], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cli_startup.json")
    args = parser.parse_args()
    times: dict[str, list[float]] = {" ".join(c): [] for c in COMMANDS}
    for _ in range(args.reps):  # interleaved: a noisy moment hits every command alike
        for command in COMMANDS:
            times[" ".join(command)].append(wall_time(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"linserve {name:<18} {median * 1000:7.0f} ms")
    worst = max(medians.values())
    print(f"CLI start-up: slowest {worst:.2f} s (target < {TARGET_S} s): {'PASS' if worst < TARGET_S else 'FAIL'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"median_s": medians, "reps": args.reps, "target_s": TARGET_S}, indent=2))


if __name__ == "__main__":
    main()
