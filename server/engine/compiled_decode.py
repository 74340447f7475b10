"""The engine's decode step: eager, or compiled once per batch-size bucket (CUDA graphs on CUDA).

Buckets are powers of two up to the largest decode batch (1, 2, 4, …, 64 for 64 slots); a batch runs in
the smallest ready bucket that holds it, padded with copies of its first row (rows are independent, the
padding's outputs are dropped). A background thread compiles the buckets smallest first while the
engine serves eagerly, so start-up and `/ready` do not wait for the compiler; a batch with no ready
bucket runs eagerly. Inductor's caches live under `compile_cache_dir`, so a restart recompiles quickly.

- CPU: `torch.compile` with frozen weights and max-autotune (Inductor's C++ GEMM template), which
  brings a small-batch step near the time to read the weights once; plain Inductor is barely faster
  than eager here (measured: benchmarks/p6_weight_read.py).
- CUDA: each bucket is a CUDA graph, captured on the engine thread at the bucket's first use, that
  gathers the rows' (S, z) from the state pool's buffers through a static slot index and runs the
  compiled step (the eager one if Inductor cannot compile here). Its outputs are static buffers, read
  (sampled, scattered back) before the next replay.

`compile`: `off` (eager only), `on`, or `auto` — on CUDA the same as `on`; on CPU the first bucket is
timed against eager at start-up and compiling goes on only if it is at least AUTO_MIN_GAIN× faster.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from model import LinearGPT, ModelState
from model.decode_step import flat_decode_step, state_names

from .state_pool import StatePool

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
SETTLED = ("eager", "compiled", "declined", "failed")  # statuses after which nothing more gets compiled
AUTO_MIN_GAIN = 1.1


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two from 1 up to the first one that holds `max_rows`."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


@dataclass
class Bucket:
    size: int
    step: object  # the (compiled) flat step for this batch size
    graph: torch.cuda.CUDAGraph | None = None
    io: torch.Tensor | None = None  # (2, size) int64 on the device: tokens, slot index (CUDA graphs read it)
    outputs: tuple[torch.Tensor, ...] = ()  # the graph's static outputs


# torch.fx's Tracer.trace (which make_fx, and so AOTAutograd and Inductor's pattern matcher, run while
# compiling) patches torch.nn.Module.__call__ and __getattr__ for the whole process while it traces: a model
# call on another thread meanwhile goes through the tracer (seen: NameError "module is not installed as a
# submodule" in a request served eagerly during the background compile). Every trace holds TRACING (see
# guard_tracing) and so does every engine step: a step never runs inside a trace window, a trace never
# starts inside a step. Re-entrant: a recompile traced on the engine thread itself is fine.
TRACING = threading.RLock()


def guard_tracing() -> None:
    """Make torch.fx's Tracer.trace hold TRACING (once per process; subclasses trace through it)."""
    from torch.fx import _symbolic_trace

    original = _symbolic_trace.Tracer.trace
    if getattr(original, "_holds_linserve_lock", False):
        return

    @functools.wraps(original)
    def trace(self, *args, **kwargs):
        with TRACING:
            return original(self, *args, **kwargs)

    trace._holds_linserve_lock = True
    _symbolic_trace.Tracer.trace = trace


def compile_cache_dir(base: str | None, model: LinearGPT, device: torch.device) -> str:
    """Where Inductor keeps this model's compiled buckets: under `base` (unset: the user's cache directory,
    `$XDG_CACHE_HOME/linserve/compile`, else `~/.cache/linserve/compile`), one subdirectory per model
    (config and weights: frozen weights are compiled in), dtype, torch version and device kind — so every
    working directory shares one cache, and nothing compiled for another model or machine is ever reused."""
    import hashlib
    import json
    import platform

    if base is None:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(root, "linserve", "compile")
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    key = f"{digest.hexdigest()[:16]}-{dtype}-torch{torch.__version__}-{where}".replace(" ", "_").replace("/", "_")
    return os.path.join(base, key)


def cpp_compiler_available() -> bool:
    """Inductor builds its CPU kernels with a C++ compiler ($CXX, else g++): a slim image may have none."""
    return any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name)


