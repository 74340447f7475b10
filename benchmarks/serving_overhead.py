"""SPEC P5: tokens/s over HTTP/SSE versus in-engine, at 1 and 32 streams, side by side in one run.

    python benchmarks/serving_overhead.py [--model DIR] [--tokens 128] [--reps 3] [--api-servers 0 1] [--quick]
                                          [--out FILE]

In-engine: N streams submitted straight to an Engine in this process. HTTP: the same N streams sent by
`linserve bench`'s client to a `linserve serve` process on 127.0.0.1 with the same engine settings — one
server per `--api-servers` value (0: the engine a thread of the HTTP process; N ≥ 1: the engine core a process
of its own, with N frontend processes), all running side by side. Repetitions alternate between them; medians
are compared. Around every load each side's CPU is read — in-engine this process's, served the engine core's, the
frontends' and the load generator's, and how busy the host's CPUs were — and `cpu_us_per_token` says what the
ratio must be where the CPUs are busy through both runs (`cpu_shares`).
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

from common import (  # noqa: E402
    add_compile_argument,
    add_device_argument,
    add_dtype_argument,
    add_threads_argument,
    compile_settled,
    core_pid,
    cpu_split,
    describe,
    emit,
    host_busy_seconds,
    require_free_port,
    resolve_device,
    wait_programs,
    wait_settled,
    wait_until_up,
)
from engine_inprocess import DecodeTotals, run_streams  # noqa: E402

from linserve.model.loading import DEFAULT_CHECKPOINT, load_model, resolve_dtype  # noqa: E402
from linserve.server.api.common.metrics import ProcessTree  # noqa: E402
from linserve.server.bench.client import LoadSpec  # noqa: E402
from linserve.server.bench.processes import drive  # noqa: E402
from linserve.server.engine import Engine, EngineConfig  # noqa: E402
from linserve.server.generation_defaults import GenerationDefaults  # noqa: E402
from linserve.server.settings import Settings  # noqa: E402

COMPILE_TIMEOUT_S = 900.0  # a cold compile of every bucket takes minutes on 2 cores


def start_server(model: str, port: int, slots: int, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, device: str = "cpu", compile: str = "auto",
                 compile_wait_s: float | None = None) -> subprocess.Popen:
    """`linserve serve` on 127.0.0.1:port, returned once /ready answers 200 and the decode step is compiled
    (or settled on eager) — or, with `compile_wait_s`, once that long has passed after /ready's 200, whatever
    is compiled by then (a GPU's lease is short: the buckets still compiling serve graphs of the eager program)."""
    require_free_port(port)
    command = [sys.executable, "-m", "linserve.server.cli", "serve", "--model", model, "--port", str(port),
               "--device", device, "--num-slots", str(slots), "--compile", compile,
               *(extra or ["--log-level", "warning"])]
    log = os.environ.get("LINSERVE_BENCH_SERVER_LOG")  # a file for the server's output (else discarded)
    output = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (the child holds it)
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                               env={**os.environ, **(env or {})})
    ready = f"http://127.0.0.1:{port}/ready"
    if compile_wait_s is None:
        return wait_until_up(process, ready, "linserve serve", COMPILE_TIMEOUT_S, compile_settled)
    wait_until_up(process, ready, "linserve serve", COMPILE_TIMEOUT_S)
    wait_settled(ready, compile_wait_s)
    return process


def http_rate(port: int, streams: int, tokens: int, server: int | None = None) -> tuple[float, dict]:
    """Tokens/s of `streams` streams through the server on `port`, and (given the server's pid) the CPU each side
    spent a token meanwhile (`cpu_shares`)."""
    spec = LoadSpec(
        url=f"http://127.0.0.1:{port}",
        concurrency=streams,
        requests=streams,
        warmup=0,
        prompt_tokens=16,
        max_tokens=tokens,
        ignore_eos=True,
        temperature=0.8,
    )
    pids = ProcessTree(server).pids() if server is not None else []
    core = core_pid(server) if server is not None else None
    before, busy_before, started = {pid: sum(cpu_split(pid)) for pid in pids}, host_busy_seconds(), time.perf_counter()
    run = drive(spec)
    after, busy, wall = ({pid: sum(cpu_split(pid)) for pid in pids}, host_busy_seconds() - busy_before,
                         time.perf_counter() - started)
    records = run.records
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    generated = sum(r.completion_tokens for r in records)
    spent = {pid: after[pid] - before[pid] for pid in pids}
    cpu = {"client_us": 1e6 * sum(run.cpu_s) / generated, "host_busy_cpus": busy / wall}
    if core is not None:
        cpu["core_us"] = 1e6 * spent.pop(core) / generated
        cpu["frontends_us"] = 1e6 * sum(spent.values()) / generated  # (the frontends, and `serve` above them)
    elif pids:
        cpu["server_us"] = 1e6 * sum(spent.values()) / generated  # the engine a thread of the HTTP process
    return generated / run.wall_s, cpu


