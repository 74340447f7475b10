"""The state pool's buffers: host memory advised as huge pages (model/host_memory.py), zeros, one slot's bytes the
config's formula."""

from __future__ import annotations

import torch

from linserve.model.checkpoint import load_checkpoint
from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.server.engine.state_pool import StatePool
from tests.model.test_host_memory import advised_huge, linux


@linux
def test_the_pools_large_buffers_are_zeros_on_huge_pages_and_slots_are_independent():
    model = load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.bfloat16)
    pool = StatePool(model, 64, torch.device("cpu"))
    assert pool.slot_bytes == model.state_bytes()
    large = [buffer for buffer in pool.buffers.values() if buffer.numel() * buffer.element_size() >= 1 << 20]
    assert large, "the shipped model's S at 64 slots is 12 MB"
    assert all(advised_huge(buffer) and not buffer.any() for buffer in large)
    first, second = pool.allocate(), pool.allocate()
    for buffer in pool.buffers.values():
        buffer[first], buffer[second] = 1, 2
    pool.free(first)
    again = pool.allocate()  # a slot is reset when it is handed out again; the others keep theirs
    assert all(not buffer[again].any() and (buffer[second] == 2).all() for buffer in pool.buffers.values())
    assert all(buffer.sum() == 2 * buffer[second].numel() for buffer in pool.buffers.values())
