"""Batch-1 decode-step time of a linear-attention model after prefilling different context lengths.

Contexts are measured interleaved (round-robin repetitions) so machine noise hits them alike; the
ratio of medians is the number to read. Usage:

    python benchmarks/decode_vs_context.py [--contexts 128 32768] [--reps 7] [--steps 50] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model import LinearGPT, ModelConfig
from model.generate import decode_one_token, prefill


def time_steps(model: LinearGPT, state, token: torch.Tensor, steps: int) -> float:
    """Median seconds of one decode step over `steps` steps, each from the same starting state."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        decode_one_token(model, token, state)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 32_768])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="small contexts and few repetitions (for tests)")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.reps, args.steps = [16, 256], 2, 5

    torch.manual_seed(0)
    model = LinearGPT(ModelConfig(vocab_size=4096, d_model=args.width, n_layers=args.layers, n_heads=8)).eval()
    states = {}
    for context in args.contexts:
        ids = torch.randint(0, 4096, (1, context))
        _, states[context] = prefill(model, ids)
    token = torch.tensor([1])
    medians = {c: [] for c in args.contexts}
    for _ in range(args.reps):
        for context in args.contexts:
            medians[context].append(time_steps(model, states[context], token, args.steps))
    result = {
        "threads": torch.get_num_threads(),
        "state_bytes": model.state_bytes(),
        "step_ms_median": {c: 1e3 * statistics.median(v) for c, v in medians.items()},
        "step_ms_spread": {c: [1e3 * min(v), 1e3 * max(v)] for c, v in medians.items()},
    }
    base = args.contexts[0]
    result["ratio_to_first"] = {c: statistics.median(medians[c]) / statistics.median(medians[base]) for c in args.contexts}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