def served_threads(port: int) -> dict | None:
    """The server's intra-op counts in force and the CPUs it saw other processes hold (its last measured window), as
    /version's `decode_step` shows them right after a load; None where it shows none (a GPU, or `adapt_threads`
    off). A load the engine ran on capped counts — a neighbour's burst counted in its window — says so here."""
    from urllib.request import urlopen

    with urlopen(f"http://127.0.0.1:{port}/version", timeout=10) as response:
        step = json.load(response).get("decode_step") or {}
    return step.get("cpu_contention")


def cpu_shares(engine: list[dict], http: list[dict]) -> dict:
    """Where the host's CPU went a token, medians over the repetitions: in-engine (`engine_us`: this process, the
    engine alone) and served (the core, the frontends, the load generator). When the CPUs are busy throughout both
    runs (`host_busy_cpus` ≈ the CPUs usable), served / in-engine tokens/s = engine_us / (all that the served run
    spent a token) = the core's share of that × engine_us / core_us — on a host the load generator and the
    frontends share with the engine, P5 is `engine_share` where the core spends a token what the engine alone does."""
    median = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    figures = {"engine_us": median(engine, "engine_us"),
               "engine_host_busy_cpus": median(engine, "host_busy_cpus"),
               **{key: median(http, key) for key in http[0]}}
    served = figures["client_us"] + figures.get("server_us", 0.0) + figures.get("core_us", 0.0) \
        + figures.get("frontends_us", 0.0)
    figures["served_us"] = served
    figures["predicted_ratio"] = figures["engine_us"] / served
    if "core_us" in figures:
        figures["engine_share"] = figures["core_us"] / served
        # (None where the core's counters did not tick: they count 10 ms at a time, a quick load may read 0)
        figures["core_efficiency"] = figures["engine_us"] / figures["core_us"] if figures["core_us"] else None
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--api-servers", type=int, nargs="+", default=[0, 1], choices=range(0, 9),
                        help="one server per value: the engine in the HTTP process (0) or its own with N frontends")
    parser.add_argument("--slots", type=int, default=64, help="the engine's and the servers' slots (a GPU run "
                        "shares served_load's 128: the slot count is compiled into each bucket)")
    parser.add_argument("--compile-wait", type=float, metavar="SECONDS",
                        help="measure after this long even if buckets are still compiling [default: wait for all]")
    parser.add_argument("--out")
    add_device_argument(parser)
    add_compile_argument(parser)
    add_threads_argument(parser)
    add_dtype_argument(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    if args.quick:
        args.tokens, args.reps, args.compile = 16, 1, "off"
    from transformers import AutoTokenizer

    sizes = (1, 32)
    dtype = resolve_dtype(args.dtype, device)  # as serve: every form in this dtype
    model = load_model(args.model, device, dtype).model
    config = EngineConfig.from_settings(
        # the server's settings, compile cache and thread count too
        Settings(session_store="none", num_slots=args.slots, compile=args.compile, threads=args.threads,
                 prefill_threads=args.prefill_threads)
    )
    totals = DecodeTotals()  # the engine thread's Python around the decode program, per row
    engine = Engine(model, AutoTokenizer.from_pretrained(args.model), config, device, totals,
                    dtype=dtype).start()
    # compiled first here: the servers then find the compile cache warm
    wait_programs(engine, *([args.compile_wait] if args.compile_wait is not None else []))
    # the same load on both sides: a server applies the checkpoint's generation defaults (the shipped one's top_k 50)
    sampling = {name: value for name, value in
                GenerationDefaults.read(args.model, model.config.vocab_size).sampling.items() if name != "temperature"}
    extra = ["--log-level", "warning", "--dtype", args.dtype,
             *(["--threads", str(args.threads)] if args.threads else []),
             *(["--prefill-threads", str(args.prefill_threads)] if args.prefill_threads else [])]
    placements = {f"http_api_servers_{a}": a for a in args.api_servers}
    servers = {where: start_server(args.model, args.port + a, args.slots, extra=[*extra, "--api-servers", str(a)],
                                   device=device.type, compile=args.compile, compile_wait_s=args.compile_wait)
               for where, a in placements.items()}
    rates = {(where, n): [] for where in ("engine", *placements) for n in sizes}
    python_us = {n: [] for n in sizes}
    step_ms = {n: [] for n in sizes}  # (program, engine step) per decode step
    cpu = {key: [] for key in rates}  # each run's CPU a token, by process (cpu_shares)
    threads_shown = {key: [] for key in rates if key[0] != "engine"}  # each served run's counts (served_threads)
    try:
        for a in placements.values():
            http_rate(args.port + a, 1, 4)  # warm-up
        for rep in range(args.reps):
            for n in sizes:
                mark, cpu_before, busy_before = totals.mark(), time.process_time(), host_busy_seconds()
                seconds, generated = run_streams(engine, n, args.tokens, f"p5-{rep}-{n}", sampling=sampling)
                spent, busy = time.process_time() - cpu_before, host_busy_seconds() - busy_before
                rates[("engine", n)].append(generated / seconds)
                cpu[("engine", n)].append({"engine_us": 1e6 * spent / generated, "host_busy_cpus": busy / seconds})
                python_us[n].append(totals.python_us_per_row(mark))
                step_ms[n].append(totals.per_step_ms(mark))
                for where, a in placements.items():
                    rate, shares = http_rate(args.port + a, n, args.tokens, servers[where].pid)
                    rates[(where, n)].append(rate)
                    cpu[(where, n)].append(shares)
                    threads_shown[(where, n)].append(served_threads(args.port + a))
    finally:
        engine.stop()
        for server in servers.values():
            server.terminate()
            server.wait(30)
    result = {**describe(device), "threads": engine.threads.describe(), "dtype": str(dtype), "sampling": sampling,
              "tokens_per_stream": args.tokens, "reps": args.reps, "slots": args.slots,
              "engine_programs": engine.decode_step.describe()}
    targets = {1: 0.9, 32: 0.9}  # SPEC P5: 0.9 at both
    for where in placements:
        for n in sizes:
            engine_rate = statistics.median(rates[("engine", n)])
            http = statistics.median(rates[(where, n)])
            result.setdefault("P5", {}).setdefault(where, {})[f"streams_{n}"] = {
                "engine_tokens_per_s": engine_rate,
                "http_tokens_per_s": http,
                "ratio": http / engine_rate,
                "target": f">= {targets[n]}",
                "pass": http / engine_rate >= targets[n],
                "engine_python_us_per_row": statistics.median(python_us[n]),
                "engine_spread": [min(rates[("engine", n)]), max(rates[("engine", n)])],
                "http_spread": [min(rates[(where, n)]), max(rates[(where, n)])],
                "cpu_us_per_token": cpu_shares(cpu[("engine", n)], cpu[(where, n)]),
                "served_threads": threads_shown[(where, n)],  # after each repetition (None: none shown)
            }
        result.setdefault("per_token_1_stream", {})[where] = breakdown(rates, step_ms, where)
    emit(result, args.out)


def breakdown(rates: dict, step_ms: dict, where: str) -> dict:
    """Where a token's time goes at one stream (docs/engine.md): the decode program; the engine step's Python
    around it (gather of the rows, the scatter back, sampling's bookkeeping, detokenizing, delivery); the engine
    loop between steps (scheduling, commands, the stats sink); and the HTTP path (event loop, SSE, the client)."""
    program = statistics.median(p for p, _ in step_ms[1])
    step = statistics.median(s for _, s in step_ms[1])
    engine_token = 1e3 / statistics.median(rates[("engine", 1)])
    http_token = 1e3 / statistics.median(rates[(where, 1)])
    return {
        "program_ms": program,
        "step_python_ms": step - program,
        "engine_loop_ms": engine_token - step,
        "http_ms": http_token - engine_token,
        "engine_token_ms": engine_token,
        "http_token_ms": http_token,
        "in_engine": {"ratio": engine_token / program, "target": "<= 1.3", "pass": engine_token / program <= 1.3},
        "over_http": {"ratio": http_token / program, "target": "<= 1.5", "pass": http_token / program <= 1.5},
    }


if __name__ == "__main__":
    main()
