"""The engine's decode step (decode_program.py): eager, or compiled once per batch-size bucket.

Buckets are powers of two up to the largest decode batch (1, 2, 4, …, 64 for 64 slots); a batch runs in
the smallest ready bucket that holds it, padded with copies of its first row (rows are independent, the
padding's outputs are dropped), or eagerly while none is ready. A background thread (bucket_builds.py) gets the
buckets ready in the order traffic needs them, while the engine serves, so start-up and `/ready` never wait.

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
timed against eager and served unless it is measurably slower (verdict.py: a margin, more rounds
where close, provisional under load and measured again, stored once made quietly), and nothing is compiled
without a C++ compiler unless the artifacts are already in the cache.
"""

from __future__ import annotations

import logging

import torch

from linserve.model import numerics
from linserve.model.decode_step import state_names
from linserve.model.interface import ServedModel

from ..decode_program import DECODE, DecodeOutputs, ProgramKind, program_pending
from ..sampling import SlotSampling
from ..state_pool import StatePool
from .bucket_builds import BucketBuilds
from .cache import claim, compile_cache_dir
from .cuda_graphs import Bucket, capture, replay
from .verdict import Verdict

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
SETTLED = ("eager", "compiled", "declined", "failed")  # statuses after which nothing more gets compiled


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two from 1 up to the first one that holds `max_rows`."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


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

    Called on the engine thread only; the compile thread (`builds`) hands over buckets through `install`.
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
        self.calls = 0  # programs run by the engine (a re-check waits for it to be idle)
        self._ready: dict[int, Bucket] = {}
        self._spans: dict[int, tuple[int, ...]] = {}  # io rows → the bound program's argument spans (argument_spans)
        self.demand: dict[int, int] = {}  # bucket → decode steps run eagerly for want of it (compile order)
        self.builds = BucketBuilds(self, on_demand)  # the compile thread (bucket_builds.py)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.mode == "off" or self.builds.started:
            return
        if self.device.type != "cpu":
            for size in self.sizes:  # graph speed at once: graphs of the eager program until compiled ones come
                self._ready.setdefault(size, Bucket(size, self.eager_program, final=False))
            logger.info("%s: CUDA graphs of the eager program for batches %s (captured at first use); compiled "
                        "programs replace them as they are built", self.label, self.sizes)
        self.builds.start()

    def close(self, wait: bool = False) -> None:
        """Stop compiling (a compiler child is killed at once); eager and ready buckets keep working. With
        `wait`, return only once the compile thread has ended (a process about to exit: nothing of it runs on
        while the interpreter tears down the native libraries under it)."""
        self.builds.close(wait)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until every bucket has been built, loaded or given up on (tests, benchmarks) — not for a
        provisional verdict's later re-checks. True if every bucket is ready."""
        self.builds.wait(timeout)
        ready = self.ready_sizes
        return all(size in ready for size in self.sizes)  # (a test narrowing `sizes` may find more ready)

    def want(self, rows: int) -> None:
        """On demand: get the bucket that `rows` rows run in compiled (once; any thread)."""
        size = self.bucket_size(rows) if self.builds.on_demand else None
        if size is not None:
            self.builds.want(size, rows)

    @property
    def status(self) -> str:
        """eager (compile off) | pending → compiling → compiled | declined | failed (bucket_builds.py)."""
        return self.builds.status

    @property
    def verdict(self) -> Verdict | None:
        """compile=auto on CPU: compiled or declined, with its figures (once made)."""
        return self.builds.verdict

    @property
    def compile_seconds(self) -> dict[int, float]:
        """Each bucket built or loaded so far: the seconds it took."""
        return self.builds.compile_seconds

    @property
    def eta_s(self) -> float | None:
        return self.builds.eta_s

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
        builds = self.builds
        wanted = {"wanted": sorted(builds.wanted)} if builds.on_demand else {}  # (the buckets asked for so far)
        return {"compile": self.mode, "status": self.status, "buckets": self.sizes, "ready": self.ready_sizes,
                "eager_graphs": self.graph_sizes, "compiling": builds.compiling, "eta_s": eta, "verdict": verdict,
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

    # ------------------------------------------------------------------ from the compile thread
    def install(self, size: int, program) -> None:
        """Serve bucket `size` with `program` from the next step on."""
        self._ready[size] = self._bucket(size, program)

    def uninstall_all(self) -> None:
        """Serve eagerly from the next step on (compile=auto declined on a re-check)."""
        self._ready.clear()

    def dummy_inputs(self, size: int) -> tuple[torch.Tensor, ...]:
        """A bucket's arguments: rows 0 of the pool (zeroed copies: nothing real is read or written)."""
        io = torch.zeros(self.kind.io_rows, size, dtype=torch.long, device=self.device)  # (r, P)
        buffers = [torch.zeros_like(t) for t in (*self.buffers, *self.sampling.tensors(), *self.pending)]
        return (*self.kind.arguments(io), *buffers)
