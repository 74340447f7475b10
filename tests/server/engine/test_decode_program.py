"""The decode program reading a family's state from the pool in place (model/pooled_state.py) computes what it
computed over gathered rows: the same tokens and logits and, after every step, the same pool — a padded row's
repeated slot written once, a row whose logits are not finite leaving its slot as it was."""

from __future__ import annotations

import pytest
import torch

from linserve.model.checkpoint import load_checkpoint
from linserve.model.interface import folded_state_names, pooled_state_names
from linserve.model.loading import DEFAULT_CHECKPOINT, resolve_dtype
from linserve.server.engine import decode_program as programs
from linserve.server.engine.sampling import SlotSampling
from linserve.server.engine.state_pool import StatePool
from tests.helpers import SamplingParams, require_kernel
from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint

CASES = {"linear_attn": {**FAMILY_CASES["linear_attn"], "norm_feature_map": False},
         **{name: FAMILY_CASES[name] for name in ("gla", "retnet", "gated_deltanet", "hybrid", "mamba2")}}


@pytest.fixture(scope="module", params=["linear_gpt", *sorted(CASES)])
def family_model(request, tmp_path_factory):
    device = torch.device("cpu")
    dtype = resolve_dtype("auto", device)  # the default: bf16 where it is fast
    if request.param == "linear_gpt":  # the shipped model (its z gathered, beside S read in place)
        return load_checkpoint(DEFAULT_CHECKPOINT, device, dtype)
    directory = write_checkpoint(tmp_path_factory.mktemp(request.param), CASES[request.param])
    return load_checkpoint(directory, device, dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaN where the other has NaN."""
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def run_steps(model, program_of, poisoned_slot: int | None, folded: bool = False) -> tuple[list, list[torch.Tensor]]:
    torch.manual_seed(0)
    pool = StatePool(model, 6, torch.device("cpu"))
    for buffer in pool.buffers.values():
        if buffer.dtype.is_floating_point:
            buffer.normal_()
    if poisoned_slot is not None:  # the last layer's state only: the other layers' stay finite, and must stay put
        pool.buffers[pooled_state_names(model)[-1]][poisoned_slot].fill_(float("nan"))
    sampling = SlotSampling(pool.num_slots, model.config.vocab_size, torch.device("cpu"))
    for slot in range(pool.num_slots):
        sampling.assign(slot, SamplingParams(temperature=0.0 if slot % 2 else 0.8), 7 + slot, None, [1, 2])
    program = program_of(model)
    slots = torch.tensor([3, 0, 5, 3])  # the last row pads: the first row's slot and token
    tokens, outputs = torch.tensor([11, 12, 13, 11]), []
    with torch.no_grad():
        for position in range(4):
            pending = pool.pending_tensors() if folded else []  # (the commits noted for the next read)
            out = program(tokens, slots, torch.full((4,), position), *pool.buffers.values(), *sampling.tensors(),
                          *pending)
            tokens = torch.where(out[1], out[0], 1)  # (tokens, finite, uniforms, processed, logits, …)
            outputs.append([t.clone() for t in (out[0], out[1], out[4])])
    if folded:
        assert pool.pending and any(bool(t.any()) for t in pool.pending_tensors()[3::4])  # updates left pending
    pool.settle()  # (the pool as its states)
    return outputs, [buffer.clone() for buffer in pool.buffers.values()]


@pytest.mark.parametrize("poisoned_slot", [None, 0], ids=["finite", "one-row-not-finite"])
def test_reading_the_pool_in_place_computes_what_the_gathered_rows_did(family_model, poisoned_slot, monkeypatch):
    require_kernel()
    names = pooled_state_names(family_model)
    assert names and set(names) <= set(StatePool(family_model, 1, torch.device("cpu")).buffers)
    in_place = run_steps(family_model, programs.decode_program, poisoned_slot)
    runs = [in_place]
    if folded_state_names(family_model):  # the commits folded into the next read, too
        runs.append(run_steps(family_model, programs.decode_program, poisoned_slot, folded=True))
    monkeypatch.setattr(programs, "pooled_state_names", lambda model: [])
    monkeypatch.setattr(programs, "folded_state_names", lambda model: [])
    gathered = run_steps(family_model, programs.decode_program, poisoned_slot)
    for run in runs:
        for ours, theirs in zip(run[0], gathered[0]):
            assert all(same(a, b) for a, b in zip(ours, theirs))  # tokens, finite, logits
        assert all(same(a, b) for a, b in zip(run[1], gathered[1]))  # the pool after the steps
    if poisoned_slot is not None:
        assert not any(step[1][1] for step in in_place[0])  # the poisoned row never finite, its slot left alone
        assert all(step[1][0] for step in in_place[0])
