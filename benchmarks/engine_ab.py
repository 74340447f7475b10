"""This tree's engine against another installation's (a baseline commit in its own virtual environment), in-engine
— no HTTP, so the host's event loop and client do not blur the engine's own change — on the shipped model with
the server's defaults and its checkpoint's generation defaults (top-k 50, as a server applies them), each
installation a fresh process in turn within every repetition:

    git worktree add /tmp/base COMMIT && python3 -m venv /tmp/base/.venv && \\
      /tmp/base/.venv/bin/pip install -c /tmp/base/configs/constraints.txt -e /tmp/base
    python benchmarks/engine_ab.py --baseline-python /tmp/base/.venv/bin/python [--reps 3] [--loads 1x512 8x256]
        [--out FILE]

The server's settings come from the environment as `serve` reads them: e.g. `LINSERVE_MODEL=data/p17/linear_attn
LINSERVE_COMPILE=off LINSERVE_NUM_SLOTS=9 … --loads 1x48 8x24` puts another family's eager step side by side.

Reports tokens/s per load (median of the repetitions) and this tree / baseline. Each process waits for its
compiled buckets (warm them first with `linserve compile` in each environment, or the first waits minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine_check, reference_workload_ms  # noqa: E402

LOADS = {"1x512": (1, 512), "8x256": (8, 256), "32x128": (32, 128)}
CHILD = """
import json, sys
sys.path.insert(0, {benchmarks!r})
from common import wait_programs
from engine_inprocess import run_streams
from linserve.server.loading import load_engine
from linserve.server.settings import Settings
settings = Settings.load()
engine, _, generation = load_engine(settings, lambda stats: None)
assert settings.compile == "off" or wait_programs(engine), "the compiled buckets did not settle"
defaults = {{"top_k": 50}}
for streams, tokens in {loads!r}.values():  # (a warm-up of each load's width)
    run_streams(engine, streams, max(8, tokens // 8), f"warm{{streams}}", sampling=defaults)
rates = {{}}
for name, (streams, tokens) in {loads!r}.items():
    seconds, generated = run_streams(engine, streams, tokens, name, sampling=defaults)
    rates[name] = generated / seconds
engine.stop()
print(json.dumps(rates))
"""


def rates_of(python: str, loads: dict) -> dict:
    code = CHILD.format(benchmarks=str(Path(__file__).resolve().parent), loads=loads)
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-python", required=True, help="the python of the baseline's environment")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--loads", nargs="+", default=list(LOADS), help="STREAMSxTOKENS each (default: %(default)s)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    reference_before = reference_workload_ms()
    pythons = {"this tree": sys.executable, "baseline": args.baseline_python}
    runs = {name: [] for name in pythons}
    loads = {}
    for load in args.loads:
        streams, _, tokens = load.partition("x")
        loads[load] = (int(streams), int(tokens))
    for _ in range(args.reps):
        for name, python in pythons.items():
            runs[name].append(rates_of(python, loads))
            print(name, runs[name][-1], file=sys.stderr)
    result = {"reps": args.reps, "baseline_python": args.baseline_python, "tokens_per_s": {},
              "settings_env": {key: value for key, value in os.environ.items() if key.startswith("LINSERVE_")}}
    for load in loads:
        medians = {name: statistics.median(r[load] for r in runs[name]) for name in pythons}
        result["tokens_per_s"][load] = {**medians, "ratio": medians["this tree"] / medians["baseline"],
                                        "all": {name: [r[load] for r in runs[name]] for name in pythons}}
    result["machine"] = machine_check(reference_before, reference_workload_ms())
    emit(result, args.out)


if __name__ == "__main__":
    main()
