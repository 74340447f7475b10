"""Intra-op threads that yield to a busy host: the CPUs other processes hold from this one, read from the kernel's
counters, and the thread count that leaves them be.

libgomp's workers spin at every barrier before they sleep. On a 2-core host with one core taken by another process,
a 2-thread op's worker spins through the time slice the thread it waits for needs: the shipped model's 4,011-token
prefill took 2.3 s beside a busy loop against 0.64 s quiet, and 0.88 s on one thread (docs/benchmarks.md, "Threads
beside a busy neighbour"). `OMP_WAIT_POLICY=PASSIVE` removes the spinning but costs 12–28% on a quiet host (each
parallel region then waits for a futex wake-up), and the policy is fixed when the process starts. The thread
count is not: it is per thread and changes between two ops for well under a microsecond, and the exact path's
results are the same bits at any count (tests/model/families/test_thread_count.py). So the engine keeps libgomp's
default and runs each phase on the CPUs that are free *now*:

- every `WINDOW_S` at most (a step reads the cached count otherwise) it reads /proc/stat's per-CPU counters over
  the CPUs of its affinity mask, its own CPU time (/proc/self/stat) and, under a cgroup CPU quota, the cgroup's
  usage (cpu.stat `usage_usec`, v1: cpuacct.usage);
- others = the CPU time those counters grew by, less its own, per second of the window (steal included: a CPU
  the hypervisor took is not free);
- free = min(CPUs of the mask − others on them, quota − others in the cgroup); the phase's count is its planned
  count capped at free rounded to the nearest CPU (a CPU counts as held once others use more than half of it),
  at least 1;
- a window in which the engine sat idle is not a measurement: what others did while it waited — a load
  generator starting up, a peer's benchmark, a batch job that has ended — says little about what they do beside
  its next steps. The counts of the last window the engine worked through stand (a neighbour that was busy then
  is still assumed), and the next window is `FIRST_WINDOW_S` long, so one that started while the engine waited is
  seen within a tenth of a second. Idle is what the engine says (`waiting`: it blocked with nothing to step, for
  `IDLE_GAP_S` or longer, however short against the window) or, where it did not say, no step asked for longer
  than a window while this process used less than `IDLE_SHARE` of a CPU. (Measured: a one-stream request
  arriving after the load generator's own start-up ran all of its 512 tokens on one thread, 0.6 of a CPU "held"
  by a process that had finished; "A window the engine sat out" in docs/benchmarks.md. And a pause shorter than
  the window — 0.3 s while another process ran a burst on both CPUs — ended a window that counted the burst, and
  the next request's first half second ran on one thread: "A pause shorter than the window".)

The frontend process (`api_servers: 1`) and a load tester on the same host count as others: they compete for the
same cores, as a neighbour does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu_threads import CGROUP_ROOT, ThreadPlan, affinity_set, cgroup_quota_dir
from .proc_stat import cpus_busy_seconds, process_seconds
from .thread_trial import ThreadTrials

logger = logging.getLogger("linserve.engine")

WINDOW_S = 0.5  # counters are read at most this often; between reads a phase reuses the last count
FIRST_WINDOW_S = 0.1  # the window after one the engine sat idle through (/proc/stat counts 10 ms ticks)
IDLE_SHARE = 0.25  # a window without a step asking in it, where this process used less of a CPU: idle
IDLE_GAP_S = 0.05  # the engine blocked with nothing to step at least this long: the window it ends is no measurement


@dataclass(frozen=True)
class Counters:
    at: float  # the clock (time.monotonic) when read
    busy_s: float  # CPU seconds the mask's CPUs were busy, everyone's
    own_s: float  # this process's CPU seconds (all its threads)
    cgroup_s: float | None  # the quota's cgroup's CPU seconds (None: no quota)


def cgroup_usage_seconds(directory: Path, root: Path = CGROUP_ROOT) -> float | None:
    """The CPU time of a cgroup and its children: v2 cpu.stat `usage_usec`, else v1's cpuacct.usage (ns)."""
    try:
        for line in (directory / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpuacct" / "cpuacct.usage", root / "cpu,cpuacct" / "cpuacct.usage"):
        try:
            return int(v1.read_text()) / 1e9
        except (OSError, ValueError):
            continue
    return None


class CpuContention:
    """How many of this process's CPUs other processes hold, over the last window."""

    def __init__(self, cpus: frozenset[int], quota: tuple[float, Path] | None = None, proc: Path = Path("/proc"),
                 cgroup_root: Path = CGROUP_ROOT, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.cpus, self.quota, self.proc, self.cgroup_root, self.window_s = cpus, quota, proc, cgroup_root, window_s
        self.clock, self.cpu_clock = clock, cpu_clock
        self.last = self.read()
        self.others = 0.0  # CPUs others used in the last window (0 until a window has passed)
        self.asked = (self.last.at, cpu_clock())  # the clock and this process's CPU seconds at the last `update`
        self.due_s = window_s  # the length of the window now running
        self.waiting_since: float | None = None  # the clock when the engine blocked with nothing to step

    @classmethod
    def here(cls, window_s: float = WINDOW_S) -> CpuContention | None:
        """This process's, or None where the kernel's counters cannot be read (not Linux)."""
        try:
            return cls(affinity_set(), cgroup_quota_dir(), window_s=window_s)
        except (OSError, ValueError, IndexError):
            return None

    def read(self) -> Counters:
        stat = (self.proc / "stat").read_text()
        own = (self.proc / "self" / "stat").read_text()
        usage = cgroup_usage_seconds(self.quota[1], self.cgroup_root) if self.quota else None
        return Counters(self.clock(), cpus_busy_seconds(stat, self.cpus), process_seconds(own), usage)

    def waiting(self) -> None:
        """The engine blocks with nothing to step (called each time it does; the first call of a wait counts)."""
        if self.waiting_since is None:
            self.waiting_since = self.clock()

    def update(self) -> bool:
        """Read the counters if a window has passed since the last read; whether a new figure came of it (not from
        a window the engine sat out). Called before each step."""
        (asked_at, asked_cpu), self.asked = self.asked, (self.clock(), self.cpu_clock())
        waited, self.waiting_since = self.waiting_since, None
        if waited is not None and self.asked[0] - waited >= IDLE_GAP_S:  # it waited: a window starts at this step
            try:
                self.last = self.read()
            except (OSError, ValueError, IndexError):  # (the window runs on from the last read)
                return False
            self.due_s = min(FIRST_WINDOW_S, self.window_s)
            return False
        if self.asked[0] - self.last.at < self.due_s:
            return False
        try:
            now = self.read()
        except (OSError, ValueError, IndexError):  # (a counter that cannot be read now: the last window stands)
            return False
        wall, then = now.at - self.last.at, self.last
        own = now.own_s - then.own_s
        gap = self.asked[0] - asked_at  # since the last step asked (its own CPU clock: the last read may be older)
        if gap > self.window_s and self.asked[1] - asked_cpu < IDLE_SHARE * gap:  # the engine sat this window out
            self.last, self.due_s = now, min(FIRST_WINDOW_S, self.window_s)  # (the last busy window's figure stands)
            return False
        self.due_s = self.window_s
        others = max(0.0, (now.busy_s - then.busy_s - own) / wall)
        if now.cgroup_s is not None and then.cgroup_s is not None:
            others = max(others, (now.cgroup_s - then.cgroup_s - own) / wall)
        self.last, self.others = now, others
        return True

    def free_cpus(self) -> float:
        """The CPUs this process may use that others did not, in the last window."""
        mask = len(self.cpus) - self.others
        return mask if self.quota is None else min(mask, self.quota[0] - self.others)

    def cap(self, planned: int) -> int:
        """`planned` threads, capped at the free CPUs rounded to the nearest (at least 1)."""
        return max(1, min(planned, math.floor(self.free_cpus() + 0.5)))


class ThreadCounts:
    """The engine thread's intra-op count per phase: the plan's decode, compiled-program and prefill counts, each
    capped by the free CPUs when the plan adapts (`adapt_threads`). Called on the engine thread only (the count is
    per thread)."""

    def __init__(self, plan: ThreadPlan, contention: CpuContention | None = None,
                 trials: ThreadTrials | None = None) -> None:
        self.plan = plan
        self.contention = contention if contention is not None or not plan.adaptive else CpuContention.here()
        # a compiled step's count between `threads` and `kernel_threads` timed served (thread_trial.py): when the
        # plan adapts and chose the kernel count by rows itself (`kernel_threads` unset)
        self.trials = trials if trials is not None or not (plan.adaptive and plan.kernel_from_rows > 1) \
            else ThreadTrials()
        # the counts in force now
        self.decode, self.kernel, self.prefill = plan.threads, plan.kernel_threads, plan.prefill_threads
        # linserve's kernels on their own pool while a compiled program built for one thread runs (no OpenMP region
        # of its own then competes with the pool's workers; model/kernels/work_pool.h): the switch, if loaded
        self._pool = work_pool_switch() if plan.kernel_pool and plan.threads == 1 else None
        self._pooled = False

    def _refresh(self) -> None:
        if self.contention is None or not self.contention.update():
            return
        counts = tuple(self.contention.cap(n) for n in (self.plan.threads, self.plan.kernel_threads,
                                                           self.plan.prefill_threads))
        if counts != (self.decode, self.kernel, self.prefill):
            logger.info("intra-op threads: decode %d -> %d, compiled program %d -> %d, prefill %d -> %d (other "
                        "processes hold %.1f of this process's CPUs)", self.decode, counts[0], self.kernel,
                        counts[1], self.prefill, counts[2], self.contention.others)
            self.decode, self.kernel, self.prefill = counts

    def decoding(self, compiled: bool = False, rows: int = 1, key: tuple | None = None) -> None:
        """Before a decode (or verification) step of `rows` rows: the decode count in force — the compiled
        program's (`kernel_threads`) when the step runs a compiled CPU program, whose Inductor kernels keep their
        own, of at least the plan's `kernel_from_rows` rows. `key` — the compiled step's (program, bucket) —
        lets the trials time it on both counts and keep the faster (None, or no trials: the rule by rows)."""
        self._refresh()
        want = self.kernel if compiled and rows >= self.plan.kernel_from_rows else self.decode
        if self.trials is not None:
            if compiled and key is not None:
                want = self.trials.count(key, want, self.decode if want == self.kernel else self.kernel)
            else:
                self.trials.interrupt()  # (an eager step between two of a compiled bucket's is not its cadence)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        self._use_pool(compiled and want > 1)

    def _use_pool(self, on: bool) -> None:
        if self._pool is not None and on != self._pooled:
            self._pool(on)
            self._pooled = on

    def describe(self) -> dict[str, float] | None:
        """The counts in force now (`decode`, `compiled` — a compiled program's own kernels — and `prefill`) and the
        CPUs other processes held in the last window measured; None when the plan does not adapt. Asked from other
        threads too (plain numbers read once each)."""
        if self.contention is None:
            return None
        return {"decode": self.decode, "compiled": self.kernel, "prefill": self.prefill,
                "others_held": round(self.contention.others, 3)}

    def waiting(self) -> None:
        """The engine blocks with nothing to step: what others do until its next step is no measurement."""
        if self.contention is not None:
            self.contention.waiting()

    def interrupt(self) -> None:
        """Before a step whose rows differ from the last one's: its interval is no step's cadence."""
        if self.trials is not None:
            self.trials.interrupt()

    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """The chunked form (prefill, prompt scoring) on the prefill count; the decode count after."""
        self.interrupt()
        self._refresh()
        self._use_pool(False)  # (the chunked form's eager ops run OpenMP regions between the kernels')
        if torch.get_num_threads() != self.prefill:
            torch.set_num_threads(self.prefill)
        try:
            yield
        finally:
            if self.prefill != self.decode:
                torch.set_num_threads(self.decode)  # (the next decode step sets its own: this is eager work's)


def work_pool_switch():
    """`torch.ops.linserve.use_work_pool` (this thread's kernels' regions on their own pool or OpenMP's), or None
    where linserve's kernels are not loaded."""
    from linserve.model import kernels

    return torch.ops.linserve.use_work_pool if kernels.load() else None
