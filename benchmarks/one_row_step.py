"""The compiled decode step alone, in a loop: the shipped model's shapes (random weights), bf16, at `--rows` rows on
`--threads` kernel threads (the kernels' own pool where more than one, as the engine runs a compiled program built
for one thread) — a steady process to time, or to hold still under `perf record -p PID` while it runs.

    python benchmarks/one_row_step.py [--rows 1] [--threads 2] [--seconds 10] [--quick] [--out FILE]
    python benchmarks/one_row_step.py --bound-vs-unbound [--rounds 300] [--threads 1|2]

Prints the step's median and 10th percentile. `--bound-vs-unbound`: rounds of 100 steps alternating between the
bucket called bound to its unchanging inputs (as the engine calls it) and with every input passed on each call —
in one process, so the host's drift falls on both; the medians and the median of the rounds' paired differences.
Two installs side by side: run each one's python on this script in turn (the compile cache is shared; the program's
key does not depend on the kernels' sources). `--quick`: the eager
step for a fraction of a second (tests).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import describe, emit  # noqa: E402

from linserve.model import LinearGPT, ModelConfig  # noqa: E402
from linserve.server.engine.compile.compiled_decode import DecodeStep  # noqa: E402
from linserve.server.engine.cpu_contention import work_pool_switch  # noqa: E402
from linserve.server.engine.cpu_threads import apply_threads  # noqa: E402
from linserve.server.engine.sampling import SlotSampling  # noqa: E402
from linserve.server.engine.state_pool import StatePool  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="the eager step, briefly (tests)")
    parser.add_argument("--bound-vs-unbound", action="store_true",
                        help="alternate the bucket bound / every input passed (aoti_runner.BoundProgram)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 0.2
    apply_threads(None)  # (the server's plan: this thread runs every step)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=8, decay=True, conv_kernel=4)
    model = LinearGPT(config).eval().to(torch.bfloat16)
    device = torch.device("cpu")
    pool = StatePool(model, 64, device)
    sampling = SlotSampling(pool.num_slots, config.vocab_size, device)
    step = DecodeStep(model, pool, sampling, device, "off" if args.quick else "on", max_rows=args.rows, cache_dir=None)
    step.start()
    step.wait_compiled()
    torch.set_num_threads(args.threads)
    switch = work_pool_switch()
    if switch is not None and args.threads > 1:
        switch(True)
    tokens, slots, positions = [1] * args.rows, list(range(args.rows)), [0] * args.rows
    for _ in range(50):
        step(tokens, slots, positions)
    if args.bound_vs_unbound:
        return emit({"benchmark": "one_row_step_bound", "machine": describe(device), "rows": args.rows,
                     "threads": args.threads, **bound_vs_unbound(step, tokens, slots, positions, args.rounds)},
                    args.out)
    print("timing", flush=True)  # (a profiler attaches from here)
    times, end = [], time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        step(tokens, slots, positions)
        times.append(time.perf_counter() - start)
    times.sort()
    emit({"benchmark": "one_row_step", "machine": describe(device), "rows": args.rows, "threads": args.threads,
          "compiled": not args.quick,
          "steps": len(times), "median_ms": 1e3 * statistics.median(times),
          "p10_ms": 1e3 * times[len(times) // 10]}, args.out)


def bound_vs_unbound(step: DecodeStep, tokens: list[int], slots: list[int], positions: list[int],
                     rounds: int) -> dict:
    """µs a step, rounds of 100 alternating (which goes first alternates too) between the bucket bound and not."""
    bucket = step._bucket_for(len(tokens))
    bound = bucket.bound
    if bound is None:
        raise SystemExit("the bucket is not bound here (no compiled CPU program through linserve's kernels)")
    times: dict[str, list[float]] = {"bound": [], "unbound": []}
    try:
        for r in range(rounds):
            for name in ("bound", "unbound") if r % 2 == 0 else ("unbound", "bound"):
                bucket.bound = bound if name == "bound" else None
                start = time.perf_counter()
                for _ in range(100):
                    step(tokens, slots, positions)
                times[name].append(1e4 * (time.perf_counter() - start))  # (µs a step)
    finally:
        bucket.bound = bound
    differences = [u - b for u, b in zip(times["unbound"], times["bound"])]
    return {"rounds": rounds, "bound_median_us": statistics.median(times["bound"]),
            "unbound_median_us": statistics.median(times["unbound"]),
            "paired_difference_median_us": statistics.median(differences)}


if __name__ == "__main__":
    main()
