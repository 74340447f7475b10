"""The shipped model's recurrence on the kernel (`linserve::linear_scan`), this tree's build against another's.

The shipped model's scan carries z as a last value column: 8 heads of 32 × 33 a layer. Its exact prefill (bf16)
and speculative decoding's verification (every prefix's state) run through `linear_scan`. Measured per token and
head at that shape (T = 9 with every prefix: a verification of 8 drafts; T = 512 without: a prefill chunk), at
32 columns beside it, and the model's whole prefill of `--tokens` in the engine's 256-token chunks on 2 threads —
each in a child process per build, the builds alternating round by round (ratios per round: the host drifts).

    python benchmarks/shipped_scan.py [--baseline-library PATH] [--rounds 4] [--tokens 4096] [--out FILE]

`--baseline-library`: another build of linserve's kernels (an older checkout's: `python -c "from linserve.model
import kernels; kernels.load(); print(kernels.library_path()[0])"` there). Without it, this tree's build alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, emit  # noqa: E402

SCANS = [(8, 9, 32, 33, True), (8, 512, 32, 33, False), (8, 512, 32, 32, False)]  # heads, T, dk, dv, prefixes

CHILD = r"""
import json, statistics, sys, time
import torch
from linserve.model import kernels, numerics
library, tokens, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if library != "-":
    kernels.library_path = lambda: (library, kernels.kernel_isa())
assert kernels.load(), kernels.load_error()
numerics.flush_subnormals()
out = {}
generator = torch.Generator().manual_seed(0)
torch.set_num_threads(1)
with torch.inference_mode():
    for heads, T, dk, dv, prefixes in json.loads(sys.argv[4]):
        q, k, a = (torch.rand(1, heads, T, dk, generator=generator) for _ in range(3))
        v, S = torch.randn(1, heads, T, dv, generator=generator), torch.rand(1, heads, dk, dv, generator=generator)
        calls = max(3, int(3e6 / (heads * T * dk * dv)))
        torch.ops.linserve.linear_scan(q, k, v, a, S, prefixes)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            for _ in range(calls):
                torch.ops.linserve.linear_scan(q, k, v, a, S, prefixes)
            times.append((time.perf_counter() - started) / calls / (heads * T) * 1e9)
        out[f"{heads} heads x {T} tokens, {dk} x {dv}{' every prefix' if prefixes else ''}"] = statistics.median(times)
    from linserve.model.checkpoint import load_served
    from linserve.model.loading import DEFAULT_CHECKPOINT
    torch.set_num_threads(2)
    model, _ = load_served(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator)
    model(ids[:, :256])
    times = []
    for _ in range(reps):
        started, state = time.perf_counter(), None
        for start in range(0, tokens, 256):
            _, state = model(ids[:, start : start + 256], state)
        times.append(time.perf_counter() - started)
    out["prefill_s"] = statistics.median(times)
print(json.dumps(out))
"""


def measure(library: str, tokens: int, reps: int) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, library, str(tokens), str(reps), json.dumps(SCANS)],
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"the measurement with {library} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-library", help="another build of linserve's kernels to measure beside this one")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3, help="repetitions inside each child (median)")
    parser.add_argument("--quick", action="store_true", help="one round, 512 tokens, one repetition")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.reps = 1, 512, 1
    import torch

    builds = {"this tree": "-", **({"baseline": args.baseline_library} if args.baseline_library else {})}
    rounds = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, library in builds.items():
            rounds[name].append(measure(library, args.tokens, args.reps))
    keys = list(rounds["this tree"][0])
    result = {"machine": describe(torch.device("cpu")), "tokens": args.tokens, "rounds": rounds,
              "median": {name: {key: statistics.median(r[key] for r in runs) for key in keys}
                         for name, runs in rounds.items()}}
    if args.baseline_library:  # baseline / this tree per round: above 1, this tree is faster
        result["speedup_per_round"] = {key: [round(b[key] / t[key], 3) for b, t in
                                             zip(rounds["baseline"], rounds["this tree"])] for key in keys}
    for key in keys:
        unit = "s" if key == "prefill_s" else "ns a token and head"
        line = ", ".join(f"{name} {result['median'][name][key]:.3g}" for name in builds)
        extra = f"; baseline/this per round {result['speedup_per_round'][key]}" if args.baseline_library else ""
        print(f"{key}: {line} ({unit}){extra}", file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
