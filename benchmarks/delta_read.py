"""The delta rule's decode-step kernels on the state pool (model/kernels/pooled_state.cpp) at fla's 340M Gated
DeltaNet shape (6 value heads of 256 × 512, 3 MiB a row and layer): `delta_read` (o and u from each row's slot)
and `state_commit` (S ← S·α + k ⊗ u in place), their rate in GB/s of state moved beside the DRAM read bandwidth
measured before each repetition, and a step's 21 layers both ways in milliseconds — read then commit, and the
commit folded into the next read (`delta_read_folded` + `pending_record`, what the decode program runs) —
over every layer's pool (cold: 21 × 3 MiB a row, past the last-level cache)
and over two layers' (warm: the same calls from the cache). A kernel as fast warm as cold is bound by its
arithmetic, not its traffic.

    python benchmarks/delta_read.py [--rows 1 8] [--reps 5] [--threads 2] [--out FILE]
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

LAYERS, HEADS, DK, DV = 21, 6, 256, 512  # fla's gated_deltanet 340M: value heads 6 (expand_v 2), d_k 256, d_v 512


def rates(rows: int, layers: int, reps: int) -> dict:
    """Median GB/s of a step's 21 delta_read calls (the state read once) and state_commit calls (read and written),
    over `layers` pools in turn."""
    op = torch.ops.linserve
    g = torch.Generator().manual_seed(0)
    pools = [torch.randn(rows + 1, HEADS, DK, DV, generator=g) * 0.01 for _ in range(layers)]  # (N, H, dk, dv)
    slots = torch.arange(rows)  # (B,)
    q = torch.randn(rows, HEADS, DK, generator=g)  # (B, H, dk)
    k = torch.nn.functional.normalize(torch.randn(rows, HEADS, DK, generator=g), dim=-1)  # (B, H, dk)
    v = torch.randn(rows, HEADS, DV, generator=g)  # (B, H, dv)
    beta, alpha = torch.rand(rows, HEADS, generator=g), 0.9 + 0.1 * torch.rand(rows, HEADS, generator=g)  # (B, H)
    keep = torch.ones(rows, dtype=torch.bool)
    turn = [pools[i % layers] for i in range(LAYERS)]  # a step's 21 calls, warm: the two pools in turn
    n = rows + 1
    pending = {id(pool): (torch.zeros(n, HEADS, DK), torch.zeros(n, HEADS, DV), torch.zeros(n, HEADS),
                          torch.zeros(n, dtype=torch.uint8)) for pool in pools}  # each pool's PendingBuffers
    state = LAYERS * rows * HEADS * DK * DV * 4
    read, commit, dram, separate_ms, folded_ms = [], [], [], [], []
    for rep in range(reps + 1):  # (the first: a warm-up, not counted)
        dram.append(read_bandwidth_gbs(torch.device("cpu"), 256 << 20))
        started = time.perf_counter()
        outs = [op.delta_read(q, k, v, beta, alpha, pool, slots) for pool in turn]
        middle = time.perf_counter()
        for pool, (_, u) in zip(turn, outs):
            op.state_commit(pool, slots, k, u, alpha, keep)
        ended = time.perf_counter()
        for pool in turn:  # the commit folded into the next read: the state read and written once
            _, u = op.delta_read_folded(q, k, v, beta, alpha, pool, slots, *pending[id(pool)])
            op.pending_record(*pending[id(pool)], slots, k, u, alpha, keep)
        if rep:
            read.append(state / (middle - started) / 1e9)
            commit.append(2 * state / (ended - middle) / 1e9)
            separate_ms.append(1e3 * (ended - started))
            folded_ms.append(1e3 * (time.perf_counter() - ended))
    return {"state_bytes_a_step": state, "dram_gb_s": statistics.median(dram),
            "delta_read_gb_s": statistics.median(read), "state_commit_gb_s": statistics.median(commit),
            "read_and_commit_ms": statistics.median(separate_ms), "folded_ms": statistics.median(folded_ms)}


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not kernels.load():
        raise SystemExit("linserve's CPU kernels did not build here: nothing to measure")
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "shape": {"layers": LAYERS, "heads": HEADS, "dk": DK, "dv": DV}, "rows": {}}
    for rows in args.rows:
        result["rows"][rows] = {"cold": rates(rows, LAYERS, args.reps), "warm": rates(rows, 2, args.reps)}
        print(rows, result["rows"][rows], file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
