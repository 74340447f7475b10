"""A bucket's program and, on CUDA, its graph: captured once (warm-up on a side stream, then the whole program
reading its rows through a static io tensor), replayed per step. And the lock that keeps torch.fx's tracing (a
compile on another thread) and the engine's steps apart."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Bucket:
    size: int
    step: object  # the (compiled) flat step for this batch size
    final: bool = True  # False: a CUDA graph of the eager program, until the compiled one replaces it
    graph: torch.cuda.CUDAGraph | None = None
    io: torch.Tensor | None = None  # (rows, size) int64 on the device: the program's io (CUDA graphs read it)
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


def capture(bucket: Bucket, inputs: Callable[[torch.Tensor], tuple], io_rows: int, device: torch.device) -> None:
    """Record the bucket's CUDA graph: the whole program, reading its rows through the static io tensor."""
    bucket.io = torch.zeros(io_rows, bucket.size, dtype=torch.long, device=device)  # (r, P)

    def run() -> tuple[torch.Tensor, ...]:
        return bucket.step(*inputs(bucket.io))

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the graph (allocator, lazy initialisation)
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the compile thread may run kernels
        bucket.outputs = run()
    bucket.graph = graph


def replay(bucket: Bucket, io_rows: list[list[int]]) -> tuple[torch.Tensor, ...]:
    rows = len(io_rows[0])
    # rows beyond the batch keep earlier (valid) tokens, slots and positions: their outputs are dropped
    bucket.io[:, :rows].copy_(torch.tensor(io_rows, dtype=torch.long))  # (r, B) one transfer
    bucket.graph.replay()
    # the outputs are read (sampled tokens, scattered state) within this engine step; the logits may outlive
    # it (a prompt-only turn keeps them), so they get their own memory
    return (*bucket.outputs[:5], bucket.outputs[5].clone(), *bucket.outputs[6:])
