"""`compile=auto` on CPU: is the compiled decode step worth serving on this machine? Measured so that the
answer does not depend on a coin toss at start-up.

The first version timed the first compiled bucket against eager once (5 rounds, medians) and declined below
a fixed 1.1× — where the shipped model on 2 cores sits (1.09× one start, 1.12× the next): the server's speed
for its whole life was decided by noise, and a busy machine at start-up tipped it. Here:

- **A margin, not a line through the data**: compiled unless it is measurably *slower* than eager
  (median < DECLINE_BELOW). A tie serves compiled: it is built already, and it gains more at larger batches
  (docs/benchmarks.md: 1.1× at 1 stream, 1.5× at 8 on 2 cores).
- **More rounds where it is close**: interleaved rounds (eager then compiled, then the other way round), one
  ratio per round; rounds go on, up to MAX_ROUNDS, while the ratios' quartiles straddle the line.
- **Load is seen, not ignored**: CPU contention during the measurement (Linux pressure stall information:
  the share of time runnable tasks waited for a CPU; without it, the measuring thread's time off a CPU) above
  LOAD_LIMIT, or the engine serving meanwhile, makes the verdict *provisional*: used, not stored, and measured
  again once the machine is quiet (`DecodeStep` re-checks every RECHECK_S while the engine is idle, and only
  if the machine's CPUs were idle too for QUIET_PROBE_S just before: a measurement beside another busy
  process would come out provisional again — and two idle servers each measuring while the other served kept
  a core busy between them, with fla's 340M models a 10–50 s measurement every minute).
- **Stored once made quietly**: beside the compiled artifacts (whose directory is keyed by model, program,
  torch and CPU), per intra-op thread count, so a later start of the same server on the same machine uses it
  rather than measuring again.

The verdict and its figures are in `/ready`, `/version` and `/metrics` (`linserve_decode_compile_gain`, …).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable

from .program_compiler import temporary_beside

DECLINE_BELOW = 0.95  # eager/compiled time ratio under which compiled counts as slower here
MIN_ROUNDS, MAX_ROUNDS = 7, 31
CALLS_PER_ROUND = 10
LOAD_LIMIT = 0.10  # contention share above which a measurement is provisional
RECHECK_S = 60.0  # how often a provisional verdict is measured again (while the engine is idle)
PRESSURE_FILES = ("/sys/fs/cgroup/cpu.pressure", "/proc/pressure/cpu")  # this cgroup's, else the machine's
QUIET_PROBE_S = 1.0  # how long the machine must look idle before a re-check measures
PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class Measurement:
    gain: float  # eager time / compiled time: median of the per-round ratios
    low: float  # their first quartile
    high: float  # their third quartile
    rounds: int
    contention: float  # share of the measurement's wall time that runnable tasks waited for a CPU (0 … 1)


@dataclass(frozen=True)
class Verdict:
    decision: str  # "compiled" or "declined"
    batch: int  # the bucket measured
    threads: int  # torch's intra-op threads when measured
    measurement: Measurement
    provisional: bool  # measured under load or while serving: not stored, measured again when quiet
    measured_at: float  # unix seconds
    source: str = "measured"  # or "stored": read from the compile cache, not measured by this process

    def describe(self) -> dict:
        m = self.measurement
        return {"decision": self.decision, "gain": round(m.gain, 3), "gain_quartiles": [round(m.low, 3),
                round(m.high, 3)], "rounds": m.rounds, "contention": round(m.contention, 3), "batch": self.batch,
                "threads": self.threads, "provisional": self.provisional, "source": self.source,
                "measured_at": int(self.measured_at), "decline_below": DECLINE_BELOW}


def judge(measurement: Measurement, batch: int, threads: int, served_meanwhile: bool = False) -> Verdict:
    decision = "declined" if measurement.gain < DECLINE_BELOW else "compiled"
    provisional = served_meanwhile or measurement.contention > LOAD_LIMIT
    return Verdict(decision, batch, threads, measurement, provisional, time.time())


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


class Contention:
    """`with Contention() as c: …` then `c.share`: how much of the block's wall time runnable tasks waited
    for a CPU — from the kernel's pressure stall information (`some … total=` microseconds) where there is
    one; else 1 − the calling thread's CPU time / wall time (a thread that computes all along is never off
    a CPU unless something else has it). PSI is preferred: inside a server the measuring thread also waits
    for other reasons (seen: 18% off-CPU in a quiet `linserve serve`, while PSI said 4% and two busy loops
    made it 50%)."""

    def __init__(self, pressure_files: tuple[str, ...] = PRESSURE_FILES) -> None:
        self.path = next((p for p in pressure_files if readable_pressure(p) is not None), None)
        self.share = 0.0

    def __enter__(self) -> Contention:
        self._stalled = readable_pressure(self.path) if self.path else None
        self._thread, self._wall = time.thread_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self._wall, 1e-9)
        stalled = readable_pressure(self.path) if self._stalled is not None else None
        if stalled is not None:
            share = (stalled - self._stalled) / 1e6 / wall
        else:
            share = 1.0 - (time.thread_time() - self._thread) / wall
        self.share = min(max(share, 0.0), 1.0)


def readable_pressure(path: str | None) -> int | None:
    """The `some` line's cumulative stall microseconds of a PSI file, or None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, TypeError, ValueError, IndexError):
        pass
    return None


