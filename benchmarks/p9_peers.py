"""SPEC P9 against the peer — linserve vs llama.cpp's `llama-server` (GPT-2 6×256 and Mamba 12×256, random
weights, GGUF F32), identical `linserve bench` loads, side by side in one run.

    bash benchmarks/peers/build_llama_server.sh && python benchmarks/peers/make_models.py   # once (~15 min)
    python benchmarks/p9_peers.py [--reps 3] [--api-servers 0|1] [--quick] [--out FILE] [--plot PNG]

Loads (each repetition runs every load on every server, servers in turn): 1 stream × 512 tokens, 8 streams ×
256 tokens, 1 stream × 8,192 tokens (ITL p50 of the first and the last 1,024 tokens). Every server first runs
each of the two short loads once, unmeasured (a linserve just started times each compiled bucket on one and two
threads over its first ~256 steps: docs/engine.md, "Each compiled step's count, timed served"). All three
servers run at once on 127.0.0.1 (idle ones cost nothing): `llama-server -np 8 -cb -t T` (`--llama-threads`, default 2:
its best measured count here) and `linserve serve --threads N` (`--threads`; default: the server's own
default). Target: linserve's tokens/s ≥ the faster peer's at 1 and 8 streams, and linserve's ITL late/early
≤ 1.10. A fixed reference workload is timed before and after (benchmarks/common.py): the result says whether
the machine stayed quiet, and a ratio from a run that was not is not a result.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from common import (  # noqa: E402
    add_compile_argument,
    emit,
    machine_check,
    reference_workload_ms,
    require_free_port,
    wait_until_up,
)
from serving_overhead import start_server  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402
from linserve.server.bench.report import plot, summarize  # noqa: E402

PEERS = Path(__file__).resolve().parents[1] / "data" / "peers"
LLAMA_SERVER = PEERS / "llama.cpp" / "bin" / "llama-server"


def start_llama(gguf: Path, port: int, context_per_slot: int, threads: int) -> subprocess.Popen:
    command = [str(LLAMA_SERVER), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-np", "8", "-cb",
               "-t", str(threads), "-c", str(8 * context_per_slot), "--log-disable"]
    require_free_port(port)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_until_up(process, f"http://127.0.0.1:{port}/health", "llama-server")


def one_load(port: int, streams: int, tokens: int) -> tuple[dict, list]:
    spec = LoadSpec(url=f"http://127.0.0.1:{port}", concurrency=streams, requests=streams, warmup=0,
                    prompt_tokens=32, max_tokens=tokens, ignore_eos=True, temperature=0.8)
    run = drive(spec)
    records = run.records
    failed = [r.error or r.status for r in records if not r.ok]
    assert not failed, failed
    return summarize(spec, run, max(tokens // 16, 1)), records


def itl_p50_ms(records, low: int, high: int) -> float:
    gaps = [
        r.token_times[i] - r.token_times[i - 1]
        for r in records
        for i in range(max(low, 1), min(high, len(r.token_times)))
    ]
    return 1e3 * statistics.median(gaps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short loads, one repetition")
    parser.add_argument("--out")
    parser.add_argument("--plot", help="PNG: ITL vs position of the 8,192-token load, all three servers")
    parser.add_argument("--threads", type=int, help="linserve serve --threads [default: the server's default]")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server -t (default 2)")
    parser.add_argument("--api-servers", type=int, choices=[0, 1],
                        help="linserve serve --api-servers (1: the engine core a process of its own) [default: the "
                        "server's default, as `serve` runs it here; the result's settings record which]")
    parser.add_argument("--speculative", choices=["off", "ngram", "draft"], default="off",
                        help="also run a second linserve with this speculative decoding default, side by side "
                        "(reported as P9_speculative)")
    add_compile_argument(parser)
    args = parser.parse_args(argv)
    if not LLAMA_SERVER.exists():
        raise SystemExit(
            "build the peer first: bash benchmarks/peers/build_llama_server.sh && "
            "python benchmarks/peers/make_models.py"
        )
    loads = {"1x512": (1, 512), "8x256": (8, 256), "1x8192": (1, 8192)}
    if args.quick:
        args.reps, args.compile, loads = 1, "off", {"1x64": (1, 64), "8x32": (8, 32), "1x256": (1, 256)}
    long_load = list(loads)[-1]
    long_tokens = loads[long_load][1]
    reference_before = reference_workload_ms()
    servers = {"linserve": 8901, "llama.cpp gpt2": 8902, "llama.cpp mamba": 8903}
    if args.speculative != "off":
        servers[f"linserve speculative {args.speculative}"] = 8904
    starts = [
        lambda: start_server(
            str(DEFAULT_CHECKPOINT),
            servers["linserve"],
            64,  # the default slot count: the compiled programs `linserve compile` built for `serve` are reused
            extra=["--log-level", "warning",
                   *(["--api-servers", str(args.api_servers)] if args.api_servers is not None else []),
                   *(["--threads", str(args.threads)] if args.threads else [])],
            env={"LINSERVE_SESSION_STORE": "none"},
            compile=args.compile,
        ),
        *([lambda: start_server(str(DEFAULT_CHECKPOINT), 8904, 64,
                                extra=["--log-level", "warning", "--speculative", args.speculative,
                                       *(["--threads", str(args.threads)] if args.threads else [])],
                                env={"LINSERVE_SESSION_STORE": "none"}, compile=args.compile)]
          if args.speculative != "off" else []),
        lambda: start_llama(PEERS / "models" / "gpt2.gguf", servers["llama.cpp gpt2"], long_tokens + 64,
                            args.llama_threads),
        lambda: start_llama(PEERS / "models" / "mamba.gguf", servers["llama.cpp mamba"], long_tokens + 64,
                            args.llama_threads),
    ]
    processes = []
    try:  # one at a time: a server that fails to start stops the ones already up (none is left running)
        for start in starts:
            processes.append(start())
    except BaseException:
        for process in processes:
            process.kill()
        raise
    rates = {(s, load): [] for s in servers for load in loads}
    early_late = {s: [] for s in servers}
    last_summaries = {}
    try:
        linserve_version = httpx.get(f"http://127.0.0.1:{servers['linserve']}/version", timeout=10).json()
        # warm-up: each short load once on every server (a linserve just started times its compiled buckets'
        # thread counts over their first ~256 steps)
        short_loads = [shape for load, shape in loads.items() if load != long_load]
        for port in servers.values():
            for streams, tokens in short_loads:
                one_load(port, streams, tokens)
        for _ in range(args.reps):
            for load, (streams, tokens) in loads.items():
                for name, port in servers.items():  # servers in turn within each load: noise falls on all
                    summary, records = one_load(port, streams, tokens)
                    rates[(name, load)].append(summary["token_throughput_per_s"])
                    if load == long_load:
                        early = itl_p50_ms(records, 0, 1024 if not args.quick else 64)
                        late = itl_p50_ms(records, tokens - (1024 if not args.quick else 64), tokens)
                        early_late[name].append((early, late))
                        last_summaries[name] = summary
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)
    table = {}
    for name in servers:
        row = {
            load: {
                "tokens_per_s": statistics.median(rates[(name, load)]),
                "spread": [min(rates[(name, load)]), max(rates[(name, load)])],
            }
            for load in loads
        }
        early = statistics.median(e for e, _ in early_late[name])
        late = statistics.median(later for _, later in early_late[name])
        row[long_load].update({"itl_p50_first_ms": early, "itl_p50_last_ms": late, "late_over_early": late / early})
        table[name] = row
    machine = machine_check(reference_before, reference_workload_ms())
    settings = {"linserve": {k: linserve_version.get(k) for k in ("threads", "cpu_threads", "dtype", "api_servers",
                                                                  "decode_step")},
                "llama_threads": args.llama_threads}
    result = {"loads": loads, "reps": args.reps, "machine": machine, "settings": settings, "servers": table, "P9": {}}
    for load in list(loads)[:2]:
        peer = max(table["llama.cpp gpt2"][load]["tokens_per_s"], table["llama.cpp mamba"][load]["tokens_per_s"])
        ours = table["linserve"][load]["tokens_per_s"]
        result["P9"][load] = {
            "linserve": ours,
            "faster_peer": peer,
            "ratio": ours / peer,
            "target": ">= 1.0",
            "pass": ours >= peer,
        }
    flat = table["linserve"][long_load]["late_over_early"]
    result["P9"]["itl_late_over_early"] = {"ratio": flat, "target": "<= 1.10", "pass": flat <= 1.10}
    if args.speculative != "off":  # the same loads against a linserve speculating by default, beside the others
        name = f"linserve speculative {args.speculative}"
        result["P9_speculative"] = {}
        for load in list(loads)[:2]:
            peer = max(table["llama.cpp gpt2"][load]["tokens_per_s"], table["llama.cpp mamba"][load]["tokens_per_s"])
            ours = table[name][load]["tokens_per_s"]
            result["P9_speculative"][load] = {"linserve": ours, "faster_peer": peer, "ratio": ours / peer,
                                              "over_plain_linserve": ours / table["linserve"][load]["tokens_per_s"],
                                              "target": ">= 1.0", "pass": ours >= peer}
    emit(result, args.out)
    if args.plot:
        plot(last_summaries, Path(args.plot))


if __name__ == "__main__":
    main()
