"""The engine's decode step (decode_program.py): eager, or compiled once per batch-size bucket.

Buckets are powers of two up to the largest decode batch (1, 2, 4, …, 64 for 64 slots); a batch runs in
the smallest ready bucket that holds it, padded with copies of its first row (rows are independent, the
padding's outputs are dropped), or eagerly while none is ready. A background thread gets the buckets
ready in the order traffic needs them, while the engine serves, so start-up and `/ready` never wait.

Each bucket is an AOTInductor artifact in the compile cache, built by a child process
(program_compiler.py) and loaded here: the serving process never runs the compiler (no GIL held for seconds
by Dynamo or Inductor, no torch.fx patching while steps run) and a call evaluates no Dynamo guards; a restart
loads the artifacts in milliseconds.
- CPU: C++ kernels (frozen weights; max-autotune's GEMM templates if asked), called with the GIL released.
- CUDA: Triton kernels, and each bucket is a CUDA graph, captured on the engine thread at the bucket's first
  use; it reads its rows through a static (r, P) io tensor, and its outputs are static buffers, read (tokens)
  and scattered back (state) before the next replay. From `start()` every bucket is a graph of the *eager*
  program (captured in milliseconds: graph speed from the first request, no compiler); the compiled program
  replaces each bucket's graph as it is built in the background (captured again at its next use).

`compile`: `off` (eager only), `on`, or `auto` — on CUDA the same as `on`; on CPU the first bucket is
timed against eager and served unless it is measurably slower (compile_verdict.py: a margin, more rounds
where close, provisional under load and measured again, stored once made quietly), and nothing is compiled
without a C++ compiler unless the artifacts are already in the cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from linserve.model import numerics
from linserve.model.decode_step import state_names
from linserve.model.interface import ServedModel

from ..cpu_threads import in_passing_thread, one_thread_here
from ..decode_program import DECODE, DecodeOutputs, ProgramKind, program_pending
from ..sampling import SlotSampling
from ..state_pool import StatePool
from . import verdict as compile_verdict
from .cache import ChildBuilder, claim, compile_cache_dir, cpp_compiler_available, prune
from .cuda_graphs import STEP_LOCK, Bucket, capture, replay
from .verdict import Verdict, VerdictStore, judge

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
SETTLED = ("eager", "compiled", "declined", "failed")  # statuses after which nothing more gets compiled


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two from 1 up to the first one that holds `max_rows`."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


def remaining_s(per_bucket_s: float, elapsed_s: float, left: int) -> float:
    """Seconds until `left` buckets (the current one, `elapsed_s` into it, included) are built at
    `per_bucket_s` each — or, once the current one has taken longer, at the rate it shows (the machine is
    busier than when the rate was measured): the estimate counts down, and grows only while it is exceeded."""
    per = max(per_bucket_s, elapsed_s)
    return max(per - elapsed_s, 0.0) + per * (left - 1)


def argument_spans(kind: ProgramKind, rows: int) -> tuple[int, ...]:
    """`kind.arguments` of a (rows, P) io tensor as (start, count) pairs, one an argument — count 0: the row
    `start` itself, (P,); else rows start … start + count - 1 — read off the views it returns of a probe io, so the
    pairs are what `arguments` takes (aoti_runner.BoundProgram.rows)."""
    probe = torch.arange(2 * rows, dtype=torch.long).view(rows, 2)  # (rows, 2): row r holds 2r, 2r + 1
    spans = []
    for argument in kind.arguments(probe):
        taken = argument.reshape(-1).tolist()
        if argument.dim() not in (1, 2) or argument.shape[-1] != 2 or taken[0] % 2 or \
                taken != list(range(taken[0], taken[0] + len(taken))):
            raise ValueError(f"{kind}: an argument that is not whole, consecutive io rows")
        spans += [taken[0] // 2, len(taken) // 2 if argument.dim() == 2 else 0]
    return tuple(spans)


class DecodeStep:
    """`step(tokens, slots, positions) -> DecodeOutputs`: a decode program over the pool's slots — eager, or
    a compiled bucket (a CUDA graph on CUDA).

    Called on the engine thread only; the compile thread hands over buckets through `_ready`.
    """

    def __init__(self, model: ServedModel, pool: StatePool, sampling: SlotSampling, device: torch.device,
                 mode: str = "off", max_rows: int = 64, cache_dir: str | None = None, autotune: bool = True,
                 kind: ProgramKind = DECODE, after: DecodeStep | None = None, on_demand: bool = False,
                 cache_max_gb: float | None = None) -> None:
        """`kind`: the decode step, or speculative decoding's verification (verify_program.py), which is
        compiled after `after` (the decode step) has settled, follows its `auto` verdict, and is never
        measured itself (the speculation policy times both). `on_demand`: a bucket is compiled only once
        `want` names it (speculation paid at that batch size) — or loaded at start when it is in the cache.
        `cache_max_gb`: the compile cache is pruned to this size when the compile thread of a step that follows no
        other starts (cache.prune; every step claims its own directory when it is made)."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        self.model, self.pool, self.sampling, self.device, self.mode = model, pool, sampling, device, mode
        self.on_cuda = device.type == "cuda"  # (asked every step: `device.type` builds a string — ~6 µs cold, py-spy)
        self.kind, self.after = kind, after
        self.label = getattr(kind, "label", None) or (
            "decode step" if kind.drafts == 0 else f"verification step (k={kind.drafts})")
        self.names = state_names(model)
        self.buffers = [pool.buffers[name] for name in self.names]  # (num_slots, …) each
        self.pending = program_pending(pool, kind)  # the folded states' pending updates (decode programs only)
        numerics.prepare_tables(device)  # the lookup tables exist before any compiler traces the program
        self.eager_program = kind.make(model)
        self.sizes = bucket_sizes(max_rows)
        self.autotune = autotune
        self.threads = torch.get_num_threads()  # the engine's decode count (as apply_threads set it, on this thread)
        self.cache_dir = (compile_cache_dir(cache_dir, model, device, autotune, getattr(kind, "sources", ()))
                          if mode != "off" else None)
        self.cache_max_gb = cache_max_gb
        if self.cache_dir is not None:
            claim(self.cache_dir)  # (before any compile thread of this process prunes the cache)
        self.status = "eager" if mode == "off" else "pending"  # → compiling → compiled | declined | failed
        # compiled only where it is not slower
        self.auto_cpu = mode == "auto" and device.type == "cpu" and after is None
        self.verdict: Verdict | None = None  # auto on CPU: compiled or declined here, with its figures
        self.verdicts = VerdictStore(self.cache_dir if self.auto_cpu else None)
        self.measure = compile_verdict.measure  # (eager, compiled, args, hold) -> Measurement; tests inject one
        self.recheck_s = compile_verdict.RECHECK_S
        self.busy_share = compile_verdict.busy_share  # (wait, seconds) -> the machine's busy share; tests inject one
        self.calls = 0  # programs run by the engine (a re-check waits for it to be idle)
        self._measured: tuple[int, object] | None = None  # the bucket a verdict is (re-)measured with
        self._built = threading.Event()  # the first pass over the buckets is over (wait_compiled)
        self.compile_seconds: dict[int, float] = {}
        self._ready: dict[int, Bucket] = {}
        self._spans: dict[int, tuple[int, ...]] = {}  # io rows → the bound program's argument spans (argument_spans)
        self._unavailable: set[int] = set()  # not in the cache, and no compiler here
        self.demand: dict[int, int] = {}  # bucket → decode steps run eagerly for want of it (compile order)
        self.on_demand = on_demand
        self.wanted: set[int] = set()  # on demand: the buckets asked for so far
        self._wants = threading.Event()  # set by want(): the compile thread has buckets to build
        self.compiling: int | None = None  # the bucket being compiled now
        self.built_seconds: list[float] = []  # buckets compiled here (not loaded): the measured rate of the ETA
        self._bucket_started: float | None = None  # when the bucket being built now began
        self._closed = threading.Event()
        self._builder = None  # the compile thread's, while it runs (close() ends its child)
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.mode == "off" or self._thread is not None:
            return
        if self.device.type != "cpu":
            for size in self.sizes:  # graph speed at once: graphs of the eager program until compiled ones come
                self._ready.setdefault(size, Bucket(size, self.eager_program, final=False))
            logger.info("%s: CUDA graphs of the eager program for batches %s (captured at first use); compiled "
                        "programs replace them as they are built", self.label, self.sizes)
        self._thread = threading.Thread(target=self._compile_all, name="linserve-compile", daemon=True)
        self._thread.start()

    def close(self, wait: bool = False) -> None:
        """Stop compiling (a compiler child is killed at once); eager and ready buckets keep working. With
        `wait`, return only once the compile thread has ended (a process about to exit: nothing of it runs on
        while the interpreter tears down the native libraries under it)."""
        self._closed.set()
        self._wants.set()  # (an on-demand compile thread waiting for wants wakes and ends)
        builder = self._builder  # (the compile thread checks _closed after setting it: one of us sees the other)
        if getattr(builder, "close", None) is not None:
            builder.close(final=True)  # a build already past its check fails instead of starting a new child
        if wait and self._thread is not None:
            self._thread.join()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until every bucket has been built, loaded or given up on (tests, benchmarks) — not for a
        provisional verdict's later re-checks. True if every bucket is ready."""
        if self._thread is not None:
            self._built.wait(timeout)
        ready = self.ready_sizes
        return all(size in ready for size in self.sizes)  # (a test narrowing `sizes` may find more ready)

    def want(self, rows: int) -> None:
        """On demand: get the bucket that `rows` rows run in compiled (once; any thread)."""
        size = self.bucket_size(rows) if self.on_demand else None
        if size is None or size in self.wanted:
            return
        self.wanted.add(size)
        logger.info("%s: batch %d pays; its bucket (%d) is compiled next", self.label, rows, size)
        if size not in self.ready_sizes and self.status == "compiled":
            self.status = "compiling"  # (/ready: not settled until it is built)
        self._wants.set()

    @property
    def ready_sizes(self) -> list[int]:
        """The buckets whose final program is ready (compiled, or loaded from the cache)."""
        return sorted(size for size, bucket in list(self._ready.items()) if bucket.final)  # (a snapshot: the
        # compile thread adds buckets meanwhile)

    @property
    def graph_sizes(self) -> list[int]:
        """CUDA: the buckets served by a graph of the eager program until their compiled program is ready."""
        return sorted(size for size, bucket in list(self._ready.items()) if not bucket.final)

    def describe(self) -> dict:
        """For /ready, /version and /metrics: {"compile", "status", "buckets", "ready", "compiling", "eta_s",
        "verdict"} (the verdict: compile=auto on CPU, once made — see compile_verdict.Verdict.describe)."""
        eta = self.eta_s
        eta = None if eta is None else round(eta, 1)
        verdict = self.verdict.describe() if self.verdict is not None else None
        wanted = {"wanted": sorted(self.wanted)} if self.on_demand else {}  # (the buckets asked for so far)
        return {"compile": self.mode, "status": self.status, "buckets": self.sizes, "ready": self.ready_sizes,
                "eager_graphs": self.graph_sizes, "compiling": self.compiling, "eta_s": eta, "verdict": verdict,
                **wanted}

    # ------------------------------------------------------------------ engine thread
    def __call__(self, tokens: list[int], slots: list[int], positions: list[int]) -> DecodeOutputs:
        """One decode program over the rows (tokens consumed, their slots, the positions of the tokens to
        choose); the program writes each row's new state into its slot (decode_program)."""
        return DecodeOutputs(*self.run([tokens, slots, positions]))

    def run(self, io_rows: list[list[int]]) -> list[torch.Tensor]:
        """The program over the rows given as its io tensor's rows (`ProgramKind`), padded to the bucket and
        unpadded again; outputs in the program's order."""
        rows = len(io_rows[0])
        self.calls += 1
        bucket = self._bucket_for(rows)
        if bucket is not None and bucket.graph is None and self.on_cuda:
            bucket = self._captured(bucket)
        if bucket is None:
            outputs = self._run(self.eager_program, rows, io_rows)
        elif self.on_cuda:
            outputs = replay(bucket, io_rows, self.kind.logits_output)
        else:
            outputs = self._run(bucket.step, bucket.size, io_rows, bucket.bound)
        if len(outputs[0]) != rows:  # padded to the bucket: the padding's outputs are dropped
            outputs = [tensor[:rows] for tensor in outputs]
        return list(outputs)

    def bucket_ready(self, rows: int) -> int | None:
        """The size of the compiled bucket `rows` would run in now (None: eagerly, or a graph of the eager
        program — its costs are not the compiled one's)."""
        size = self.bucket_size(rows)
        bucket = self._ready.get(size)
        return size if bucket is not None and bucket.final else None

    def bucket_size(self, rows: int) -> int | None:
        """The bucket `rows` rows run in (None: more than the largest)."""
        return next((size for size in self.sizes if size >= rows), None)

    def _bucket_for(self, rows: int) -> Bucket | None:
        for size in self.sizes:
            if size >= rows:
                bucket = self._ready.get(size)
                if bucket is None or not bucket.final:  # demand orders what is compiled next
                    self.demand[size] = self.demand.get(size, 0) + 1
                return bucket
        return None  # more rows than the largest bucket

    def _inputs(self, io: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The program's arguments from its io tensor (rows, P)."""
        return (*self.kind.arguments(io), *self._unchanging())

    def _unchanging(self) -> tuple[torch.Tensor, ...]:
        """The arguments after the io rows: the same tensors on every call."""
        return (*self.buffers, *self.sampling.tensors(), *self.pending)

    def _bucket(self, size: int, program) -> Bucket:
        """A compiled bucket, its program bound to the unchanging arguments where it can be (a CPU artifact
        through linserve's kernels: aoti_runner.BoundProgram)."""
        bind = getattr(program, "bind", None)
        return Bucket(size, program, bound=bind(self._unchanging()) if bind is not None else None)

    def _run(self, program, size: int, io_rows: list[list[int]], bound=None) -> tuple[torch.Tensor, ...]:
        """`program` over the rows padded to `size` with copies of the first (eager: size = rows); `bound`, where
        given, is the program with the unchanging arguments bound: called with the io rows alone."""
        pad = size - len(io_rows[0])
        padded = [row + row[:1] * pad for row in io_rows] if pad else io_rows  # (r, P)
        if bound is not None:  # (no io tensor made here: the program's leading inputs are made in C++)
            rows = len(padded)
            spans = self._spans.get(rows) or self._spans.setdefault(rows, argument_spans(self.kind, rows))
            return bound.rows([v for row in padded for v in row], rows, spans)
        return program(*self._inputs(torch.tensor(padded, dtype=torch.long, device=self.device)))

    def _captured(self, bucket: Bucket) -> Bucket | None:
        """The bucket with its graph captured; a graph of the eager program that cannot be captured (an op that
        syncs with the host, say) is given up — eager launches serve that batch until the compiled program
        comes — rather than failing the step."""
        if bucket.final:
            self._capture(bucket)
            return bucket
        try:
            self._capture(bucket)
            return bucket
        except Exception:  # noqa: BLE001 - logged; served eagerly
            logger.warning("%s: the eager program cannot be captured as a CUDA graph for batch %d; eager launches "
                           "until its compiled program is ready", self.label, bucket.size, exc_info=True)
            if self._ready.get(bucket.size) is bucket:
                del self._ready[bucket.size]
            return None

    def _capture(self, bucket: Bucket) -> None:
        """Capture with the pool kept as it was: the warm-up runs execute the program, and a decode program
        writes its rows' state in place (slot 0's here, for the zeroed io)."""
        saved = [buffer.clone() for buffer in self.buffers]
        try:
            capture(bucket, self._inputs, self.kind.io_rows, self.device)
        finally:
            for buffer, copy in zip(self.buffers, saved):
                buffer.copy_(copy)

    # ------------------------------------------------------------------ compile thread
    def _next_size(self) -> int | None:
        """The bucket traffic needs most (decode steps that ran eagerly for want of it), else the smallest; on
        demand, only among those wanted or already in the cache."""
        cached = getattr(self._builder, "cached", lambda _: False)
        waiting = [size for size in self.sizes if size not in self.ready_sizes and size not in self._unavailable
                   and (not self.on_demand or size in self.wanted or cached(size))]
        return max(waiting, key=lambda size: (self.demand.get(size, 0), -size)) if waiting else None

    def _compile_all(self) -> None:
        one_thread_here()  # (its torch ops are small; the engine's OpenMP team stays the only one)
        build = None
        if self.after is not None:  # verification compiles once the decode step has settled (and as it decided)
            while not self.after._built.wait(1.0):
                if self._closed.is_set():
                    self._built.set()
                    return
            if self.after.status == "declined":
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
                self.verdict = self.verdicts.load(self.threads)
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

    @property
    def eta_s(self) -> float | None:
        """Seconds until every bucket is built, from the rate measured here: the mean time of the buckets
        compiled so far (loaded ones take milliseconds and do not count), scaled up while the current bucket
        takes longer than that (a busy machine). None before one bucket has compiled, and when nothing is left."""
        if self.compiling is None or self._bucket_started is None or not self.built_seconds:
            return None
        left = len(self.sizes) - len(self.ready_sizes) - len(self._unavailable)  # the current bucket included
        return remaining_s(sum(self.built_seconds) / len(self.built_seconds),
                           time.perf_counter() - self._bucket_started, left)

    def _build_buckets(self, build) -> None:
        """Build or load every bucket not ready yet, in traffic order; stop where the verdict declines."""
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
                logger.info("%s: %s bucket %d of %d (batch %d)%s", self.label, "loading" if cached else "compiling",
                            len(self.ready_sizes) + 1, len(self.sizes), size,
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
            self._ready[size] = self._bucket(size, program)
            logger.info("%s bucket %d %s in %.1f s", self.label, size, "loaded" if cached else "compiled",
                        self.compile_seconds[size])
        if self._unavailable:
            logger.info("compile=auto: no C++ compiler here (Inductor needs one on CPU) and no compiled "
                        "bucket for batch %s in the cache; those batches run eagerly", sorted(self._unavailable))
        self.compiling, self._bucket_started = None, None
        self.status = "compiled" if self.ready_sizes or self.on_demand else "declined"

    def _measure_verdict(self, size: int, program) -> Verdict:
        """Time `program` against eager at its bucket, each round holding the engine's step lock."""
        calls = self.calls

        def measure():  # on the engine's thread count, in a thread that ends with it (cpu_threads.py)
            torch.set_num_threads(self.threads)
            with torch.inference_mode():
                return self.measure(self.eager_program, program, self._dummy(size), hold=lambda: STEP_LOCK)

        measurement = in_passing_thread(measure)
        return judge(measurement, size, self.threads, served_meanwhile=self.calls != calls)

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
        calls = self.calls
        if self._closed.wait(self.recheck_s) or self.calls != calls or self._measured is None:
            return False  # closing, or the engine served meanwhile: not a quiet moment
        busy = self.busy_share(self._closed.wait, compile_verdict.QUIET_PROBE_S)
        if (busy is not None and busy > compile_verdict.LOAD_LIMIT) or self.calls != calls or self._closed.is_set():
            return False  # something else keeps the CPUs busy: measuring now would only add to it
        size, program = self._measured
        before, verdict = self.verdict.decision, self._measure_verdict(size, program)
        if verdict.decision == "declined" and before == "compiled":
            self._ready.clear()  # the engine serves eagerly from its next step
            self.status = "declined"
        elif verdict.decision == "compiled" and before == "declined":
            self._ready[size] = self._bucket(size, program)  # the rest are built next (_compile_all)
        self._set_verdict(verdict)
        return True

    def _compiler(self) -> ChildBuilder:
        """`build(size) -> program` for this device, holding the compiler child while it runs."""
        if self.cache_max_gb is not None and self.after is None:  # (once a start: the steps after it share it)
            prune(os.path.dirname(self.cache_dir), int(self.cache_max_gb * 1e9))  # (never raises OSError)
        can_compile = self.mode == "on" or cpp_compiler_available()  # (Triton's launchers need one too)
        device = self.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the child compiles for this one
        return ChildBuilder(self.cache_dir, self.model, self.pool.num_slots, can_compile, self.autotune,
                            self.kind.name, device, self.threads)

    def _dummy(self, size: int) -> tuple[torch.Tensor, ...]:
        """A bucket's arguments: rows 0 of the pool (zeroed copies: nothing real is read or written)."""
        io = torch.zeros(self.kind.io_rows, size, dtype=torch.long, device=self.device)  # (r, P)
        buffers = [torch.zeros_like(t) for t in (*self.buffers, *self.sampling.tensors(), *self.pending)]
        return (*self.kind.arguments(io), *buffers)