def busy_share(wait: Callable[[float], bool], seconds: float = QUIET_PROBE_S, path: str = PROC_STAT) -> float | None:
    """The share of the machine's CPU time spent busy (not idle or waiting for I/O) over `seconds`, from
    /proc/stat's first line, while the caller waits (`wait(seconds)`: True when it should stop). None where
    /proc/stat cannot be read, or when the wait was stopped."""
    before = _cpu_times(path)
    if before is None or wait(seconds):
        return None
    after = _cpu_times(path)
    if after is None:
        return None
    total = sum(after) - sum(before)
    idle = (after[3] + after[4]) - (before[3] + before[4])  # idle, iowait
    return None if total <= 0 else min(max(1.0 - idle / total, 0.0), 1.0)


def _cpu_times(path: str) -> list[int] | None:
    try:
        with open(path) as f:
            fields = f.readline().split()
        return [int(v) for v in fields[1:9]] if fields and fields[0] == "cpu" and len(fields) >= 9 else None
    except (OSError, ValueError):
        return None


def measure(eager: Callable, compiled: Callable, args: tuple, hold: Callable | None = None,
            timer: Callable[[], float] = time.perf_counter, contention: Contention | None = None) -> Measurement:
    """Time `eager(*args)` against `compiled(*args)` in interleaved rounds of CALLS_PER_ROUND calls each.
    `hold()` is a context manager entered around each round (the engine's step lock: a round never overlaps
    a served step, and a served step waits one round at most)."""
    ratios: list[float] = []
    probe = contention or Contention()
    with probe:
        while True:
            with hold() if hold is not None else nullcontext():
                seconds = [0.0, 0.0]  # eager, compiled
                for which in ((0, 1) if len(ratios) % 2 == 0 else (1, 0)):
                    fn = (eager, compiled)[which]
                    started = timer()
                    for _ in range(CALLS_PER_ROUND):
                        fn(*args)
                    seconds[which] = timer() - started
            ratios.append(seconds[0] / max(seconds[1], 1e-12))
            if len(ratios) >= MAX_ROUNDS:
                break
            if len(ratios) >= MIN_ROUNDS:
                low, _, high = quartiles(ratios)
                if not low < DECLINE_BELOW <= high:
                    break
    low, median, high = quartiles(ratios)
    return Measurement(median, low, high, len(ratios), probe.share)


class VerdictStore:
    """Quietly made verdicts, one JSON file per intra-op thread count in the compile cache directory."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory

    def path(self, threads: int) -> str | None:
        return os.path.join(self.directory, f"auto-verdict-threads{threads}.json") if self.directory else None

    def load(self, threads: int) -> Verdict | None:
        path = self.path(threads)
        try:
            with open(path) as f:
                data = json.load(f)
            measurement = Measurement(**data.pop("measurement"))
            verdict = Verdict(**data, measurement=measurement)
        except (OSError, TypeError, ValueError, KeyError):
            return None  # none yet, or unreadable: measure again
        if verdict.provisional or verdict.decision not in ("compiled", "declined") or verdict.threads != threads:
            return None
        return Verdict(**{**asdict(verdict), "measurement": measurement, "source": "stored"})

    def save(self, verdict: Verdict) -> None:
        path = self.path(verdict.threads)
        if path is None or verdict.provisional:
            return
        os.makedirs(self.directory, exist_ok=True)
        temporary = temporary_beside(path)
        with open(temporary, "w") as f:
            json.dump(asdict(verdict), f)
        os.replace(temporary, path)  # atomic: two servers starting together never see half a file