class DecodeStep:
    """`step(tokens, slots) -> (logits (B, V) fp32, ModelState of B rows)`, from the pool's slots.

    Called on the engine thread only; the compile thread hands over buckets through `_ready`.
    """

    def __init__(self, model: LinearGPT, pool: StatePool, device: torch.device, mode: str = "off",
                 max_rows: int = 64, cache_dir: str | None = None) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
        self.model, self.pool, self.device, self.mode = model, pool, device, mode
        self.names = state_names(model)
        self.buffers = [pool.buffers[name] for name in self.names]  # (num_slots, …) each
        self.eager_step = flat_decode_step(model)  # ids (B, 1), the rows' state → logits, new state
        self.sizes = bucket_sizes(max_rows)
        self.cache_dir = compile_cache_dir(cache_dir, model, device) if mode != "off" else None
        self.status = "eager" if mode == "off" else "pending"  # → compiling → compiled | declined | failed
        self.compile_seconds: dict[int, float] = {}
        self._ready: dict[int, Bucket] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.mode == "off" or self._thread is not None:
            return
        guard_tracing()  # before the first trace: the engine's steps and the compiler's traces never overlap
        self._thread = threading.Thread(target=self._compile_all, name="linserve-compile", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the compile thread has finished (tests, benchmarks). True if every bucket is ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return len(self._ready) == len(self.sizes)

    @property
    def ready_sizes(self) -> list[int]:
        return sorted(self._ready)

    def describe(self) -> dict:
        """For /ready: {"compile", "status", "buckets", "ready"}."""
        return {"compile": self.mode, "status": self.status, "buckets": self.sizes, "ready": self.ready_sizes}

    # ------------------------------------------------------------------ engine thread
    def __call__(self, tokens: list[int], slots: list[int]) -> tuple[torch.Tensor, ModelState]:
        rows = len(slots)
        bucket = self._bucket_for(rows)
        if bucket is None:
            outputs = self._run(self.eager_step, rows, tokens, slots)
        elif self.device.type == "cuda":
            outputs = self._replay(bucket, tokens, slots)
        else:
            outputs = self._run(bucket.step, bucket.size, tokens, slots)
        state = {name: tensor[:rows] for name, tensor in zip(self.names, outputs[1:])}  # (B, …) each
        return outputs[0][:rows], ModelState.from_tensors(state, self.model.config.n_layers, "linear")

    def _gather(self, index: torch.Tensor) -> list[torch.Tensor]:
        return [buffer.index_select(0, index) for buffer in self.buffers]  # (B, …) each

    def _bucket_for(self, rows: int) -> Bucket | None:
        for size in self.sizes:
            if size >= rows:
                return self._ready.get(size)
        return None  # more rows than the largest bucket

    def _run(self, step, size: int, tokens: list[int], slots: list[int]) -> tuple[torch.Tensor, ...]:
        """`step` over the rows padded to `size` (eager: size = rows, no padding)."""
        pad = size - len(slots)
        index = torch.tensor(slots + slots[:1] * pad, dtype=torch.long, device=self.device)  # (P,)
        ids = torch.tensor(tokens + tokens[:1] * pad, dtype=torch.long, device=self.device)[:, None]  # (P, 1)
        return step(ids, *self._gather(index))

    def _replay(self, bucket: Bucket, tokens: list[int], slots: list[int]) -> tuple[torch.Tensor, ...]:
        if bucket.graph is None:
            self._capture(bucket)
        rows = len(slots)
        # rows beyond the batch keep earlier (valid) tokens and slots: their outputs are dropped
        bucket.io[:, :rows].copy_(torch.tensor([tokens, slots], dtype=torch.long))  # (2, B) one transfer
        bucket.graph.replay()
        # the state outputs are read (scattered) within this engine step; the logits may outlive it (a
        # prompt-only turn keeps them), so they get their own memory
        return (bucket.outputs[0].clone(), *bucket.outputs[1:])

    def _capture(self, bucket: Bucket) -> None:
        """Record the bucket's CUDA graph: gather through the static index, then the step."""
        bucket.io = torch.zeros(2, bucket.size, dtype=torch.long, device=self.device)  # (2, P)

        def run() -> tuple[torch.Tensor, ...]:
            return bucket.step(bucket.io[0][:, None], *self._gather(bucket.io[1]))

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, lazy initialisation)
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the compile thread may run kernels
            bucket.outputs = run()
        bucket.graph = graph

    # ------------------------------------------------------------------ compile thread
    def _compile_all(self) -> None:
        if self.device.type == "cpu" and self.mode == "auto" and not cpp_compiler_available():
            logger.info("compile=auto: no C++ compiler here (Inductor needs one on CPU); serving eagerly")
            self.status = "declined"
            return
        self.status = "compiling"
        try:
            step = self._compiler()
            for number, size in enumerate(self.sizes, 1):
                if self._closed.is_set():
                    return
                done = list(self.compile_seconds.values())
                left = f", ~{sum(done) / len(done) * (len(self.sizes) - len(done)):.0f} s left" if done else ""
                logger.info("decode step: compiling bucket %d of %d (batch %d)%s; serving eagerly meanwhile",
                            number, len(self.sizes), size, left)
                started = time.perf_counter()
                try:
                    self._warm(step, size)
                except Exception:  # noqa: BLE001 - a step Inductor cannot build here
                    if self.device.type != "cuda":
                        raise
                    logger.warning("Inductor could not compile the decode step; CUDA graphs of the eager step",
                                   exc_info=True)
                    step = self.eager_step
                self.compile_seconds[size] = time.perf_counter() - started
                if self.mode == "auto" and self.device.type == "cpu" and size == self.sizes[0]:
                    gain = self._measured_gain(step, size)
                    if gain < AUTO_MIN_GAIN:
                        logger.info("compile=auto: the compiled step is %.2fx eager here; serving eagerly", gain)
                        self.status = "declined"
                        return
                self._ready[size] = Bucket(size, step)
                logger.info("decode bucket %d compiled in %.1f s", size, self.compile_seconds[size])
            self.status = "compiled"
        except Exception:  # noqa: BLE001 - eager keeps serving; the operator learns why from the log
            logger.exception("compiling the decode step failed; serving eagerly")
            self.status = "failed"

    def _compiler(self):
        if self.cache_dir:
            os.makedirs(self.cache_dir, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(self.cache_dir)  # read at each use
        import torch._dynamo

        # every bucket (of every model compiled in this process) is one more entry in the step's code cache:
        # past the limit (8 by default) Dynamo would quietly run that code eagerly
        torch._dynamo.config.recompile_limit += len(self.sizes)
        if self.device.type != "cpu":
            return torch.compile(self.eager_step, dynamic=False, fullgraph=True)
        import torch._inductor.config

        # freezing is read from the global config (passed in `options` it has no effect): weights become
        # constants, which the C++ GEMM template of max-autotune needs to pack them
        torch._inductor.config.freezing = True
        torch._inductor.config.autotune_num_choices_displayed = 0  # no autotuning tables on stderr
        torch._inductor.config.max_autotune_report_choices_stats = False
        return torch.compile(self.eager_step, dynamic=False, fullgraph=True, mode="max-autotune-no-cudagraphs")

    def _dummy(self, size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Inputs shaped like a bucket's: tokens (P, 1) and a zero state (P, …) per tensor."""
        ids = torch.zeros(size, 1, dtype=torch.long, device=self.device)  # (P, 1)
        return ids, [torch.zeros((size, *b.shape[1:]), dtype=b.dtype, device=self.device) for b in self.buffers]

    @torch.inference_mode()
    def _warm(self, step, size: int) -> None:
        ids, state = self._dummy(size)
        step(ids, *state)

    @torch.inference_mode()
    def _measured_gain(self, step, size: int, rounds: int = 5, calls: int = 10) -> float:
        """eager time / compiled time for one bucket, interleaved rounds, medians."""
        ids, state = self._dummy(size)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(rounds):
            for name, fn in (("eager", self.eager_step), ("compiled", step)):
                started = time.perf_counter()
                for _ in range(calls):
                    fn(ids, *state)
                times[name].append(time.perf_counter() - started)
        return statistics.median(times["eager"]) / statistics.median(times["compiled"])
