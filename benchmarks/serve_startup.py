"""`linserve serve` start-up: seconds to /health 200 and to the first streamed token (P12's first half), and to
import the app, each start on an empty compile cache — optionally against another checkout, interleaved.

    python benchmarks/serve_startup.py [--rounds 5 | --quick] [--device auto] [--baseline DIR] [--out FILE]

`--baseline DIR`: a checkout of another commit (e.g. `git worktree add /tmp/before REV`), run from this same
environment through a namespace shim (DIR/model and DIR/server as linserve.model and linserve.server on
PYTHONPATH), one round of each in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import wait_until_up

FIRST_TOKEN_TARGET_S = 10.0  # P12


def shim(checkout: Path) -> str:
    """A directory whose linserve/ namespace holds the checkout's model/ and server/ (for PYTHONPATH)."""
    root = Path(tempfile.mkdtemp(prefix="linserve-baseline-"))
    (root / "linserve").mkdir()
    for part in ("model", "server"):
        (root / "linserve" / part).symlink_to(checkout.resolve() / part)
    return str(root)


START_WAIT_S = 270.0  # (two starts of the --quick run fit the suite's 600 s for a benchmark script)


def one_start(env: dict, port: int, device: str) -> dict:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import linserve.server.app"], env=env, check=True)
    imported = time.perf_counter() - started
    cache = tempfile.mkdtemp(prefix="linserve-startup-cache-")
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "linserve.server.cli", "serve", "--port", str(port), "--device",
                               device, "--compile-cache-dir", cache], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        # (a start on a host busy with other work may take minutes: this measures it, and P12's verdict judges it)
        wait_until_up(server, f"http://127.0.0.1:{port}/health", "linserve serve", timeout_s=START_WAIT_S, poll_s=0.02)
        health = time.perf_counter() - started
        body = {"prompt": "ROMEO:", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as response:
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        first = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(cache, ignore_errors=True)
    return {"import_s": imported, "health_s": health, "first_token_s": first}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one round (a check that it works)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit, measured in turn")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--out", default="benchmarks/results/serve_startup.json")
    args = parser.parse_args(argv)
    args.rounds = 1 if args.quick else args.rounds
    trees = {"this tree": dict(os.environ)}
    if args.baseline is not None:
        trees["baseline"] = {**os.environ, "PYTHONPATH": shim(args.baseline)}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for index in range(args.rounds):
        for name, env in trees.items():
            rounds[name].append(one_start(env, args.port + index, args.device))
            print(name, " ".join(f"{key} {value:.2f}" for key, value in rounds[name][-1].items()), flush=True)
    median = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    result = {"device": args.device, "baseline": str(args.baseline) if args.baseline else None, "rounds": rounds,
              "median": median, "first_token_target_s": FIRST_TOKEN_TARGET_S,
              "verdict": "PASS" if median["this tree"]["first_token_s"] <= FIRST_TOKEN_TARGET_S else "FAIL"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(median, indent=1))


if __name__ == "__main__":
    main()
