"""The state pool's buffers: zeros, one slot's bytes the config's formula, a slot reset when it is handed out again."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("family", ["gated_deltanet", "gla"])
def test_a_pending_update_is_settled_before_a_slot_is_read_and_dropped_when_the_slot_is_overwritten(tmp_path, family):
    """The folded states (the delta rule's, the gated linear recurrence's) keep each slot's last update pending
    (the decode program applies it as it reads the slot: model/pooled_state.py); anything else that reads or copies
    a slot sees it applied — S·α + k ⊗ u, the commit's roundings — and anything that overwrites a slot drops it."""
    from linserve.model.interface import folded_state_names
    from tests.helpers import require_kernel
    from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint

    require_kernel()
    model = load_checkpoint(write_checkpoint(tmp_path, FAMILY_CASES[family]), torch.device("cpu"),
                            torch.float32)
    pool = StatePool(model, 4, torch.device("cpu"))
    name = folded_state_names(model)[0]
    S, pending = pool.buffers[name], pool.pending[name]
    generator = torch.Generator().manual_seed(0)

    def pend(slot: int, gated: bool = True, name: str = name) -> torch.Tensor:
        """A pending update on `slot` of the folded state `name`; returns the state it stands for."""
        S, pending = pool.buffers[name], pool.pending[name]
        S[slot] = torch.randn(S[slot].shape, generator=generator)
        k, u = torch.randn(pending.k[slot].shape, generator=generator), torch.randn(pending.u[slot].shape,
                                                                                     generator=generator)
        a = torch.rand(pending.alpha[slot].shape, generator=generator)
        pending.k[slot], pending.u[slot], pending.alpha[slot], pending.flag[slot] = k, u, a, 2 if gated else 1
        scaled = S[slot] * a[:, :, None] if gated else S[slot]  # (α per key dimension)
        return scaled + k[:, :, None] * u[:, None, :]  # (H, dk, dv)

    want = pend(1)
    assert torch.equal(pool.export(1)[name], want) and pending.flag[1] == 0 and torch.equal(S[1], want)
    want = pend(2, gated=False)
    assert torch.equal(pool.gather([2, 2]).tensors()[name][1], want) and pending.flag[2] == 0
    want = pend(2)
    pend(3)
    pool.copy(2, 3)  # the source settled, the destination's own pending dropped
    assert torch.equal(S[3], want) and pending.flag[2] == 0 and pending.flag[3] == 0
    pend(0)
    pool.load(0, {key: torch.zeros_like(buffer[0]) for key, buffer in pool.buffers.items()})
    assert pending.flag[0] == 0 and not S[0].any()
    pend(0)
    pool.scatter_tensors(torch.tensor([0]), [buffer[1:2].clone() for buffer in pool.buffers.values()])
    assert pending.flag[0] == 0 and torch.equal(S[0], S[1])
    for _ in range(4):
        pool.allocate()
    pend(3)
    pool.free(3)
    assert pool.allocate() == 3 and pending.flag[3] == 0 and not S[3].any()  # handed out again: reset
    wants = {slot: pend(slot) for slot in (0, 2)}
    pool.settle()
    assert all(torch.equal(S[slot], want) for slot, want in wants.items()) and not pending.flag.any()
    # every folded state at once, the listed slots only (each layer's state its own: the model has several)
    names = folded_state_names(model)
    assert len(names) > 1
    wants = {(state, slot): pend(slot, gated=slot != 1, name=state) for state in names for slot in (0, 1, 2)}
    pool.settle([1, 0, 1])
    for (state, slot), want in wants.items():
        settled = slot in (0, 1)
        assert torch.equal(pool.buffers[state][slot], want) == settled
        assert pool.pending[state].flag[slot] == (0 if settled else 2)
    with pytest.raises(RuntimeError, match="slot 4 is outside the pool of 4"):
        pool.settle([4])
    pool.settle()
    assert all(torch.equal(pool.buffers[state][slot], want) for (state, slot), want in wants.items())
