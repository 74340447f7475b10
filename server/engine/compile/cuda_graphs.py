"""A bucket's program and, on CUDA, its graph: captured once (warm-up on a side stream, then the whole program
reading its rows through a static io tensor), replayed per step. And the engine's step lock."""

from __future__ import annotations

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
    bound: object | None = None  # CPU: the program with the step's unchanging inputs bound (aoti_runner.py)


# Held by every engine step, and by compile=auto's measurements between them (a round never overlaps a step).
# Re-entrant: a measurement may run a step's code on the engine thread itself.
STEP_LOCK = threading.RLock()


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
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (other threads may run kernels meanwhile)
        bucket.outputs = run()
    bucket.graph = graph


def replay(bucket: Bucket, io_rows: list[list[int]], logits_at: int) -> tuple[torch.Tensor, ...]:
    """The bucket's graph run on `io_rows`; its outputs, the logits (output `logits_at`) copied out."""
    pad = bucket.size - len(io_rows[0])
    # rows beyond the batch repeat the first row (a decode program writes every row's state in place: a padded row
    # writes its slot the same bits as the first); their outputs are dropped
    bucket.io.copy_(torch.tensor([row + row[:1] * pad for row in io_rows], dtype=torch.long))  # (r, P) one transfer
    bucket.graph.replay()
    # the outputs are read (the sampled tokens) within this engine step; the logits may outlive
    # it (a prompt-only turn keeps them), so they get their own memory
    outputs = bucket.outputs
    return (*outputs[:logits_at], outputs[logits_at].clone(), *outputs[logits_at + 1 :])
