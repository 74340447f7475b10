"""A DecodeStep's compile thread (compiled_decode.py): which bucket is built next, building or loading each one
(cache.ChildBuilder: a compiler child process, or the artifact already in the cache), compile=auto's verdict on CPU
(verdict.py: timed against eager, provisional under load and measured again when quiet), and the ETA /ready shows.

The step serves on the engine thread meanwhile; the two meet at the step's `_ready` buckets (installed here, read
there), its `demand` (written there: which batches ran eagerly for want of a bucket) and its `calls` (a re-check
waits for the engine to be idle).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from ..cpu_threads import in_passing_thread, one_thread_here
from . import verdict as compile_verdict
from .cache import ChildBuilder, cpp_compiler_available, prune
from .cuda_graphs import STEP_LOCK
from .verdict import Verdict, VerdictStore, judge

logger = logging.getLogger(__name__)


def remaining_s(per_bucket_s: float, elapsed_s: float, left: int) -> float:
    """Seconds until `left` buckets (the current one, `elapsed_s` into it, included) are built at
    `per_bucket_s` each — or, once the current one has taken longer, at the rate it shows (the machine is
    busier than when the rate was measured): the estimate counts down, and grows only while it is exceeded."""
    per = max(per_bucket_s, elapsed_s)
    return max(per - elapsed_s, 0.0) + per * (left - 1)


class BucketBuilds:
    """The buckets of `step` (the DecodeStep that owns this; not imported here: compiled_decode imports this module)
    built or loaded in the background, in the order traffic needs them."""

    def __init__(self, step, on_demand: bool) -> None:
        self.step = step
        self.status = "eager" if step.mode == "off" else "pending"  # → compiling → compiled | declined | failed
        # compiled only where it is not slower
        self.auto_cpu = step.mode == "auto" and step.device.type == "cpu" and step.after is None
        self.verdict: Verdict | None = None  # auto on CPU: compiled or declined here, with its figures
        self.verdicts = VerdictStore(step.cache_dir if self.auto_cpu else None)
        self.measure = compile_verdict.measure  # (eager, compiled, args, hold) -> Measurement; tests inject one
        self.recheck_s = compile_verdict.RECHECK_S
        self.busy_share = compile_verdict.busy_share  # (wait, seconds) -> the machine's busy share; tests inject one
        self._measured: tuple[int, object] | None = None  # the bucket a verdict is (re-)measured with
        self._built = threading.Event()  # the first pass over the buckets is over (wait_compiled)
        self.compile_seconds: dict[int, float] = {}
        self._unavailable: set[int] = set()  # not in the cache, and no compiler here
        self.on_demand = on_demand
        self.wanted: set[int] = set()  # on demand: the buckets asked for so far
        self._wants = threading.Event()  # set by want(): the compile thread has buckets to build
        self.compiling: int | None = None  # the bucket being compiled now
        self.built_seconds: list[float] = []  # buckets compiled here (not loaded): the measured rate of the ETA
        self._bucket_started: float | None = None  # when the bucket being built now began
        self._closed = threading.Event()
        self._builder = None  # the compile thread's, while it runs (close() ends its child)
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._compile_all, name="linserve-compile", daemon=True)
        self._thread.start()

    def close(self, wait: bool = False) -> None:
        """DecodeStep.close."""
        self._closed.set()
        self._wants.set()  # (an on-demand compile thread waiting for wants wakes and ends)
        builder = self._builder  # (the compile thread checks _closed after setting it: one of us sees the other)
        if getattr(builder, "close", None) is not None:
            builder.close(final=True)  # a build already past its check fails instead of starting a new child
        if wait and self._thread is not None:
            self._thread.join()

    def wait(self, timeout: float | None) -> None:
        if self._thread is not None:
            self._built.wait(timeout)

    def want(self, size: int, rows: int) -> None:
        """On demand: build bucket `size`, which `rows` rows run in (once; any thread)."""
        if size in self.wanted:
            return
        self.wanted.add(size)
        logger.info("%s: batch %d pays; its bucket (%d) is compiled next", self.step.label, rows, size)
        if size not in self.step.ready_sizes and self.status == "compiled":
            self.status = "compiling"  # (/ready: not settled until it is built)
        self._wants.set()

    @property
    def eta_s(self) -> float | None:
        """Seconds until every bucket is built, from the rate measured here: the mean time of the buckets
        compiled so far (loaded ones take milliseconds and do not count), scaled up while the current bucket
        takes longer than that (a busy machine). None before one bucket has compiled, and when nothing is left."""
        if self.compiling is None or self._bucket_started is None or not self.built_seconds:
            return None
        left = len(self.step.sizes) - len(self.step.ready_sizes) - len(self._unavailable)  # (the current included)
        return remaining_s(sum(self.built_seconds) / len(self.built_seconds),
                           time.perf_counter() - self._bucket_started, left)

    def _next_size(self) -> int | None:
        """The bucket traffic needs most (decode steps that ran eagerly for want of it), else the smallest; on
        demand, only among those wanted or already in the cache."""
        cached = getattr(self._builder, "cached", lambda _: False)
        ready, demand = self.step.ready_sizes, self.step.demand
        waiting = [size for size in self.step.sizes if size not in ready and size not in self._unavailable
                   and (not self.on_demand or size in self.wanted or cached(size))]
        return max(waiting, key=lambda size: (demand.get(size, 0), -size)) if waiting else None

    def _compile_all(self) -> None:
        one_thread_here()  # (its torch ops are small; the engine's OpenMP team stays the only one)
        after = self.step.after
        if after is not None:  # verification compiles once the decode step has settled (and as it decided)
            while not after.builds._built.wait(1.0):
                if self._closed.is_set():
                    self._built.set()
                    return
            if after.status == "declined":
                self.status = "declined"
                self._built.set()
                return
        self.status = "compiling"
        build = None
        try:
            build = self._builder = self._compiler()
            if self._closed.is_set():
                return  # closed while the builder was made: close() may not have seen it
            if self.auto_cpu:
                self.verdict = self.verdicts.load(self.step.threads)
                if self.verdict is not None:
                    logger.info("compile=auto: using this machine's stored verdict: %s (compiled step %.2fx eager "
                                "at batch %d)", self.verdict.decision, self.verdict.measurement.gain,
                                self.verdict.batch)
            self._build_buckets(build)
            self._built.set()
            if getattr(build, "close", None) is not None:
                build.close()  # no idle compiler child while a provisional verdict waits (a miss starts one)
            while self.on_demand and not self._closed.is_set():  # the buckets speculation asks for, as it does
                self._wants.wait()
                self._wants.clear()
                if not self._closed.is_set():
                    self._build_buckets(build)
                    build.close()
            while self.verdict is not None and self.verdict.provisional and not self._closed.is_set():
                if self._recheck() and self.verdict.decision == "compiled":
                    self._build_buckets(build)
        except Exception:  # noqa: BLE001 - eager keeps serving; the operator learns why from the log
            if self._closed.is_set():
                return  # closed mid-build: the child was ended on purpose
            logger.exception("compiling the decode step failed; serving eagerly")
            self.status = "failed"
        finally:
            self._built.set()
            self.compiling, self._bucket_started = None, None
            if getattr(build, "close", None) is not None:
                build.close()

    def _build_buckets(self, build) -> None:
        """Build or load every bucket not ready yet, in traffic order; stop where the verdict declines."""
        step = self.step
        self.status = "compiling"
        while (size := self._next_size()) is not None:
            if self._closed.is_set():
                return
            if self.verdict is not None and self.verdict.decision == "declined":
                break
            cached = bool(getattr(build, "cached", lambda _: False)(size))
            self.compiling, self._bucket_started = size, time.perf_counter()
            eta = self.eta_s
            if cached or getattr(build, "can_compile", True):  # (else: not in the cache, said once at the end)
                logger.info("%s: %s bucket %d of %d (batch %d)%s", step.label, "loading" if cached else "compiling",
                            len(step.ready_sizes) + 1, len(step.sizes), size,
                            f", ~{eta:.0f} s left" if eta is not None and not cached else "")
            started = self._bucket_started
            program = build(size)
            if self._closed.is_set():
                return
            if program is None:  # not in the cache, and nothing here can compile it
                self._unavailable.add(size)
                continue
            self.compile_seconds[size] = time.perf_counter() - started
            if not cached:
                self.built_seconds.append(self.compile_seconds[size])
            if self.auto_cpu and self._measured is None:
                self._measured = size, program
                if self.verdict is None:
                    self._set_verdict(self._measure_verdict(size, program))
                if self.verdict.decision == "declined":
                    break
            step.install(size, program)
            logger.info("%s bucket %d %s in %.1f s", step.label, size, "loaded" if cached else "compiled",
                        self.compile_seconds[size])
        if self._unavailable:
            logger.info("compile=auto: no C++ compiler here (Inductor needs one on CPU) and no compiled "
                        "bucket for batch %s in the cache; those batches run eagerly", sorted(self._unavailable))
        self.compiling, self._bucket_started = None, None
        self.status = "compiled" if step.ready_sizes or self.on_demand else "declined"

    def _measure_verdict(self, size: int, program) -> Verdict:
        """Time `program` against eager at its bucket, each round holding the engine's step lock."""
        step, calls = self.step, self.step.calls

        def measure():  # on the engine's thread count, in a thread that ends with it (cpu_threads.py)
            torch.set_num_threads(step.threads)
            with torch.inference_mode():
                return self.measure(step.eager_program, program, step.dummy_inputs(size), hold=lambda: STEP_LOCK)

        measurement = in_passing_thread(measure)
        return judge(measurement, size, step.threads, served_meanwhile=step.calls != calls)

    def _set_verdict(self, verdict: Verdict) -> None:
        self.verdicts.save(verdict)  # (a quiet one; stored before it is seen, so whoever sees it finds it stored)
        self.verdict = verdict
        m = verdict.measurement
        logger.info("compile=auto: the compiled step is %.2fx eager here (batch %d, quartiles %.2f-%.2f, %d rounds, "
                    "CPU contention %.0f%%): %s%s", m.gain, verdict.batch, m.low, m.high, m.rounds,
                    100 * m.contention, "serving compiled" if verdict.decision == "compiled" else "serving eagerly",
                    f"; provisional, measured again when quiet (every {self.recheck_s:.0f} s)"
                    if verdict.provisional else "")

    def _recheck(self) -> bool:
        """Measure a provisional verdict again once the engine has been idle for `recheck_s` and the machine's
        CPUs for the probe after it. True if measured."""
        calls = self.step.calls
        if self._closed.wait(self.recheck_s) or self.step.calls != calls or self._measured is None:
            return False  # closing, or the engine served meanwhile: not a quiet moment
        busy = self.busy_share(self._closed.wait, compile_verdict.QUIET_PROBE_S)
        if (busy is not None and busy > compile_verdict.LOAD_LIMIT) or self.step.calls != calls or \
                self._closed.is_set():
            return False  # something else keeps the CPUs busy: measuring now would only add to it
        size, program = self._measured
        before, verdict = self.verdict.decision, self._measure_verdict(size, program)
        if verdict.decision == "declined" and before == "compiled":
            self.step.uninstall_all()  # the engine serves eagerly from its next step
            self.status = "declined"
        elif verdict.decision == "compiled" and before == "declined":
            self.step.install(size, program)  # the rest are built next (_compile_all)
        self._set_verdict(verdict)
        return True

    def _compiler(self) -> ChildBuilder:
        """`build(size) -> program` for this device, holding the compiler child while it runs."""
        step = self.step
        if step.cache_max_gb is not None and step.after is None:  # (once a start: the steps after it share it)
            prune(os.path.dirname(step.cache_dir), int(step.cache_max_gb * 1e9))  # (never raises OSError)
        can_compile = step.mode == "on" or cpp_compiler_available()  # (Triton's launchers need one too)
        device = step.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the child compiles for this one
        return ChildBuilder(step.cache_dir, step.model, step.pool.num_slots, can_compile, step.autotune,
                            step.kind.name, device, step.threads)
