"""The state pool's `settle` (server/engine/state_pool.py): every folded state's pending update in the listed slots
written into the state before anything but a decode program's folded read looks at them — what the verification
program asks before each verification, and a session's export, copy or gather. Timed in one process, alternating:
`pending_settle` (one kernel call for every folded state) against the route it replaced, each state's flags read in
torch and its updates committed with `state_commit` (~15 torch calls a layer), both over the same pending updates
(both routes first checked to leave the same bits).

    python benchmarks/pool_settle.py [--model DIR] [--slots 1 8] [--reps 9] [--threads 1] [--quick] [--out FILE]

The shipped model by default (6 layers of 8 heads × 32 × 32: its state lives in the cache, so this is the calls'
cost); `--model data/p17/linear_attn` for a 340M shape (24 MiB a slot).
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

from linserve.model import kernels  # noqa: E402
from linserve.model.checkpoint import load_served  # noqa: E402
from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.server.engine.state_pool import StatePool  # noqa: E402


def per_state_commits(pool: StatePool, slots: list[int]) -> None:
    """The replaced route: for each folded state, the chosen slots' flags read in torch, each kind's updates
    committed with `state_commit` (the same arithmetic), the flags cleared."""
    chosen = torch.tensor(slots)  # (n,)
    for name, pending in pool.pending.items():
        flags = pending.flag[chosen]  # (n,)
        if not bool(flags.any()):
            continue
        where = chosen[flags != 0]  # (b,)
        for kind in (1, 2):
            index = where[pending.flag[where] == kind]  # (b,)
            if index.numel():
                alpha = pending.alpha[index] if kind == 2 else None  # (b, H, dk)
                torch.ops.linserve.state_commit(pool.buffers[name], index, pending.k[index], pending.u[index], alpha,
                                                torch.ones(index.numel(), dtype=torch.bool))
        pending.flag[where] = 0


def mark_pending(pool: StatePool, slots: list[int]) -> None:
    """A pending update with α (a gated commit's) on every folded state of `slots` (the values stay as they are:
    the time does not depend on them)."""
    for pending in pool.pending.values():
        pending.flag[slots] = 2


def same_states(pool: StatePool, slots: list[int]) -> bool:
    """Both routes over the same random pending updates (half with α) leave the same bits in every buffer."""
    g = torch.Generator().manual_seed(0)
    for name, pending in pool.pending.items():
        pool.buffers[name].copy_(torch.randn(pool.buffers[name].shape, generator=g))
        for tensor in (pending.k, pending.u, pending.alpha):
            tensor.copy_(torch.rand(tensor.shape, generator=g))
        pending.flag[slots] = torch.tensor([1 + slot % 2 for slot in slots], dtype=torch.uint8)
    before = {name: (pool.buffers[name].clone(), pending.flag.clone()) for name, pending in pool.pending.items()}
    per_state_commits(pool, slots)
    theirs = {name: pool.buffers[name].clone() for name in pool.pending}
    for name, (buffer, flag) in before.items():
        pool.buffers[name].copy_(buffer)
        pool.pending[name].flag.copy_(flag)
    pool.settle(slots)
    return all(torch.equal(pool.buffers[name], theirs[name]) for name in pool.pending)


def time_us(pool: StatePool, settle, slots: list[int], inner: int) -> float:
    """One repetition: `inner` settles of freshly marked slots, in µs a settle. Only the settle is timed (the
    marking before it is not), so the figure is a sum of positive durations whatever else the host runs."""
    spent = 0.0
    for _ in range(inner):
        mark_pending(pool, slots)
        started = time.perf_counter()
        settle(slots)
        spent += time.perf_counter() - started
    return spent / inner * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--inner", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 repetition of 5 settles (the test's run)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.inner = 1, 5
    if not kernels.load():
        print("linserve's kernels are not built here: nothing is folded, nothing to settle", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, _ = load_served(args.model, torch.device("cpu"), torch.bfloat16)
    pool = StatePool(model, max(args.slots) + 1, torch.device("cpu"))
    result = {"model": args.model, "folded_states": len(pool.pending), "slot_bytes": pool.slot_bytes,
              "threads": args.threads, "inner": args.inner, "loads": {}}
    for count in args.slots:
        slots = list(range(count))
        same = same_states(pool, slots)
        kernel, python = [], []
        for _ in range(args.reps):  # alternating
            kernel.append(time_us(pool, pool.settle, slots, args.inner))
            python.append(time_us(pool, lambda chosen: per_state_commits(pool, chosen), slots, args.inner))
        entry = {"same_bits": same, "pending_settle_us": statistics.median(kernel),
                 "per_state_commits_us": statistics.median(python)}
        entry["speedup"] = entry["per_state_commits_us"] / entry["pending_settle_us"]
        result["loads"][f"{count} slots"] = entry
        print(f"{count} slot(s), {len(pool.pending)} folded states: pending_settle {entry['pending_settle_us']:.1f} µs,"
              f" per-state commits {entry['per_state_commits_us']:.1f} µs ({entry['speedup']:.2f}x), same bits: {same}",
              file=sys.stderr)
    emit(result, args.out)
    return 0 if all(entry["same_bits"] for entry in result["loads"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
