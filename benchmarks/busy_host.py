"""Threads beside a busy neighbour (issue 55, item 5): a long prefill on the default prefill threads, then a run
of batch-1 decode steps, with and without a process spinning on one core beside it, for each OpenMP waiting
policy.

libgomp's workers spin at barriers for a while before they sleep (its default); while another process holds the
other core, a spinning worker burns the time slice the thread it waits for needs — a 4,011-token prefill on 2
threads took a median 4.8–25 s beside other work against 2.1 s with one thread. Each configuration runs in a fresh
process (OpenMP reads its environment once), the variants in turn within each repetition:

- `default`: OMP_WAIT_POLICY unset in the environment the process starts with (libgomp's spin-then-sleep);
- `passive`: OMP_WAIT_POLICY=PASSIVE (sleep at once);
- `spin`: GOMP_SPINCOUNT=--spin-count (spin that many pause loops, ~tens of microseconds, then sleep);
- `one_thread`: a single intra-op thread (no barriers at all).

    python benchmarks/busy_host.py [--model DIR] [--tokens 4011] [--decode-steps 64] [--threads 2] [--reps 5]
                                   [--spin-count 10000] [--quick] [--out FILE]

`--served` measures the server instead: `linserve serve` as it starts by default (its intra-op threads adapt to
the CPUs other processes leave free: server/engine/cpu_contention.py) beside the same server with
`LINSERVE_ADAPT_THREADS=false` (its planned counts always), both up at once, each load on each in turn: the
time to the first token of a --tokens prompt (prefill) and one stream's decode tokens/s, quiet and beside the loop.

    python benchmarks/busy_host.py --served [--model DIR] [--tokens 4011] [--reps 3] [--out FILE]

The decode steps are the model's own one-token forward (eager, bf16) on the prefilled state: the barrier
pattern of a decode program, a parallel region per projection. `default` here is what a process gets when its
environment says nothing (server/engine/cpu_threads.py says what `linserve serve` sets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit  # noqa: E402

WORKLOAD = """
import json, statistics, sys, time, torch
from linserve.model.checkpoint import load_served
from linserve.model.loading import in_dtype
torch.set_num_threads({threads})
model = in_dtype(load_served({model!r}, torch.device("cpu"))[0], torch.bfloat16).eval()
vocab = model.config.vocab_size
ids = torch.randint(1, vocab - 1, (1, {tokens}), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(ids[:, :256])  # warm-up
    started = time.perf_counter()
    state = None
    for start in range(0, ids.shape[1], 256):  # the engine's prefill chunks
        _, state = model(ids[:, start:start + 256], state)
    prefill = time.perf_counter() - started
    steps = []
    for i in range({steps}):
        began = time.perf_counter()
        _, state = model(ids[:, i:i + 1], state)
        steps.append(time.perf_counter() - began)
print(json.dumps({{"seconds": prefill, "step_ms": 1e3 * statistics.median(steps) if steps else None}}))
"""

OMP_VARIABLES = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")


def variants(spin_count: int) -> dict:
    """name -> (environment, threads or None for --threads)"""
    return {"default": ({}, None), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
            "spin": ({"GOMP_SPINCOUNT": str(spin_count)}, None), "one_thread": ({}, 1)}


def run_workload(model: str, tokens: int, steps: int, threads: int, extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    env.update(extra_env)
    code = WORKLOAD.format(model=model, tokens=tokens, steps=steps, threads=threads)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def served(args) -> dict:
    from serving_overhead import start_server

    from linserve.server.bench.client import LoadSpec
    from linserve.server.bench.processes import drive

    seeds = iter(range(1, 1_000_000))

    def load(port: int, prompt_tokens: int, max_tokens: int) -> list:  # (a new prompt each: no prefix cache hit)
        spec = LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=1, requests=1, warmup=0, seed=next(seeds),
                        prompt_tokens=prompt_tokens, max_tokens=max_tokens, ignore_eos=True, temperature=0.8)
        records = drive(spec).records
        assert all(r.ok for r in records), [r.error for r in records if not r.ok]
        return records

    servers = {"adaptive": {}, "pinned": {"LINSERVE_ADAPT_THREADS": "false"}}
    processes = {}
    result = {"model": args.model, "tokens": args.tokens, "cpus": os.cpu_count(), "ttft_s": {}, "decode_tok_s": {}}
    try:
        for i, (name, env) in enumerate(servers.items()):
            processes[name] = start_server(args.model, 8790 + i, 4, env=env)
        for name in servers:
            load(8790 + list(servers).index(name), 16, 8)  # warm-up
        for neighbour in ("quiet", "busy"):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour == "busy" else None
            try:
                time.sleep(1.5)  # (a window of the engine's counters passes)
                ttft, rate = {n: [] for n in servers}, {n: [] for n in servers}
                for _ in range(args.reps):
                    for i, name in enumerate(servers):
                        ttft[name].append(load(8790 + i, args.tokens, 1)[0].token_times[0])
                        record = load(8790 + i, 16, 256)[0]
                        times = record.token_times
                        rate[name].append((len(times) - 1) / (times[-1] - times[0]))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            result["ttft_s"][neighbour] = {n: summary(v) for n, v in ttft.items()}
            result["decode_tok_s"][neighbour] = {n: summary(v) for n, v in rate.items()}
            print(neighbour, result["ttft_s"][neighbour], result["decode_tok_s"][neighbour], file=sys.stderr)
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(60)
    return result


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "max": round(max(values), 3),
            "all": [round(x, 3) for x in values]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory [the shipped model]")
    parser.add_argument("--tokens", type=int, default=4011)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the prefill's intra-op threads (default policy)")
    parser.add_argument("--spin-count", type=int, default=10000, help="GOMP_SPINCOUNT of the `spin` variant")
    parser.add_argument("--variants", nargs="+", default=["default", "passive", "spin", "one_thread"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--served", action="store_true", help="linserve serve, adaptive threads vs pinned")
    parser.add_argument("--quick", action="store_true", help="a short prefill, 4 steps, once, two variants (tests)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.decode_steps, args.reps, args.variants = 256, 4, 1, ["default", "one_thread"]
    if args.model is None:
        from linserve.model.loading import DEFAULT_CHECKPOINT

        args.model = str(DEFAULT_CHECKPOINT)
    if args.served:
        emit(served(args), args.out)
        return
    chosen = {name: value for name, value in variants(args.spin_count).items() if name in args.variants}
    result = {"model": args.model, "tokens": args.tokens, "decode_steps": args.decode_steps,
              "threads": args.threads, "spin_count": args.spin_count, "cpus": os.cpu_count(),
              "seconds": {}, "decode_step_ms": {}}
    for neighbour in ("quiet", "busy"):
        spinner = None
        if neighbour == "busy":  # one process spinning on a core for the whole run (bounded: killed after)
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            runs = {name: [] for name in chosen}
            for _ in range(args.reps):
                for name, (env, threads) in chosen.items():
                    runs[name].append(run_workload(args.model, args.tokens, args.decode_steps,
                                                   threads or args.threads, env))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        result["seconds"][neighbour] = {name: summary([r["seconds"] for r in v]) for name, v in runs.items()}
        if args.decode_steps:
            result["decode_step_ms"][neighbour] = {name: summary([r["step_ms"] for r in v])
                                                   for name, v in runs.items()}
        print(neighbour, result["seconds"][neighbour], result["decode_step_ms"].get(neighbour), file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
