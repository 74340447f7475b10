"""The process's intra-op CPU threads: how many CPUs this process may use, how many threads the model's ops
get by default, and setting that once, before the model loads.

torch's own default is the host's physical core count. On a small machine that starves the rest of the
server: at one stream on 2 cores, the engine's two OpenMP threads spent about three quarters of every
decode step waiting at barriers for a core that the event loop and the client held, and `OMP_NUM_THREADS=1`
served 2.7x the tokens/s (docs/benchmarks.md, "Threads"). So the default leaves one CPU for everything that
is not the model's arithmetic (event loop, tokenizer, store worker, the client's side of loopback) and caps
the rest: a decode step of this size is a chain of small matrix-vector products whose barriers cost more than
a wide split saves. A large model's step is the other case: it streams its weights from memory for tens of
milliseconds, and one core draws only part of the memory bandwidth (fla's 340M `linear_attn`, 620 MB of bf16
weights on 2 cores: its projections read 11 GB/s on one thread, 18 GB/s on two; the compiled step 77 → 50 ms).
So a model whose weights are at least `STREAMED_WEIGHT_BYTES` decodes on every usable CPU. Prefill is
different — its GEMMs are large — so the engine thread switches to `prefill_threads` (default: every usable
CPU) while it runs the chunked form, and back after. Both counts are ceilings: while other processes hold
this process's CPUs the engine runs fewer (cpu_contention.py: libgomp's spinning workers cost 2-3x beside a busy
neighbour).

"CPUs this process may use" is the smaller of its affinity mask and its cgroup CPU quota (a container limited
to 2 CPUs on a 64-core host gets 1 thread, not 63).

One OpenMP team per process, the engine thread's. libgomp keeps a worker spinning between parallel regions only
while the threads it manages — the pools of every live thread that ever ran a parallel region — fit the CPUs;
past that it spins ~100 iterations and sleeps on a futex, and each of a decode step's ~200 regions then waits
for a wake-up. fla's 340M `linear_attn`, compiled step on 2 threads: 48 ms alone, 77 ms while another live
thread had once run a 2-thread op, 49 ms again once that thread ended. So the other threads that run torch ops
(the event loop, the session store's worker, the compile thread) run them on one thread
(`one_thread_here`), and work outside the engine thread that wants every CPU (loading the model, compile=auto's
measurements) runs in a thread of its own that ends with it, taking its team along (`in_passing_thread`).

torch is imported where a thread count is set, not here: a frontend process reads how many CPUs it may use
(settings.engine_placement) and never loads torch (engine/client.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_DEFAULT_THREADS = 4  # the default's ceiling; `threads` set explicitly may go higher
MAX_DEFAULT_PREFILL_THREADS = 8  # likewise for `prefill_threads`
# a compiled step of fewer rows than this runs on `threads` unless `kernel_threads` is set: below it a second
# OpenMP thread's spinning between the program's small regions takes the CPU the HTTP side needs (docs/engine.md)
KERNEL_THREADS_FROM_ROWS = 32
# weights this large make a decode step bandwidth-bound for milliseconds: every usable CPU decodes (the shipped
# model's 12 MB fit in cache, fla's 340M shapes' 620 MB do not — measured on both sides of it, docs/benchmarks.md)
STREAMED_WEIGHT_BYTES = 256 * 2**20
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadPlan:
    threads: int  # torch intra-op threads (OpenMP), as set: the decode step's
    usable_cpus: float  # min(affinity mask, cgroup quota)
    source: str  # "setting" (asked for) or "default" (derived from usable_cpus and the weights' size)
    omp_wait_policy: str  # OMP_WAIT_POLICY as the process started with it ("default" when unset)
    prefill_threads: int = 1  # the engine thread's count while it runs the chunked form (prefill)
    # the engine thread's count while a compiled CPU program runs: its Inductor kernels keep the count they were
    # built for (`threads`), linserve's own kernels (the projections, the scans) split over this one
    kernel_threads: int = 1
    # ... from a step of this many rows; smaller compiled steps run on `threads` (1: every compiled step)
    kernel_from_rows: int = 1
    weight_bytes: int = 0  # the model's weights as the decode step reads them (0: not known when planned)
    adaptive: bool = False  # both counts are ceilings, lowered while other processes hold the CPUs (cpu_contention)
    # linserve's kernels on their own pool while a compiled program built for one thread runs (kernels/work_pool.h)
    kernel_pool: bool = False

    def describe(self) -> dict:
        return asdict(self)


def affinity_set() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the OS does not say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def affinity_cpus() -> int:
    return len(affinity_set())


def _quota_v2(path: Path) -> float | None:
    try:
        quota, period = (path / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(root: Path) -> float | None:
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_quota_dir(root: Path = CGROUP_ROOT,
                     self_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[float, Path] | None:
    """(CPUs, directory) of the tightest CPU quota this process's cgroup (or any ancestor) sets; None where there
    is none. cgroup v2: `cpu.max` along the process's path from /proc/self/cgroup (inside a container that path
    is usually the root); v1: cpu.cfs_quota_us / cpu.cfs_period_us."""
    limits = []
    try:
        entry = next((line.split(":", 2)[2] for line in self_cgroup.read_text().splitlines()
                      if line.startswith("0::")), None)
    except OSError:
        entry = None
    if entry is not None:
        here = root / entry.strip().lstrip("/")
        while True:
            limit = _quota_v2(here)
            if limit is not None:
                limits.append((limit, here))
            if here == root or root not in here.parents:
                break
            here = here.parent
    v1 = _quota_v1(root)
    if v1 is not None:
        limits.append((v1, root / "cpu"))
    return min(limits, key=lambda pair: pair[0]) if limits else None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota this process's cgroup (or any ancestor) sets, in CPUs; None where there is none."""
    found = cgroup_quota_dir(root, self_cgroup)
    return None if found is None else found[0]


