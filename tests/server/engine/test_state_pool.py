"""The state pool's buffers: zeros, one slot's bytes the config's formula, a slot reset when it is handed out again."""

from __future__ import annotations

import torch

from linserve.model.checkpoint import load_checkpoint
from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.server.engine.state_pool import StatePool


def test_the_pools_buffers_are_zeros_and_slots_are_independent():
    model = load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.bfloat16)
    pool = StatePool(model, 64, torch.device("cpu"))
    assert pool.slot_bytes == model.state_bytes()
    assert all(not buffer.any() for buffer in pool.buffers.values())
    first, second = pool.allocate(), pool.allocate()
    for buffer in pool.buffers.values():
        buffer[first], buffer[second] = 1, 2
    pool.free(first)
    again = pool.allocate()  # a slot is reset when it is handed out again; the others keep theirs
    assert all(not buffer[again].any() and (buffer[second] == 2).all() for buffer in pool.buffers.values())
    assert all(buffer.sum() == 2 * buffer[second].numel() for buffer in pool.buffers.values())
