"""The intra-op thread count and OpenMP's waiting, measured where it matters: a served load. For each thread
count and each OpenMP variant, `linserve serve --threads N` (with the variant's environment) is started and
`linserve bench`'s client drives 1 stream and 8 streams; tokens/s are compared side by side in one run
(configurations in turn within each repetition, so noise falls on all of them).

    python benchmarks/threads.py [--threads 1 2 4] [--variants default passive active bind] [--reps 2] [--quick]

Variants: `default` (libgomp's own: spin a while, then sleep), `passive` (OMP_WAIT_POLICY=PASSIVE: sleep at
once), `active` (OMP_WAIT_POLICY=ACTIVE: spin), `bind` (OMP_PROC_BIND=close, OMP_PLACES=cores: pinned). With
one thread there are no OpenMP waits or workers to pin, so only `default` runs for it. The server's default
(server/engine/cpu_threads.py) is what this decides; `best` names the fastest configuration per load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import add_compile_argument, emit, machine_check, reference_workload_ms  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402
from linserve.server.engine.cpu_threads import affinity_cpus, default_threads, usable_cpus  # noqa: E402

VARIANTS = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
}


def rate(port: int, streams: int, tokens: int) -> float:
    spec = LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=streams, requests=streams, warmup=0,
                    prompt_tokens=32, max_tokens=tokens, ignore_eos=True, temperature=0.8)
    run = drive(spec)
    records, wall = run.records, run.wall_s
    assert all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
    return sum(r.completion_tokens for r in records) / wall


def interleaved_rates(ports: dict, loads: dict[str, tuple[int, int]], reps: int) -> dict:
    """{(server, load): [tokens/s per repetition]}: a warm-up each, then every load on every server in turn
    within each repetition, so the machine's drift falls on all of them."""
    rates = {(key, load): [] for key in ports for load in loads}
    for port in ports.values():
        rate(port, 1, 8)  # warm-up
    for _ in range(reps):
        for load, (streams, tokens) in loads.items():
            for key, port in ports.items():
                rates[(key, load)].append(rate(port, streams, tokens))
    return rates


def candidate_threads() -> list[int]:
    usable = int(usable_cpus())
    counts = {1, 2, 4, 8, usable - 1, usable, default_threads(usable_cpus())}
    return sorted(n for n in counts if 1 <= n <= max(usable, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--threads", type=int, nargs="+", help="counts to try [default: 1, 2, 4, 8, usable-1, usable]")
    parser.add_argument("--variants", nargs="+", default=["default", "passive", "active", "bind"],
                        choices=list(VARIANTS))
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream at 1 stream (half at 8)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--port", type=int, default=8781)
    parser.add_argument("--quick", action="store_true", help="1 and 2 threads, default variant, short loads, eager")
    parser.add_argument("--out")
    add_compile_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.threads, args.variants, args.tokens, args.reps, args.compile = [1, 2], ["default"], 16, 1, "off"
    counts = args.threads or candidate_threads()
    configs = [(n, v) for n in counts for v in args.variants if n > 1 or v == "default"]
    loads = {"1_stream": (1, args.tokens), "8_streams": (8, max(args.tokens // 2, 1))}
    before = reference_workload_ms()
    servers = {}
    try:
        for index, (n, variant) in enumerate(configs):  # all up at once: idle servers cost nothing
            env = {**VARIANTS[variant], "LINSERVE_SESSION_STORE": "none"}
            servers[(n, variant)] = (args.port + index, start_server(
                args.model, args.port + index, 64, extra=["--log-level", "warning", "--threads", str(n)],
                env=env, compile=args.compile))
        versions = {key: httpx.get(f"http://127.0.0.1:{port}/version", timeout=10).json()
                    for key, (port, _) in servers.items()}
        rates = interleaved_rates({key: port for key, (port, _) in servers.items()}, loads, args.reps)
    finally:
        for _, process in servers.values():
            process.terminate()
        for _, process in servers.values():
            process.wait(30)
    table = {}
    for (n, variant), version in versions.items():
        step = version.get("decode_step") or {}
        row = {"threads": version["threads"], "variant": variant, "decode_step": step.get("status")}
        for load in loads:
            samples = rates[((n, variant), load)]
            row[load] = {"tokens_per_s": statistics.median(samples), "spread": [min(samples), max(samples)]}
        table[f"{n} threads, {variant}"] = row
    best = {load: max(table, key=lambda name: table[name][load]["tokens_per_s"]) for load in loads}
    result = {"cpus": {"affinity": affinity_cpus(), "usable": usable_cpus(),
                       "default_threads": default_threads(usable_cpus())},
              "compile": args.compile, "tokens": args.tokens, "reps": args.reps,
              "machine": machine_check(before, reference_workload_ms()), "configs": table, "best": best}
    emit(result, args.out)


if __name__ == "__main__":
    if os.environ.get("OMP_NUM_THREADS"):
        print("note: OMP_NUM_THREADS is set; each server's --threads overrides it", file=sys.stderr)
    main()
