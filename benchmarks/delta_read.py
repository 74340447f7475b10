"""The decode step's recurrence kernels on the state pool (model/kernels/pooled_state.cpp), by default the delta rule's
at fla's 340M Gated DeltaNet shape (21 layers, 6 value heads of 256 × 512, 3 MiB a row and layer): `delta_read`
(o and u from each row's slot) and `state_commit` (S ← S·α + k ⊗ u in place), their rate in GB/s of state moved
beside the DRAM read bandwidth measured before each repetition, and a step's layers both ways in milliseconds —
read then commit, and the commit folded into the next read (`delta_read_folded` + `pending_record`, what the decode
program runs) — over every layer's pool (cold: past the last-level cache) and over two layers' (warm: the same calls
from the cache). A kernel as fast warm as cold is bound by its arithmetic, not its traffic. `--rule linear` times
the gated linear recurrence's (`linear_read`, `linear_read_folded`) at fla's 340M `linear_attn` shape instead
(24 layers, 4 heads of 256 × 256, 1 MiB a row and layer; `--gated`: a decay per key dimension, GLA's form), and
`--rule shipped` at the shipped model's (6 layers, 8 heads of 32 × 32: its state lives in the cache).

    python benchmarks/delta_read.py [--rule delta|linear|shipped] [--gated] [--rows 1 8] [--reps 5] [--threads 2]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402
from decode_vs_context import read_bandwidth_gbs  # noqa: E402

from linserve.model import kernels  # noqa: E402

SHAPES = {"delta": (21, 6, 256, 512),  # fla's gated_deltanet 340M: value heads 6 (expand_v 2), d_k 256, d_v 512
          "linear": (24, 4, 256, 256),  # fla's linear_attn 340M
          "shipped": (6, 8, 32, 32)}  # the shipped model (no decay): its 6 layers' S, cache-resident


def rule_of(shape: str) -> str:
    return "delta" if shape == "delta" else "linear"


def rates(shape: str, gated: bool, rows: int, layers: int, reps: int) -> dict:
    """Median GB/s of a step's read calls (the state read once) and state_commit calls (read and written), over
    `layers` pools in turn, and a step's milliseconds read then committed against folded."""
    op = torch.ops.linserve
    rule, (n_layers, heads, dk, dv) = rule_of(shape), SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    pools = [torch.randn(rows + 1, heads, dk, dv, generator=g) * 0.01 for _ in range(layers)]  # (N, H, dk, dv)
    slots = torch.arange(rows)  # (B,)
    q = torch.randn(rows, heads, dk, generator=g)  # (B, H, dk)
    k = torch.nn.functional.normalize(torch.randn(rows, heads, dk, generator=g), dim=-1)  # (B, H, dk)
    v = torch.randn(rows, heads, dv, generator=g)  # (B, H, dv)
    beta = torch.rand(rows, heads, generator=g)  # (B, H)
    if rule == "delta":
        alpha = 0.9 + 0.1 * torch.rand(rows, heads, generator=g)  # (B, H)
    else:
        alpha = 0.9 + 0.1 * torch.rand(rows, heads, dk, generator=g) if gated else None  # (B, H, dk)
    keep = torch.ones(rows, dtype=torch.bool)
    turn = [pools[i % layers] for i in range(n_layers)]  # a step's calls, warm: the two pools in turn
    n = rows + 1
    pending = {id(pool): (torch.zeros(n, heads, dk), torch.zeros(n, heads, dv), torch.zeros(n, heads, dk),
                          torch.zeros(n, dtype=torch.uint8)) for pool in pools}  # each pool's PendingBuffers

    def read(pool):  # → the value the commit adds (the delta rule's u, the linear recurrence's v)
        if rule == "delta":
            return op.delta_read(q, k, v, beta, alpha, pool, slots)[1]
        op.linear_read(q, k, v, alpha, pool, slots)
        return v

    def read_folded(pool):
        if rule == "delta":
            return op.delta_read_folded(q, k, v, beta, alpha, pool, slots, *pending[id(pool)])[1]
        op.linear_read_folded(q, k, v, alpha, pool, slots, *pending[id(pool)])
        return v

    state = n_layers * rows * heads * dk * dv * 4
    reads, commits, dram, separate_ms, folded_ms = [], [], [], [], []
    for rep in range(reps + 1):  # (the first: a warm-up, not counted)
        dram.append(read_bandwidth_gbs(torch.device("cpu"), 256 << 20))
        started = time.perf_counter()
        outs = [read(pool) for pool in turn]
        middle = time.perf_counter()
        for pool, u in zip(turn, outs):
            op.state_commit(pool, slots, k, u, alpha, keep)
        ended = time.perf_counter()
        for pool in turn:  # the commit folded into the next read: the state read and written once
            op.pending_record(*pending[id(pool)], slots, k, read_folded(pool), alpha, keep)
        if rep:
            reads.append(state / (middle - started) / 1e9)
            commits.append(2 * state / (ended - middle) / 1e9)
            separate_ms.append(1e3 * (ended - started))
            folded_ms.append(1e3 * (time.perf_counter() - ended))
    return {"state_bytes_a_step": state, "dram_gb_s": statistics.median(dram),
            "read_gb_s": statistics.median(reads), "state_commit_gb_s": statistics.median(commits),
            "read_and_commit_ms": statistics.median(separate_ms), "folded_ms": statistics.median(folded_ms)}


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", choices=sorted(SHAPES), default="delta",
                        help="delta, linear (340M shapes) or shipped (the shipped model's linear recurrence)")
    parser.add_argument("--gated", action="store_true", help="linear: a decay per key dimension (GLA's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not kernels.load():
        raise SystemExit("linserve's CPU kernels did not build here: nothing to measure")
    torch.set_num_threads(args.threads)
    layers, heads, dk, dv = SHAPES[args.rule]
    gated = rule_of(args.rule) == "delta" or args.gated
    result = {"threads": args.threads, "rule": args.rule, "gated": gated,
              "shape": {"layers": layers, "heads": heads, "dk": dk, "dv": dv}, "rows": {}}
    for rows in args.rows:
        result["rows"][rows] = {"cold": rates(args.rule, gated, rows, layers, args.reps),
                                "warm": rates(args.rule, gated, rows, 2, args.reps)}
        print(rows, result["rows"][rows], file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
