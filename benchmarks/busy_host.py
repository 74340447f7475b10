"""Threads beside a busy neighbour (issue 55, item 5): a long prefill on the default prefill threads, with and
without a process spinning on one core beside it, for each OpenMP waiting policy.

libgomp's workers spin at barriers for a while before they sleep (its default); while another process holds the
other core, a spinning worker burns the time slice the thread it waits for needs — a 4,011-token prefill on 2
threads took a median 4.8–25 s beside other work against 2.1 s with one thread. Each configuration runs in a fresh
process (OpenMP reads its environment once), the variants in turn within each repetition:

- `default`: OMP_WAIT_POLICY unset in the environment the process starts with (libgomp's spin-then-sleep);
- `passive`: OMP_WAIT_POLICY=PASSIVE (sleep at once);
- `one_thread`: a single intra-op thread (no barriers at all).

    python benchmarks/busy_host.py [--tokens 4011] [--threads 2] [--reps 5] [--out FILE]

(`linserve serve` sets OMP_WAIT_POLICY=PASSIVE when the environment does not say: `default` here is what a
process gets without it.)
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

from common import emit  # noqa: E402

PREFILL = """
import json, sys, time, torch
from linserve.model.loading import DEFAULT_CHECKPOINT, in_dtype, load_model
torch.set_num_threads({threads})
model = in_dtype(load_model(DEFAULT_CHECKPOINT, torch.device("cpu")).model, torch.bfloat16).eval()
ids = torch.randint(1, 4000, (1, {tokens}), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(ids[:, :256])  # warm-up
    started = time.perf_counter()
    state = None
    for start in range(0, ids.shape[1], 256):  # the engine's prefill chunks
        _, state = model(ids[:, start:start + 256], state)
    print(json.dumps({{"seconds": time.perf_counter() - started}}))
"""

VARIANTS = {"default": ({}, None), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, None), "one_thread": ({}, 1)}


def prefill_seconds(tokens: int, threads: int, extra_env: dict) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(extra_env)
    result = subprocess.run([sys.executable, "-c", PREFILL.format(tokens=tokens, threads=threads)], env=env,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4011)
    parser.add_argument("--threads", type=int, default=2, help="the prefill's intra-op threads (default policy)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    result = {"tokens": args.tokens, "threads": args.threads, "cpus": os.cpu_count(), "seconds": {}}
    for neighbour in ("quiet", "busy"):
        spinner = None
        if neighbour == "busy":  # one process spinning on a core for the whole run (bounded: killed after)
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            times = {name: [] for name in VARIANTS}
            for _ in range(args.reps):
                for name, (env, threads) in VARIANTS.items():
                    times[name].append(prefill_seconds(args.tokens, threads or args.threads, env))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        result["seconds"][neighbour] = {name: {"median": round(statistics.median(v), 3),
                                               "max": round(max(v), 3), "all": [round(x, 3) for x in v]}
                                        for name, v in times.items()}
        print(neighbour, result["seconds"][neighbour], file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
