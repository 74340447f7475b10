"""One token of each recurrence, linserve's one-pass kernels (model/kernels/delta_rule.cpp) against torch's form of
the same scan (the bits are equal: tests/model/test_kernels.py), eager, over every layer of a model's shape:

    python benchmarks/recurrence_step.py [--rows 1 8] [--reps 5] [--out FILE]

Shapes: mamba2-370m (48 layers, 32 heads, state 128 × 64; `recurrence.scan` with one decay per head and token),
fla's 340M GLA (24 layers, 4 heads of 256 × 512; a decay per key), RWKV-7 0.4B (24 layers, 16 heads of 64 × 64;
`generalized_delta.scan`). The state moves once per token with the kernel; torch's ops make a pass per product,
sum and level of the reduction tree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_ms  # noqa: E402

from linserve.model import generalized_delta, kernels, recurrence

SHAPES = {  # name → (layers, heads, dk, dv, kind)
    "mamba2-370m": (48, 32, 128, 64, "per_head"),
    "gla-340M": (24, 4, 256, 512, "per_key"),
    "rwkv7-0.4B": (24, 16, 64, 64, "dplr"),
}


def one_token(rows: int, heads: int, dk: int, dv: int, kind: str):
    """A closure running one token of the recurrence on random operands (B = rows)."""
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(rows, heads, 1, dk, generator=gen)
    k = torch.randn(rows, heads, 1, dk, generator=gen)
    v = torch.randn(rows, heads, 1, dv, generator=gen)
    S = torch.randn(rows, heads, dk, dv, generator=gen)
    if kind == "dplr":
        w = -0.6 * torch.rand(rows, heads, 1, dk, generator=gen)
        kk = torch.nn.functional.normalize(torch.randn(rows, heads, 1, dk, generator=gen), dim=-1)
        return lambda: generalized_delta.scan(r, w, k, v, -kk, kk * 0.5, S)
    g = -torch.rand(rows, heads, 1, 1 if kind == "per_head" else dk, generator=gen)
    return lambda: recurrence.scan(r, k, v, g, S)


def timed(fn, layers: int, reps: int) -> float:
    """Median ms of `layers` calls (a model's token)."""
    return layers * median_ms(fn, reps, inner=layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit(f"linserve's kernels are unavailable: {kernels.load_error()}")
    results = {}
    for name, (layers, heads, dk, dv, kind) in SHAPES.items():
        for rows in args.rows:
            fn = one_token(rows, heads, dk, dv, kind)
            kernel_ms = timed(fn, layers, args.reps)
            library = kernels._state.pop("library")  # torch's ops for the same scan
            kernels._state["error"] = "off for the comparison"
            try:
                torch_ms = timed(fn, layers, args.reps)
            finally:
                kernels._state.pop("error")
                kernels._state["library"] = library
            state_mb = rows * layers * heads * dk * dv * 4 / 1e6
            results[f"{name} x{rows}"] = {"kernel_ms": kernel_ms, "torch_ms": torch_ms,
                                          "speedup": torch_ms / kernel_ms,
                                          "kernel_state_gb_s": 2 * state_mb / kernel_ms}  # read + write
            print(f"{name:12s} rows {rows}: kernel {kernel_ms:7.1f} ms, torch {torch_ms:7.1f} ms "
                  f"({torch_ms / kernel_ms:.1f}x); state read+written at {2 * state_mb / kernel_ms:.1f} GB/s")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"threads": args.threads, "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
