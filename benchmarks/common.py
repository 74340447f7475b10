"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import torch

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def steps_settled(steps: list[dict | None]) -> bool:
    """Each of /ready's program statuses (None: no such program) settled: built, loaded or given up on."""
    from linserve.server.engine.compile.compiled_decode import SETTLED

    return all(step is None or step["status"] in SETTLED for step in steps)


def compile_settled(body: dict) -> bool:
    """linserve's /ready body: nothing left to compile — every decode bucket and the prefill program's ready, or
    eager for good. (A prefill program still compiling takes a core from whatever is measured beside it.)"""
    step = body.get("decode_step")
    return step is None or steps_settled([step, step.get("prefill")])


def wait_programs(engine, timeout_s: float = 1800.0) -> bool:
    """An in-process Engine's programs built, loaded or given up on: the decode step's buckets, then the prefill
    program (compiled after the decode step, in a compiler process that takes a core while it runs — measured
    beside it, a 32-stream step ran 1.3-1.5x slower on 2 cores). True if every bucket of both is ready."""
    ready = engine.decode_step.wait_compiled(timeout_s)
    prefill = getattr(getattr(engine, "parts", None), "prefill_step", None)  # (an older tree's engine: none)
    return ready and (prefill is None or prefill.wait_compiled(timeout_s))


def ready_programs(url: str) -> dict | None:
    """/ready's `decode_step` (its buckets: compiled, CUDA graphs of the eager program, compiling), or None."""
    try:
        return httpx.get(url, timeout=5).json().get("decode_step")
    except (httpx.HTTPError, ValueError):
        return None


