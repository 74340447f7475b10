"""A load spread over several processes of the load generator, so that the client is never what limits a run.

One Python process parses at most ~45,000–65,000 streamed token events a second (a result's `client.cpu_us_per_token`
says what it cost); a GPU server may stream more than that at 128 streams. `drive` warms the server up
in this process, then starts `processes` workers (spawned: nothing of this process's threads is inherited):
each opens its connections, all start together at one shared epoch (perf_counter is the system's monotonic
clock, the same in every process), they take request indices from one shared counter — the same requests,
prompts and seeds as a single process would send, the same budget and deadline — and send every record back
as it completes. Closed loop: the streams are divided among the workers; open loop: each worker draws Poisson
arrivals at rate/processes (the sum of independent Poisson processes is one at the full rate).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue as queue_module
import threading
import time
from dataclasses import dataclass, field, replace

from .client import BenchError, Issuer, LoadSpec, RequestRecord, drive_load, open_client, run_load, warm_up

START_TIMEOUT_S = 120.0  # workers that are not all ready by then (spawning, importing) fail the run


@dataclass
class LoadRun:
    model: str
    records: list[RequestRecord]
    wall_s: float  # the measured part: from the shared start to the last record
    processes: int = 1
    cpu_s: list[float] = field(default_factory=list)  # CPU seconds of each load-generator process while measuring


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def processes_for(spec: LoadSpec, asked: int | None) -> int:
    """`asked` (at most one per stream), or automatically: one process on a small machine (its cores serve),
    else one per 8 streams, at most a quarter of the CPUs and 8."""
    streams = spec.concurrency or 1
    if asked is not None:
        return max(1, min(asked, streams) if not spec.rate else asked)
    cpus = usable_cpus()
    if cpus < 8 or spec.rate:
        return 1
    return max(1, min(streams // 8, cpus // 4, 8))


def run_async(coroutine):
    """`asyncio.run` on uvloop's event loop where it is installed (uvicorn[standard] brings it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def drive(spec: LoadSpec, progress=None, processes: int | None = None) -> LoadRun:
    """Run the load of `spec` (warm-up included) in `processes` processes (None: `processes_for`)."""
    count = processes_for(spec, processes)
    if count == 1:
        cpu = time.process_time()
        model, records, wall = run_async(run_load(spec, progress))
        return LoadRun(model, records, wall, 1, [time.process_time() - cpu])
    model = run_async(_warm(spec))
    return _spread(replace(spec, model=model, warmup=0), count, progress)


async def _warm(spec: LoadSpec) -> str:
    async with open_client(spec) as client:
        return await warm_up(client, spec)


def _shares(spec: LoadSpec, count: int) -> list[LoadSpec]:
    if spec.rate:
        return [replace(spec, rate=spec.rate / count) for _ in range(count)]
    streams = spec.concurrency or 1
    return [replace(spec, concurrency=streams // count + (index < streams % count)) for index in range(count)]


def _spread(spec: LoadSpec, count: int, progress) -> LoadRun:
    context = multiprocessing.get_context("spawn")
    counter, epoch, barrier, results = context.Value("q", 0), context.Value("d", 0.0), context.Barrier(count + 1), \
        context.Queue()
    workers = [context.Process(target=_worker, name=f"linserve-bench-{index}", daemon=True,
                               args=(share, index, counter, epoch, barrier, results))
               for index, share in enumerate(_shares(spec, count))]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(START_TIMEOUT_S)  # every worker has its client open
        epoch.value = time.perf_counter()
        barrier.wait(START_TIMEOUT_S)  # … and starts now
    except threading.BrokenBarrierError:
        try:  # a worker that failed says why
            kind, _, payload = results.get(timeout=1.0)
        except queue_module.Empty:
            kind = payload = None
        _end(workers)
        raise BenchError(payload if kind == "error" else f"the load generator's {count} processes did not all "
                         f"start within {START_TIMEOUT_S:.0f} s") from None
    records, finished, cpu, errors = [], {}, [0.0] * count, []
    try:
        while len(finished) < count:
            try:
                kind, index, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                lost = [w.name for i, w in enumerate(workers) if i not in finished and not w.is_alive()]
                if lost and results.empty():
                    raise BenchError(f"load-generator process(es) {', '.join(lost)} ended without a result") from None
                continue
            if kind == "record":
                records.append(payload)
                if progress is not None:
                    progress(payload)
            elif kind == "done":
                finished[index], cpu[index] = payload
            else:  # "error"
                errors.append(payload)
                finished[index] = epoch.value
    finally:
        _end(workers)
    if errors:
        raise BenchError(errors[0])
    return LoadRun(spec.model, records, max(finished.values()) - epoch.value, count, cpu)


def _end(workers: list) -> None:
    for worker in workers:
        worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()


def _worker(spec: LoadSpec, index: int, counter, epoch, barrier, results) -> None:
    """One process's share of the load; every record is sent back as it completes, then ("done", end, CPU)."""
    try:
        run_async(_work(spec, index, counter, epoch, barrier, results))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails the run with it
        barrier.abort()
        results.put(("error", index, f"load-generator process {index}: {error.__class__.__name__}: {error}"))


async def _work(spec: LoadSpec, index: int, counter, epoch, barrier, results) -> None:
    async with open_client(spec) as client:
        barrier.wait(START_TIMEOUT_S)
        barrier.wait(START_TIMEOUT_S)
        start, cpu = epoch.value, time.process_time()
        await drive_load(client, spec, spec.model, Issuer(spec, start, counter), start,
                         progress=lambda record: results.put(("record", index, record)),
                         arrivals_seed=spec.seed + 1 + index)
        results.put(("done", index, (time.perf_counter(), time.process_time() - cpu)))
