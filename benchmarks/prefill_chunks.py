"""Short prompt chunks: the model's eager prefill against the compiled prefill program (server/engine/
prefill_program.py), side by side in one process on the same slot — what a served load pays whenever a request
arrives (its prompt prefilled one `max_prefill_while_decoding` chunk a step while the others decode):

    python benchmarks/prefill_chunks.py [--model DIR] [--lengths 1 4 8 16 32 64] [--rows 1] [--reps 5] [--out FILE]

Both on the engine's prefill thread count (the program's Inductor kernels keep the decode count they were built
for; linserve's own kernels follow). The program is loaded from the compile cache `linserve serve` uses (built
first if absent: `linserve compile` builds it too), for the server's default `prefill_program_tokens`; a chunk of L
tokens is ⌈L / T⌉ calls, as the engine makes them. Both forms give the same bits
(tests/server/engine/test_prefill_program.py) — checked here too.
Median milliseconds per chunk, interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_ms  # noqa: E402

from linserve.model import numerics
from linserve.model.checkpoint import load_served
from linserve.model.loading import DEFAULT_CHECKPOINT, resolve_dtype
from linserve.server.engine.compile.compiled_decode import DecodeStep
from linserve.server.engine.cpu_threads import apply_threads, weight_bytes
from linserve.server.engine.prefill_program import PREFILL_ROWS, prefill_kind
from linserve.server.engine.sampling import SlotSampling
from linserve.server.engine.state_pool import StatePool
from linserve.server.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--rows", type=int, default=1, help=f"chunks prefilled together (at most {PREFILL_ROWS})")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    settings = Settings()
    device = torch.device("cpu")
    dtype = resolve_dtype(settings.dtype, device)
    model, _ = load_served(args.model, device, dtype)
    plan = apply_threads(settings.threads, settings.prefill_threads, weight_bytes(model))  # as `serve` (cache key)
    slots = settings.num_slots
    pool = StatePool(model, slots, device)
    sampling = SlotSampling(slots, model.config.vocab_size, device)
    kind = prefill_kind(settings.prefill_program_tokens)
    step = DecodeStep(model, pool, sampling, device, "on", min(slots, PREFILL_ROWS), settings.compile_cache_dir,
                      settings.compile_autotune, kind=kind)
    step.start()
    if not step.wait_compiled(3600) or step.status != "compiled":
        raise SystemExit(f"the prefill program is not compiled ({step.status})")
    numerics.flush_subnormals()
    torch.set_num_threads(plan.prefill_threads)  # both forms on the engine's prefill count, as it runs them
    T, rows = kind.tokens, list(range(args.rows))
    results = {"model": args.model, "dtype": str(dtype), "tokens_per_call": T, "rows": args.rows,
               "threads": plan.describe(), "lengths": {}}
    with torch.inference_mode():
        for length in args.lengths:
            ids = [[(37 * j + 11 * r) % 4000 + 1 for j in range(length)] for r in rows]

            def eager(ids=ids):
                logits, state = model(torch.tensor(ids), pool.gather(rows))
                return logits[:, -1].float(), state

            def program(ids=ids, length=length):
                for offset in range(0, length, T):
                    n = min(T, length - offset)
                    chunk = [row[offset : offset + n] + [0] * (T - n) for row in ids]
                    (logits,) = step.run([*map(list, zip(*chunk)), rows, [n] * len(rows)])
                return logits

            start = pool.gather(rows)
            want, _ = eager()
            got = program()
            pool.scatter(rows, start)
            same = bool(torch.equal(got, want))
            rounds = {"eager": [], "program": []}
            for _ in range(args.reps):  # interleaved: the host's drift hits both alike
                rounds["eager"].append(median_ms(eager, 1))
                rounds["program"].append(median_ms(program, 1))
                pool.scatter(rows, start)
            eager_ms, program_ms = statistics.median(rounds["eager"]), statistics.median(rounds["program"])
            results["lengths"][length] = {"eager_ms": eager_ms, "program_ms": program_ms,
                                          "speedup": eager_ms / program_ms, "same_bits": same}
            print(f"{length:4d} tokens × {args.rows}: eager {eager_ms:7.2f} ms, program {program_ms:6.2f} ms "
                  f"({eager_ms / program_ms:.1f}×), same bits: {same}", flush=True)
    step.close(wait=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
