"""The compiled decode step alone, in a loop: the shipped model's shapes (random weights), bf16, at `--rows` rows on
`--threads` kernel threads (the kernels' own pool where more than one, as the engine runs a compiled program built
for one thread) — a steady process to time, or to hold still under `perf record -p PID` while it runs.

    python benchmarks/one_row_step.py [--rows 1] [--threads 2] [--seconds 10] [--quick] [--out FILE]

Prints the step's median and 10th percentile. Two installs side by side: run each one's python on this script in
turn (the compile cache is shared; the program's key does not depend on the kernels' sources). `--quick`: the eager
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


if __name__ == "__main__":
    main()