def wait_settled(url: str, seconds: float, poll_s: float = 1.0) -> bool:
    """Poll a started server's /ready `url` until nothing is left to compile or `seconds` have passed (then the
    programs ready by then are what is measured: on a GPU, graphs of the eager program serve the buckets still
    compiling). True if settled."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if compile_settled(httpx.get(url, timeout=5).json()):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def require_free_port(port: int) -> None:
    """Raise if something already listens on 127.0.0.1:port — a server left from an earlier run would answer for the
    one about to start (which then fails to bind), and a measurement would silently be that stale server's."""
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is in use by another process: stop it (an earlier run's server?) first")


def wait_until_up(process: subprocess.Popen, url: str, what: str, timeout_s: float = 120.0,
                  settled=None, poll_s: float = 0.2) -> subprocess.Popen:
    """Poll `url` every `poll_s` until it answers 200 (and `settled(json body)` holds, if given); kill the process
    and raise if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=1)
            if response.status_code == 200 and (settled is None or settled(response.json())):
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        time.sleep(poll_s)
    process.kill()
    raise RuntimeError(f"{what} did not come up within {timeout_s:.0f} s")


def add_compile_argument(parser) -> None:
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="linserve's decode step (default auto, as `linserve serve`); measured once compiled")


def add_threads_argument(parser) -> None:
    parser.add_argument("--threads", type=int, help="intra-op CPU threads, as `linserve serve --threads` "
                        "[default: the server's default from the usable CPUs]")
    parser.add_argument("--prefill-threads", type=int, help="the same while prefilling, as `linserve serve "
                        "--prefill-threads` [default: the server's]")


def add_dtype_argument(parser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weights' dtype, as `linserve serve --dtype` "
                        "(default auto: bf16 where the CPU computes it)")


def add_device_argument(parser) -> None:
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (default: cpu; auto picks CUDA when available)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device on this machine")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a wall-clock timing covers the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> dict:
    """What the numbers were measured on (goes into every result file)."""
    info = {"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        from linserve.server.engine.cpu_threads import plan_threads

        info["cpus_usable"] = plan_threads(None).usable_cpus
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON, then a PASS/FAIL line per SPEC target in it; write the JSON to `out`."""
    text = json.dumps(result, indent=2)
    print(text)
    for _, verdict in targets(result):
        print(verdict)
    if out:
        Path(out).write_text(text + "\n")


def targets(result: dict, prefix: str = ""):
    """(name, 'P4: PASS (ratio 8.3, target >= 8x)') for every entry with a target and a pass flag."""
    for key, value in result.items():
        if isinstance(value, dict):
            if "target" in value and "pass" in value:
                measured = value.get("ratio", value.get("speedup", value.get("growth", value.get("measured"))))
                shown = f"{measured:.3g}" if isinstance(measured, float) else measured
                yield (
                    prefix + str(key),
                    f"{prefix}{key}: {'PASS' if value['pass'] else 'FAIL'} "
                    f"(measured {shown}, target {value['target']})",
                )
            else:
                yield from targets(value, f"{prefix}{key}.")


# A fixed workload on every CPU this process may use (a 384x384 fp32 matmul chain, in a child process so this
# one's thread settings stay as they are), timed before and after a side-by-side run: a machine that was quiet
# gives the same figure twice. A neighbour that took a core for part of the run moves one of them.
REFERENCE_WORKLOAD = """
import os, statistics, sys, time, torch
torch.set_num_threads(len(os.sched_getaffinity(0)))
a = torch.randn(384, 384, generator=torch.Generator().manual_seed(0))
for _ in range(500): a @ a  # warm: clocks up, pages touched, threads started
times = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    for _ in range(100): a @ a
    times.append(time.perf_counter() - t)
print(1e3 * statistics.median(times))
"""
QUIET_DRIFT = 0.05  # the two timings within 5% of each other


def median_ms(fn, reps: int, inner: int = 20) -> float:
    """Median over `reps` rounds of one call's ms, each round `inner` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - started) / inner)
    return 1e3 * statistics.median(times)


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of a server process and its children (`metrics.ProcessTree`, as its /metrics sums them): with
    the engine core in a process of its own (serve's default on 2 CPUs) that child holds the weights and the pool."""
    from linserve.server.api.common.metrics import ProcessTree

    total = 0
    for member in ProcessTree(pid).pids():
        try:
            with open(f"/proc/{member}/statm") as statm:
                total += int(statm.read().split()[1]) * PAGE_BYTES
        except OSError:
            continue  # gone meanwhile
    return total


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process (every thread), seconds: its own code, and the kernel's work for it; (0, 0) once
    it is gone."""
    from linserve.server.engine.proc_stat import TICKS_PER_S, stat_fields

    fields = stat_fields(pid)  # (from the state on: utime and stime are the 12th and 13th)
    return (0.0, 0.0) if fields is None else (int(fields[11]) / TICKS_PER_S, int(fields[12]) / TICKS_PER_S)


def core_pid(server: int) -> int | None:
    """The engine core of a `linserve serve` process (None: the engine is a thread of `server` itself,
    `--api-servers 0`). It is the server's spawned child with the most threads — the engine thread, its intra-op
    pool, the store's and the channel's — whether `server` is its frontend (`--api-servers 1`) or the supervisor of
    it and of N frontends (each an event loop and a thread or two)."""
    from linserve.server.api.common.metrics import ProcessTree

    spawned = []
    for child in ProcessTree(server).pids()[1:]:
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            threads = len(os.listdir(f"/proc/{child}/task"))
        except OSError:
            continue
        if b"spawn_main" in command:
            spawned.append((threads, child))
    return max(spawned)[1] if spawned else None


def host_busy_seconds() -> float:
    """CPU seconds this process's CPUs have been busy since boot, everyone's (steal included: a CPU the hypervisor
    took was not free) — /proc/stat's counters, as the engine's contention reading takes them."""
    from linserve.server.engine.cpu_contention import cpus_busy_seconds
    from linserve.server.engine.cpu_threads import affinity_set

    return cpus_busy_seconds(Path("/proc/stat").read_text(), affinity_set())


def reference_workload_ms(reps: int = 31) -> float:
    """The reference workload's median time (ms) on this machine, now."""
    import sys

    done = subprocess.run([sys.executable, "-c", REFERENCE_WORKLOAD, str(reps)], capture_output=True, text=True,
                          check=True, timeout=300)
    return float(done.stdout.strip())


def machine_check(before_ms: float, after_ms: float) -> dict:
    """Whether the machine stayed quiet through a run: the reference timed before and after agrees."""
    drift = after_ms / before_ms - 1.0
    return {"reference_before_ms": before_ms, "reference_after_ms": after_ms, "ratio": after_ms / before_ms,
            "target": f"within {1 - QUIET_DRIFT:g}..{1 + QUIET_DRIFT:g} (quiet machine)",
            "pass": abs(drift) <= QUIET_DRIFT}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