def usable_cpus() -> float:
    quota = cgroup_cpu_quota()
    return float(affinity_cpus()) if quota is None else min(float(affinity_cpus()), quota)


def default_threads(usable: float, weight_bytes: int = 0) -> int:
    """One CPU left for the rest of the server — every CPU for weights of at least STREAMED_WEIGHT_BYTES — at
    least one thread, at most MAX_DEFAULT_THREADS."""
    spare = 0 if weight_bytes >= STREAMED_WEIGHT_BYTES else 1
    return max(1, min(math.floor(usable) - spare, MAX_DEFAULT_THREADS))


def default_prefill_threads(usable: float) -> int:
    """Every CPU this process may use (at least one, at most MAX_DEFAULT_PREFILL_THREADS): a prefill chunk's
    GEMMs are large enough that splitting them pays for the barriers, unlike a decode step's."""
    return max(1, min(math.floor(usable), MAX_DEFAULT_PREFILL_THREADS))


def default_kernel_threads(usable: float, threads: int) -> int:
    """Every CPU this process may use (at most MAX_DEFAULT_THREADS), never fewer than `threads`: in a program
    built for one thread only linserve's projections and scans fork, ~25 parallel regions a step instead of an
    eager step's ~200, and each streams its share of the weights."""
    return max(threads, min(math.floor(usable), MAX_DEFAULT_THREADS))


def plan_threads(requested: int | None, prefill_requested: int | None = None, weight_bytes: int = 0,
                 adaptive: bool = False, kernel_requested: int | None = None, kernel_pool: bool = False) -> ThreadPlan:
    usable = usable_cpus()
    threads = requested if requested is not None else default_threads(usable, weight_bytes)
    prefill = prefill_requested if prefill_requested is not None else default_prefill_threads(usable)
    kernel = kernel_requested if kernel_requested is not None else default_kernel_threads(usable, threads)
    from_rows = 1 if kernel_requested is not None else KERNEL_THREADS_FROM_ROWS
    return ThreadPlan(threads, usable, "setting" if requested is not None else "default",
                      os.environ.get("OMP_WAIT_POLICY", "default").lower(), prefill, kernel, from_rows, weight_bytes,
                      adaptive, kernel_pool)


def apply_threads(requested: int | None, prefill_requested: int | None = None, weight_bytes: int = 0,
                  adaptive: bool = False, kernel_requested: int | None = None, kernel_pool: bool = False) -> ThreadPlan:
    """Set torch's intra-op thread count for this process (before any compiled program is built or loaded:
    Inductor bakes the count into its kernels). `weight_bytes`: the decode model's `weight_bytes(model)`. The
    engine thread then runs each phase on its count (cpu_contention.ThreadCounts: lowered while other processes
    hold the CPUs when `adaptive`)."""
    import torch

    plan = plan_threads(requested, prefill_requested, weight_bytes, adaptive, kernel_requested, kernel_pool)
    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)
    return plan


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters as they are (a decode step reads each once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's kernels run on (libgomp, or Intel's), as this process loaded it: found in
    /proc/self/maps, since wheels bundle it under their own names. None where there is no such file."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith(("libgomp", "libiomp5")) and ".so" in path:
            return ctypes.CDLL(path)
    return None


def one_thread_here() -> None:
    """The calling thread's torch ops run on it alone from now on: OpenMP's per-thread count set to 1 (ATen's
    own per-thread initialisation first, or it would set it back), the process's default — which the engine
    thread runs on — untouched. For every long-lived thread but the engine's (see the module's docstring)."""
    import torch

    torch.get_num_threads()  # (ATen initialises a thread's count at its first use)
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


def in_passing_thread(fn: Callable, *args):
    """`fn(*args)` on a thread of its own, which ends with it: the OpenMP team its ops start ends too, so no idle
    team is left to make the engine's workers sleep between parallel regions."""
    with ThreadPoolExecutor(1, thread_name_prefix="linserve-passing") as passing:  # (leaving joins the thread)
        return passing.submit(fn, *args).result()
